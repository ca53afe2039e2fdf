"""The example (module.py, data.py, nets.py) is disposable: nothing under engine/ (the engine, its suite, its fixtures)
imports it or names its classes, and of all the tests only the template's own, in tests/, do; so that a user who
edits or deletes it breaks only those. (The engine's suite was also run with the three files deleted; this keeps it
so.) A template-only test (scripts/template_copy.py: TEMPLATE_ONLY): a copy has no engine suite to scan."""

import ast
import subprocess
from pathlib import Path

import project
from tests.helpers import REPO

PACKAGE = project.__name__
EXAMPLE_MODULES = {f"{PACKAGE}.{name}" for name in ("module", "data", "nets")}


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


def _python_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*.py") if "__pycache__" not in p.parts)


def test_nothing_under_engine_imports_the_example_or_names_its_classes():
    engine = REPO / "engine"
    files = _python_files(engine)
    # precondition: the scan reads the engine, its suite and its fixtures
    assert {"lightkeep", "tests"} <= {p.relative_to(engine).parts[0] for p in files} and len(files) > 80
    assert [use for path in files for use in _uses(path)] == []


def test_of_all_tests_only_the_templates_own_name_the_example():
    """Every test module of the repository (test_*.py wherever it is) that uses the example is one of the template's
    tests: in tests/, or the skeleton's (scripts/skeleton/tests/, the tests/ of a --no-example copy)."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO, capture_output=True,
                            text=True, check=True).stdout.splitlines()  # fmt: skip
    tests = [
        REPO / p for p in listed if Path(p).name.startswith("test_") and p.endswith(".py") and (REPO / p).is_file()
    ]
    naming = sorted(p.relative_to(REPO).as_posix() for p in tests if _uses(p))
    assert {Path(p).parent.as_posix() for p in naming} <= {"tests", "scripts/skeleton/tests"}, naming
    assert "tests/test_module.py" in naming  # precondition: the scan sees the example's own tests
    assert any(p.is_relative_to(REPO / "engine" / "tests") for p in tests)  # and reads the engine's


def test_the_check_finds_imports_and_class_paths(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text(f"from {PACKAGE}.nets import MLP\nfrom {PACKAGE} import data\nimport {PACKAGE}.module\n"
                   f"X = '{PACKAGE}.module.Classifier'\nfrom lightkeep import cli\n")  # fmt: skip
    assert [u.split(": ")[1] for u in _uses(bad, root=tmp_path)] == [
        f"{PACKAGE}.{m}" for m in ("nets", "data", "module", "module")
    ]
