"""``--no-example``: the digits data module (the whole ``data.py``) gives way to the skeleton in
``scripts/skeleton/`` (synthetic data in plain loaders), the tests of the example's data (those of ``tests/`` that
name it) to the skeleton's, and the scripts that use the digits DataModule stay behind; the Classifier, the nets and
the tests that do not name the digits (the engine's self-check) stay. Used by scripts/template_copy.py; only the
standard library.
"""

import ast
import re
from pathlib import Path

EXAMPLE_WORD = "digits"  # a test of tests/ that mentions it is the example's: left behind
TESTS = "tests"  # the project's tests; the skeleton's are put in with them


def drop_example(texts: dict[Path, str], skeleton: Path, package: str) -> dict[str, str]:
    """Merges ``skeleton`` (a folder with files of ``package`` and tests) into ``texts``; returns ``{example class:
    skeleton class}`` to rename."""
    skeletons = sorted(p for p in skeleton.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    renames: dict[str, str] = {}
    for path in skeletons:
        rel = path.relative_to(skeleton)
        if rel.parts[0] == package and rel.suffix == ".py":
            if rel not in texts:
                raise RuntimeError(f"--no-example: the template has no {rel} for {path} to go into")
            removed, added = _datamodules(texts[rel]), _classes(path.read_text())
            if not removed or not added:
                raise RuntimeError(f"--no-example: expected a LightningDataModule in {rel} and a class in {path}")
            texts[rel] = path.read_text()  # the whole module: the example's data and its imports go with it
            renames.update(dict.fromkeys(removed, added[0]))
    # The tests of tests/ that name the example's data go; the skeleton puts its own there. Any other module
    # outside the package that uses the example's classes goes.
    uses = re.compile(rf"\b({'|'.join(map(re.escape, renames))})\b")
    mentions = re.compile(f"{uses.pattern}|{re.escape(EXAMPLE_WORD)}", re.I)
    for rel in [r for r in texts if r.suffix == ".py" and r.parts[0] != package]:
        if (rel.parts[0] == TESTS and rel.name.startswith("test_") and mentions.search(texts[rel])) or uses.search(
            texts[rel]
        ):
            del texts[rel]
    for path in skeletons:
        rel = path.relative_to(skeleton)
        if rel.parts[0] != package:
            texts[rel] = path.read_text()
    return renames


def _classes(source: str) -> list[str]:
    return [node.name for node in ast.parse(source).body if isinstance(node, ast.ClassDef)]


def _datamodules(source: str) -> list[str]:
    """The LightningDataModule classes of ``source`` (subclasses of one another included), to rename in configs."""
    found: list[str] = []
    for node in ast.parse(source).body:
        bases = {getattr(b, "attr", getattr(b, "id", "")) for b in getattr(node, "bases", [])}
        if isinstance(node, ast.ClassDef) and bases & {"LightningDataModule", *found}:
            found.append(node.name)
    return found
