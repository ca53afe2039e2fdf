"""``--no-example``: the digits data module (the whole ``data.py``) gives way to the skeleton in
``scripts/skeleton/`` (synthetic data in plain loaders), and the tests that mention the digits and the scripts that
use their DataModule stay behind; the Classifier and the nets stay. Used by scripts/template_copy.py; only the
standard library.
"""

import ast
import re
from pathlib import Path

EXAMPLE_WORD = "digits"  # the tests that mention it stay behind


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
    # Tests that mention the example go; so does any other module outside the package that uses its classes.
    uses = re.compile(rf"\b({'|'.join(map(re.escape, renames))})\b")
    mentions = re.compile(f"{uses.pattern}|{re.escape(EXAMPLE_WORD)}", re.I)
    for rel in [
        r for r in texts if r.suffix == ".py" and r.parts[0] != package and r.name not in ("conftest.py", "helpers.py")
    ]:
        if (mentions if rel.name.startswith("test_") else uses).search(texts[rel]):
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
