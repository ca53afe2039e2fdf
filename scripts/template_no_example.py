"""``--no-example``: the digits DataModule gives way to the skeleton in ``scripts/skeleton/`` (synthetic data in the
same resumable loaders), and the tests that mention the digits and the scripts that use their DataModule stay
behind; the Classifier and the nets stay. Used by scripts/template_copy.py; only the standard library.
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
            module = ".".join(rel.with_suffix("").parts)
            texts[rel], removed, added = _swap_datamodule(texts[rel], path.read_text(), module)
            renames.update(dict.fromkeys(removed, added))
    # Tests that mention the example go; so does any other module outside the package that uses its classes.
    uses = re.compile(rf"\b({'|'.join(map(re.escape, renames))})\b")
    mentions = re.compile(f"{uses.pattern}|{re.escape(EXAMPLE_WORD)}", re.I)
    for rel in [r for r in texts if r.suffix == ".py" and r.parts[0] != package and r.name != "conftest.py"]:
        if (mentions if rel.name.startswith("test_") else uses).search(texts[rel]):
            del texts[rel]
    for path in skeletons:
        rel = path.relative_to(skeleton)
        if rel.parts[0] != package:
            texts[rel] = path.read_text()
    return renames


def _swap_datamodule(target: str, skeleton: str, module: str) -> tuple[str, list[str], str]:
    """``target`` with its LightningDataModule classes replaced by the classes of ``skeleton``.

    The skeleton's docstring replaces the target's; its imports are added unless the target binds them already
    or they import from ``module`` itself (they are there so that the skeleton is a valid module on its own).
    """
    tree, skel = ast.parse(target), ast.parse(skeleton)
    classes: list[ast.ClassDef] = []
    for node in tree.body:
        bases = {getattr(b, "attr", getattr(b, "id", "")) for b in getattr(node, "bases", [])}
        if isinstance(node, ast.ClassDef) and bases & {"LightningDataModule", *(c.name for c in classes)}:
            classes.append(node)
    skel_classes = [n.name for n in skel.body if isinstance(n, ast.ClassDef)]
    if not classes or not skel_classes:
        raise RuntimeError(f"--no-example: expected a LightningDataModule in {module} and a class in its skeleton")
    imports = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    bound = {(a.asname or a.name).split(".")[0] for n in imports for a in n.names}
    skel_imports = [n for n in skel.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    new_imports = []
    for node in skel_imports:
        if getattr(node, "module", None) != module and {(a.asname or a.name).split(".")[0] for a in node.names} - bound:
            new_imports.append(ast.get_source_segment(skeleton, node))
    skel_lines = skeleton.splitlines(keepends=True)
    body = "".join(skel_lines[max(n.end_lineno for n in skel_imports) if skel_imports else 0 :]).strip("\n")
    edits = [(min([c.lineno] + [d.lineno for d in c.decorator_list]) - 1, c.end_lineno, "") for c in classes]
    edits[0] = (*edits[0][:2], f"\n\n{body}\n\n\n")
    if new_imports and imports:
        edits.append((imports[-1].end_lineno, imports[-1].end_lineno, "\n".join(new_imports) + "\n"))
    docs = [m for m in (tree, skel) if ast.get_docstring(m) is not None]
    if len(docs) == 2:
        edits.append((tree.body[0].lineno - 1, tree.body[0].end_lineno, "".join(skel_lines[: skel.body[0].end_lineno])))
    lines = target.splitlines(keepends=True)
    for start, end, text in sorted(edits, reverse=True):
        lines[start:end] = [text]
    merged = re.sub(r"\n{4,}", "\n\n\n", "".join(lines)).strip("\n") + "\n"
    return merged, [c.name for c in classes], skel_classes[0]
