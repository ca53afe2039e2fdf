"""The example (module.py, data.py, nets.py) is disposable: no engine code and no engine test imports it or names
its classes, so that a user who edits or deletes it breaks only the example's own tests, in tests/. (The
tests were also run with the three files deleted; this keeps it so.)"""

import ast
from pathlib import Path

import steadfast as engine

from tests.helpers import REPO

PACKAGE = engine.__name__.split(".")[0]
EXAMPLE_MODULES = {f"{PACKAGE}.{name}" for name in ("module", "data", "nets")}
# The generator's tests stay in the template (scripts/template_copy.py: TEMPLATE_ONLY) and handle the example.
GENERATOR_TESTS = {"test_new_project.py", "test_template_update.py"}


def _uses(path: Path, root: Path = REPO) -> list[str]:
    """Imports of the example's modules, and strings that name them (class paths of their classes)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name in EXAMPLE_MODULES]
        elif isinstance(node, ast.ImportFrom) and node.module:
            full = {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
            found += sorted(full & EXAMPLE_MODULES)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            found += [m for m in EXAMPLE_MODULES if f"{m}." in node.value or node.value == m]
    return [f"{path.relative_to(root)}: {f}" for f in found]


def test_no_engine_module_or_engine_test_imports_the_example_or_names_its_classes():
    files = [*(REPO / PACKAGE / "engine").rglob("*.py"), *(REPO / "tests").rglob("*.py")]
    checked = [p for p in files if "example" not in p.relative_to(REPO).parts and p.name not in GENERATOR_TESTS]
    assert len(checked) > 40
    assert [use for path in checked for use in _uses(path)] == []


def test_the_check_finds_imports_and_class_paths(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text(f"from {PACKAGE}.nets import MLP\nfrom {PACKAGE} import data\nimport {PACKAGE}.module\n"
                   f"X = '{PACKAGE}.module.Classifier'\nfrom {PACKAGE}.engine import cli\n")  # fmt: skip
    assert [u.split(": ")[1] for u in _uses(bad, root=tmp_path)] == [
        f"{PACKAGE}.{m}" for m in ("nets", "data", "module", "module")
    ]
