"""scripts/new_project.py: the copy is a working project, only references to the package are renamed outside the
engine, the engine travels byte for byte without its suite, and a bad name or DEST fails before anything is written.
A template-only test (scripts/template_copy.py: TEMPLATE_ONLY)."""

import ast
import fnmatch
import hashlib
import importlib
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.helpers import QUIET, REPO

SCRIPT = REPO / "scripts" / "new_project.py"
NAME = "acme_ml"  # as long as "project": line breaks stay where they were, so a copy can be compared line by line
GENERATOR_MODULES = ("new_project", "template_copy", "template_renamer", "template_no_example", "template_update")
GENERATOR = (*(f"scripts/{m}.py" for m in GENERATOR_MODULES), "scripts/skeleton/")  # what makes a copy
# What stays behind (issue 27): the generator and its tests, the benchmarks and their page of figures; the engine's
# own suite (issue 38: the engine comes as one unit, its suite stays with it).
TEMPLATE_ONLY = (*GENERATOR, "tests/test_new_project.py", "tests/test_template_update.py",
                 "tests/test_example_apart.py", "engine/tests/", "scripts/benchmark*.py", "tests/test_benchmark.py",
                 "scripts/count_syncs*.py", "tests/test_count_syncs*.py", "tests/test_count_syncs.py", "docs/speed.md",
                 ".ci/test_copy.sh")  # fmt: skip
ENGINE_VERSION = re.search(r'^version = "(.+?)"', (REPO / "engine" / "pyproject.toml").read_text(), re.M)[1]
GIT_ID = {f"GIT_{r}_{k}": v for r in ("AUTHOR", "COMMITTER") for k, v in (("NAME", "T"), ("EMAIL", "t@example.org"))}

sys.path.insert(0, str(SCRIPT.parent))  # as when run as a script: its modules import each other from scripts/
try:
    new_project, copier, template_renamer = map(importlib.import_module, GENERATOR_MODULES[:3])
finally:
    sys.path.remove(str(SCRIPT.parent))


def template_files() -> set[str]:
    """What a copy starts from: the files git tracks or would track, less the generator's own."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO, capture_output=True, text=True)
    return {p for p in listed.stdout.splitlines() if (REPO / p).is_file() and not template_only(p)}


def template_only(path: str) -> bool:
    return any(fnmatch.fnmatchcase(path, t) or (t.endswith("/") and path.startswith(t)) for t in TEMPLATE_ONLY)


def tree(root: Path) -> set[str]:
    return {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file() and ".git" not in p.parts}


def hashes(root: Path, paths: set[str]) -> dict[str, str]:
    return {p: hashlib.sha256((root / p).read_bytes()).hexdigest() for p in paths}


def run_script(*args: str, script: Path = SCRIPT) -> subprocess.CompletedProcess:
    env = {**os.environ, **GIT_ID}
    return subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, env=env, timeout=120)


@pytest.fixture(scope="module")
def generated(tmp_path_factory) -> Path:
    dest, _ = new_project.generate(tmp_path_factory.mktemp("gen") / NAME, NAME, git=False)
    return dest


@pytest.fixture(scope="module")
def bare(tmp_path_factory) -> Path:
    dest, _ = new_project.generate(tmp_path_factory.mktemp("bare") / NAME, NAME, example=False, git=False)
    return dest


@pytest.fixture(scope="module")
def template_copy(tmp_path_factory) -> Path:
    """A copy of the template, outside git, where a test may write junk or aim DEST inside."""
    copy = tmp_path_factory.mktemp("template") / "template"
    for rel in [*template_files(), *GENERATOR, "tests/test_new_project.py"]:
        if (REPO / rel).is_dir():
            shutil.copytree(REPO / rel, copy / rel, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            (copy / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / rel, copy / rel)
    return copy


def _module_strings(tree: ast.AST) -> set[int]:
    """The ids of the string constants that stand for a module where one reads exactly a module's name: the one after
    ``"-m"`` in an argument list, a part of a path ``root / "project"``, ``import_module("project")``."""
    found = set()
    for node in ast.walk(tree):
        elts = getattr(node, "elts", [])
        found |= {id(b) for a, b in itertools.pairwise(elts) if isinstance(a, ast.Constant) and a.value == "-m"}
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            found |= {id(node.left), id(node.right)}
        if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "import_module":
            found |= {id(a) for a in node.args[:1]}
    return found


def leftover_references(root: Path) -> list[str]:
    """Every place in ``root`` outside engine/ that still refers to the package ``project``, found without the
    script's rules. (engine/ is the engine's, byte for byte: ``test_the_engine_travels_byte_for_byte...``.)"""
    modules = "|".join(p.stem for p in (root / NAME).iterdir())
    patterns = [rf"(?<![\w.\-/])project\.({modules})\b", r"-m project\b", r"(?<![\w.\-/])project/",
                r"\b(from|import) project\b", r"`project[`\s]", r"^\s*project\s*="]  # fmt: skip
    found = []
    files = [p for p in root.rglob("*") if p.is_file() and ".git" not in p.parts]
    for path in sorted(p for p in files if p.relative_to(root).parts[0] != "engine"):
        text = path.read_text(errors="replace")
        found += [f"{path}: {m.group(0)!r}" for p in patterns for m in re.finditer(p, text, re.M)]
        if path.suffix == ".py":
            tree = ast.parse(text)
            module_strings = _module_strings(tree)
            for node in ast.walk(tree):
                names = []
                if isinstance(node, (ast.Import, ast.ImportFrom)):  # (global/nonlocal have names too: strings)
                    names = [node.module or "" if isinstance(node, ast.ImportFrom) else ""] + [
                        a.name for a in node.names
                    ]
                if names and any(re.match(r"project\b", n) for n in names):
                    found.append(f"{path}:{node.lineno} imports {names}")
                if isinstance(node, ast.Name) and node.id == "project":
                    found.append(f"{path}:{node.lineno} uses the name project")
                if isinstance(node, ast.Constant) and node.value == "project" and id(node) in module_strings:
                    found.append(f"{path}:{node.lineno} names the package 'project' in a string")
    return found


def test_no_identifier_import_or_config_refers_to_the_package_by_its_old_name(generated):
    assert not (generated / "project").exists() and (generated / NAME / "__init__.py").is_file()
    assert leftover_references(generated) == []
    class_paths = [v for cfg in (generated / "configs").glob("*.yaml") for v in _values(yaml.safe_load(cfg.read_text()))
                   if isinstance(v, str) and v.startswith(("project.", f"{NAME}."))]  # fmt: skip
    assert class_paths and all(v.startswith(f"{NAME}.") for v in class_paths)


RENAMES = [  # (file, template text, expected text): references change, prose and TOML tables don't
    ("a.py", 'import project\nimport os, project.nets as n\nx = project.nets.MLP(); y = self.project\n',
     'import acme\nimport os, acme.nets as n\nx = acme.nets.MLP(); y = self.project\n'),
    ("a.py", 'from project.data import X  # see project/data.py\nproject = 3  # a name, not the package\n',
     'from acme.data import X  # see acme/data.py\nproject = 3  # a name, not the package\n'),
    ("a.py", '"""The project, ``python -m project fit``."""\nargs = ["-m", "project", "pyproject.toml"]\n',
     '"""The project, ``python -m acme fit``."""\nargs = ["-m", "acme", "pyproject.toml"]\n'),
    ("a.py", 'import project\nwandb.init(project="x", config=project.cfg)\nargs["project"] = args.get("project")\n'
     'copytree(REPO / "project", "project")\nsys.argv = ["project"]\nm = ("python -m "\n     "project fit")\n',
     'import acme\nwandb.init(project="x", config=acme.cfg)\nargs["project"] = args.get("project")\n'
     'copytree(REPO / "acme", "project")\nsys.argv = ["project"]\nm = ("python -m "\n     "acme fit")\n'),
    ("pyproject.toml", '[project]\nname = "project"\ndescription = "A project"\n[project.scripts]\n'
     'project = "project.cli:cli_main"\n[project.optional-dependencies]\ndev = []\n[tool.x]\ninclude = ["project*"]\n',
     '[project]\nname = "acme"\ndescription = "A project"\n[project.scripts]\n'
     'acme = "acme.cli:cli_main"\n[project.optional-dependencies]\ndev = []\n[tool.x]\ninclude = ["acme*"]\n'),
    ("c.yaml", "model:  # the project's model\n  class_path: project.module.M\n  pkg: project\n",
     "model:  # the project's model\n  class_path: acme.module.M\n  pkg: acme\n"),
    ("ci.yml", "steps:\n  - run: ruff check project tests\n  - name: lint the project\n",
     "steps:\n  - run: ruff check acme tests\n  - name: lint the project\n"),
    ("Makefile", "x:  ## the project, pyproject.toml\n\t$(BIN)/project fit && ruff check project/\n",
     "x:  ## the project, pyproject.toml\n\t$(BIN)/acme fit && ruff check acme/\n"),
    ("README.md", "The project: `project fit`, [project.scripts].\n```bash\nproject fit  # the project\n```\n",
     "The project: `acme fit`, [project.scripts].\n```bash\nacme fit  # the project\n```\n"),
]  # fmt: skip


@pytest.mark.parametrize(("file", "text", "expected"), RENAMES, ids=[f"{i}-{r[0]}" for i, r in enumerate(RENAMES)])
def test_renamer_changes_references_to_the_package_and_nothing_else(file, text, expected):
    renamer = template_renamer.Renamer("project", "acme", {"data", "nets", "cli", "module"})
    assert renamer.file(Path(file), text) == expected


def _words(text: str, package: str = "project") -> list[str]:
    """The string constants and keyword names of Python ``text`` that read the bare word "project" where it is not a
    module path: not ``project.x``, ``project/``, ``-m project``, not the ``"project"`` after ``"-m"`` in an
    argument list, nor a path part ``root / "project"``. These are W&B's ``project=``, ``args["project"]``, prose.
    References to ``package`` in them read ``PKG``, so that a copy's words equal the template's."""
    module = re.compile(rf"(?<![\w.\-/]){package}(?=[./])|(?<=-m ){package}\b|(?<=`){package}(?=`)")
    tree = ast.parse(text)
    skip = _module_strings(tree)
    found = ["project=" for node in ast.walk(tree) if isinstance(node, ast.keyword) and node.arg == "project"]
    for node in ast.walk(tree):
        value = module.sub("PKG", node.value) if isinstance(node, ast.Constant) and isinstance(node.value, str) else ""
        if id(node) not in skip and re.search(r"(?<![\w\-])project(?![\w\-])", value):
            found.append(value)
    return found


def test_a_string_or_keyword_that_only_reads_project_keeps_it(generated):
    """W&B's ``project`` key, ``project=`` keywords and prose are no references to the package (issue 26: the copy's
    ``configs/wandb.yaml`` failed with "Option 'acme_ml' is not accepted")."""
    loggers = generated / "engine" / "lightkeep" / "run_loggers.py"
    assert 'args["project"] = args.get("project")' in loggers.read_text()
    checked = 0
    for rel in sorted(p for p in template_files() if p.endswith(".py")):
        words = _words((REPO / rel).read_text())
        package = "project" if rel.startswith("engine/") else NAME  # the engine is never renamed
        copy = _words((generated / re.sub(r"^project/", f"{NAME}/", rel)).read_text(), package)
        assert sorted(copy) == sorted(words), rel
        checked += len(words)
    assert checked >= 2  # precondition: the template has such words (run_loggers.py's two)


@pytest.mark.slow
def test_the_copy_logs_to_wandb_offline(generated, tmp_path):
    """A copy's ``fit --config configs/wandb.yaml`` runs: the logger gets W&B's ``project``, not the package name."""
    env = {**_env(generated, tmp_path / "blocker"), "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    fit = [sys.executable, "-m", NAME, "fit", "--config", str(generated / "configs" / "wandb.yaml"), *QUIET,
           "--trainer.max_epochs", "1", "--trainer.limit_train_batches", "3", "--trainer.limit_val_batches", "2",
           "--model.warmup", "1"]  # fmt: skip
    proc = subprocess.run(fit, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    (run,) = tmp_path.glob("runs/*/version_0")
    assert list(run.glob("wandb/offline-run-*")), sorted(p.name for p in run.rglob("*"))


def test_pyproject_names_the_new_package_and_keeps_its_tables(generated):
    meta = pytest.importorskip("tomllib").loads((generated / "pyproject.toml").read_text())
    setuptools = meta["tool"]["setuptools"]
    assert meta["project"]["name"] == NAME and "dev" in setuptools["dynamic"]["optional-dependencies"]  # tables stay
    assert list(meta["project"]["scripts"]) == [NAME] and meta["project"]["scripts"][NAME].startswith(f"{NAME}.")
    # the copy's package and the engine it vendors (engine/lightkeep), never the engine by name from a registry
    assert setuptools["packages"]["find"]["include"] == [f"{NAME}*", "lightkeep*"]
    assert "lightkeep" not in " ".join(meta["project"].get("dependencies", []))


def _values(node):
    if isinstance(node, dict):
        return [v for x in node.values() for v in _values(x)]
    return [v for x in node for v in _values(x)] if isinstance(node, list) else [node]


def test_nothing_but_references_to_the_package_changes(generated):
    """Mapping the new name back gives the template again: prose, "pyproject.toml" and TOML tables kept "project"."""
    expected = {re.sub(r"^project/", f"{NAME}/", p) for p in template_files()}
    assert tree(generated) == expected | {".template.json"}
    for rel in template_files():
        old = copier.drop_template_only((REPO / rel).read_text(errors="replace"))
        new = (generated / re.sub(r"^project/", f"{NAME}/", rel)).read_text(errors="replace").replace(NAME, "project")
        if rel == "README.md":  # its title is the project's name
            old, new = old.split("\n", 1)[1], new.split("\n", 1)[1]
        if rel.endswith(".py"):  # ruff may have re-sorted imports the new name moved: compare the words as a multiset
            assert sorted(new.split()) == sorted(old.split()), rel
        else:
            assert new.split() == old.split(), rel
    assert (generated / NAME / "__init__.py").read_text() == (REPO / "project" / "__init__.py").read_text()
    assert (generated / "README.md").read_text().startswith(f"# {NAME}\n")


def test_the_engine_travels_byte_for_byte_without_its_suite(generated, bare):
    """engine/ is one unit at its version (issue 38): every file of the template's engine/ but its suite
    (engine/tests/), with the same bytes, in the copy with or without the example; its version in the record. The
    package is renamed only outside engine/, and the copy's make test runs no engine suite."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "engine"], cwd=REPO, capture_output=True,
                            text=True, check=True).stdout.splitlines()  # fmt: skip
    ours = {p for p in listed if (REPO / p).is_file()}
    suite = {p for p in ours if p.startswith("engine/tests/")}
    engine = ours - suite
    assert len(suite) > 40 and "engine/lightkeep/cli.py" in engine and "engine/pyproject.toml" in engine
    for copy in (generated, bare):
        theirs = {p for p in tree(copy) if p.startswith("engine/")}
        assert hashes(copy, theirs) == hashes(REPO, engine), copy
        assert not (copy / "engine" / "tests").exists()
        assert json.loads((copy / ".template.json").read_text())["engine"] == ENGINE_VERSION
        assert "cd engine" not in (copy / "Makefile").read_text()  # the template-only lines that run the suite
    assert (REPO / "Makefile").read_text().count("cd engine") >= 2  # precondition: the template has them


def test_author_and_description_go_to_pyproject_and_readme(tmp_path):
    dest, _ = new_project.generate(tmp_path / "p", NAME, author="Ada Lovelace <ada@example.org>",
                                   description='Counts "things"', git=False)  # fmt: skip
    tomllib = pytest.importorskip("tomllib")
    meta = tomllib.loads((dest / "pyproject.toml").read_text())["project"]
    template = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert meta["authors"] == [{"name": "Ada Lovelace", "email": "ada@example.org"}]
    assert meta["description"] == 'Counts "things"'
    assert {k: v for k, v in meta.items() if k not in ("authors", "description", "name", "scripts")} == {
        k: v for k, v in template.items() if k not in ("description", "name", "scripts")
    }
    assert (dest / "README.md").read_text().startswith(f'# {NAME}\n\nCounts "things"\n')
    record = json.loads((dest / ".template.json").read_text())
    assert (record["author"], record["description"]) == ("Ada Lovelace <ada@example.org>", 'Counts "things"')


@pytest.mark.parametrize("git", [True, False], ids=["git", "walk"])
def test_runs_checkpoints_caches_and_venv_stay_behind(template_copy, tmp_path, git):
    template = tmp_path / "template"
    shutil.copytree(template_copy, template)
    with open(template / "README.md", "a") as readme:
        readme.write("\n<!-- template-only:start -->\nnew_project.py makes copies\n<!-- template-only:end -->\n")
    junk = ["runs/digits/version_0/checkpoints/last.ckpt", "lightning_logs/version_0/x", "project/__pycache__/a.pyc",
            ".venv/bin/python", "project.egg-info/PKG-INFO", "build/lib/a.py", "dist/a.whl", "stray.ckpt",
            ".pytest_cache/v", ".ruff_cache/x", "weights.pth", "docs/speed.md", "scripts/benchmark_new.py",
            "tests/test_benchmark.py"]  # fmt: skip
    for rel in [*junk, "notes/keep.txt"]:
        (template / rel).parent.mkdir(parents=True, exist_ok=True)
        (template / rel).write_text("x\n")
    (template / "assets").mkdir()
    (template / "assets" / "logo.png").write_bytes(b"\x89PNG\0\xff project")
    if git:
        for args in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "t"]):
            subprocess.run(["git", *args], cwd=template, env={**os.environ, **GIT_ID}, check=True, capture_output=True)
    proc = run_script(str(tmp_path / "out"), "--name", NAME, script=template / "scripts" / "new_project.py")
    assert proc.returncode == 0, proc.stderr
    out = tmp_path / "out"
    expected = {re.sub(r"^project/", f"{NAME}/", p) for p in tree(template_copy) if not template_only(p)}
    assert tree(out) == expected | {"notes/keep.txt", "assets/logo.png", ".template.json"}
    assert (out / "assets" / "logo.png").read_bytes() == b"\x89PNG\0\xff project"  # binary: copied as it is
    assert "template-only" not in (out / "README.md").read_text()
    assert os.access(out / ".ci" / "run", os.X_OK) or not (out / ".ci" / "run").exists()
    log = subprocess.run(["git", "log", "--oneline"], cwd=out, capture_output=True, text=True, check=True).stdout
    status = subprocess.run(["git", "status", "--porcelain"], cwd=out, capture_output=True, text=True).stdout
    assert len(log.splitlines()) == 1 and status == ""
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=template, capture_output=True, text=True).stdout.strip()
    record = json.loads((out / ".template.json").read_text())
    assert record == {"template_commit": head if git else None, "uncommitted": [], "name": NAME, "example": True,
                      "author": None, "description": None, "engine": ENGINE_VERSION}  # fmt: skip
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "template"]  # no staging folder left


def test_the_template_benchmarks_and_the_copy_test_stay_behind(generated, bare):
    """A copy's owner times their own model: no benchmark script, its test or the page of the template's figures;
    and no ``make test-copy``, which needs the generator."""
    assert (REPO / "scripts" / "benchmark.py").is_file()  # precondition: there are benchmarks to leave behind
    for copy in (generated, bare):
        left = sorted(p for p in tree(copy) if template_only(p) or "benchmark" in p or p == "docs/speed.md")
        assert left == [], copy
        assert "test-copy" not in (copy / "Makefile").read_text() + (copy / ".ci" / "run").read_text()


def test_no_file_of_the_copy_names_a_template_commit(generated):
    """Words of 7-40 hex digits that are commits of the template name code the copy does not have. Only the record
    .template.json names one, the commit --update merges from: the scan must find that one."""
    words = {}
    for path in sorted(p for p in generated.rglob("*") if p.is_file() and ".git" not in p.parts):
        for word in re.findall(r"\b[0-9a-f]{7,40}\b", path.read_text(errors="replace")):
            words.setdefault(word, []).append(path.relative_to(generated).as_posix())
    query = "".join(f"{w}^{{commit}}\n" for w in words)
    check = subprocess.run(["git", "cat-file", "--batch-check"], cwd=REPO, input=query, capture_output=True, text=True)
    commits = [w for w, line in zip(words, check.stdout.splitlines(), strict=True) if not line.endswith("missing")]
    record = json.loads((generated / ".template.json").read_text())["template_commit"]
    assert record in commits and words[record] == [".template.json"]  # precondition: the scan finds a real one
    assert {w: words[w] for w in commits if w != record} == {}


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("my-project", "not a valid package name: use lowercase letters, digits and underscores"),
        ("1st_model", "e.g. 'my_1st_model'"),
        ("MyProject", "e.g. 'myproject'"),
        ("class", "is a Python keyword"),
        ("torch", "would shadow 'torch'"),
        ("lightning", "would shadow 'lightning'"),
        ("test", "would shadow the standard-library module 'test'"),
        ("json", "would shadow the standard-library module 'json'"),
        ("tests", "would clash with the folder tests/"),
        ("project", "the template's own package name"),
        ("lightkeep", "would shadow the engine's package 'lightkeep'"),
        ("engine", "would clash with the folder engine/"),
    ],
)
def test_an_invalid_name_fails_clearly_and_creates_nothing(tmp_path, name, message):
    proc = run_script(str(tmp_path / "new"), "--name", name)
    assert proc.returncode == 2 and message in proc.stderr and "Nothing was created" in proc.stderr, proc.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("where", ["not_empty", "a_file", "inside", "the_template", "bad_author"])
def test_a_bad_dest_or_author_fails_clearly_and_creates_nothing(template_copy, tmp_path, where):
    (tmp_path / "not_empty").mkdir()
    (tmp_path / "not_empty" / "mine.txt").write_text("keep me")
    (tmp_path / "a_file").write_text("keep me")
    dest = {"inside": template_copy / "sub" / "p", "the_template": template_copy}.get(where, tmp_path / where)
    before = {p: p.read_bytes() for p in [*tmp_path.rglob("*"), *template_copy.rglob("*")] if p.is_file()}
    extra = ["--author", "<>"] if where == "bad_author" else []
    proc = run_script(str(dest), "--name", NAME, *extra, script=template_copy / "scripts" / "new_project.py")
    message = {"not_empty": "exists and is not empty", "a_file": "is not a folder", "bad_author": "--author '<>'"}
    assert proc.returncode == 2 and message.get(where, "is inside the template") in proc.stderr, proc.stderr
    assert "Nothing was created" in proc.stderr
    after = {p: p.read_bytes() for p in [*tmp_path.rglob("*"), *template_copy.rglob("*")] if p.is_file()}
    assert after == before and not (template_copy / "sub").exists()


def test_no_example_swaps_the_digits_for_the_skeleton(bare, generated):
    data = (bare / NAME / "data.py").read_text()
    assert "class DataModule(L.LightningDataModule)" in data and "load_digits" not in data
    config = yaml.safe_load((bare / "configs" / "default.yaml").read_text())
    assert config["data"] == f"{NAME}.data.DataModule"  # the class alone: its own defaults apply
    for path in [p for p in bare.rglob("*.py") if p.name not in ("conftest.py", "helpers.py")]:
        assert "DigitsDataModule" not in path.read_text(), path
    # the tests of tests/ that name the digits give way to the skeleton's; the others (the engine's self-check) stay
    ours = {p.relative_to(REPO).as_posix() for p in (REPO / "tests").glob("test_*.py")}
    ours = {t for t in ours if not template_only(t)}
    kept = {t for t in ours if not re.search("digits", (REPO / t).read_text(), re.I)}
    skeleton_tests = {p.relative_to(REPO / "scripts" / "skeleton").as_posix()
                      for p in (REPO / "scripts" / "skeleton" / "tests").rglob("test_*.py")}  # fmt: skip
    assert "tests/test_engine_check.py" in kept and "tests/test_data.py" in ours - kept  # preconditions
    assert {p.relative_to(bare).as_posix() for p in (bare / "tests").rglob("test_*.py")} == kept | skeleton_tests
    for t in skeleton_tests:
        skeleton = (REPO / "scripts" / "skeleton" / t).read_text()
        assert (bare / t).read_text().split() == skeleton.replace("project", NAME).split(), t
    assert all("digits" not in (bare / t).read_text().lower() for t in kept | skeleton_tests)
    assert leftover_references(bare) == []
    assert tree(bare) - tree(generated) == set()  # the skeleton replaces files, it adds none


@pytest.mark.skipif(shutil.which("ruff") is None and not (Path(sys.executable).parent / "ruff").is_file(),
                    reason="ruff is not installed")  # fmt: skip
def test_copies_lint_no_worse_than_the_template(generated, bare):
    ruff = shutil.which("ruff") or str(Path(sys.executable).parent / "ruff")

    def problems(root: Path) -> set[tuple[str, str]]:
        out = subprocess.run([ruff, "check", "--no-cache", "--output-format", "concise", "."], cwd=root,
                             capture_output=True, text=True).stdout  # fmt: skip
        found = re.findall(r"^(\S+?):\d+:\d+: (\w+)", out, re.M)
        return {(re.sub(rf"^{NAME}/", "project/", path), code) for path, code in found}

    template = problems(REPO)
    assert problems(generated) <= template and problems(bare) <= template


def _env(project: Path, blocker: Path) -> dict[str, str]:
    """The copy and its own engine first on the path, then a stub ``project`` that fails on import: the template
    can't stand in (nor can the template's engine, installed editable in .venv: the path comes before it)."""
    (blocker / "project").mkdir(parents=True, exist_ok=True)
    (blocker / "project" / "__init__.py").write_text("raise ImportError('a copy imported the template package')\n")
    path = os.pathsep.join(map(str, (project, project / "engine", blocker)))
    return {**os.environ, "PYTHONPATH": path, "PYTHONWARNINGS": "ignore"}


def _pytest(project: Path, env: dict[str, str], *args: str) -> None:
    cmd = [sys.executable, "-m", "pytest", "-m", "not slow", "-x", "-q", "-p", "no:cacheprovider", *args]
    proc = subprocess.run(cmd, cwd=project, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-3000:]


def _unit_tests(project: Path) -> list[str]:
    """The copy's test files that start no subprocess: the CLI ones take minutes, and the fits here stand in."""
    files = sorted((project / "tests").rglob("test_*.py"))  # the example's tests (tests/) too
    return [p.relative_to(project).as_posix() for p in files
            if "subprocess" not in p.read_text() and "cli(" not in p.read_text()]  # fmt: skip


@pytest.mark.slow
def test_the_copy_passes_its_unit_tests_and_trains(generated, tmp_path):
    env = _env(generated, tmp_path / "blocker")
    where = [sys.executable, "-c", "import lightkeep; print(lightkeep.__file__)"]
    found = subprocess.run(where, cwd=tmp_path, env=env, capture_output=True, text=True, check=True).stdout
    assert Path(found.strip()) == generated / "engine" / "lightkeep" / "__init__.py"  # the copy's engine runs
    _pytest(generated, env, *_unit_tests(generated))
    fit = [sys.executable, "-m", NAME, "fit", *QUIET, "--trainer.max_epochs", "1", "--trainer.limit_train_batches",
           "3", "--trainer.limit_val_batches", "2", "--model.warmup", "1"]  # fmt: skip
    proc = subprocess.run(fit, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-5000:]
    (run,) = tmp_path.glob("runs/*/version_0")
    assert (run / "checkpoints" / "last.ckpt").is_file()
    assert yaml.safe_load((run / "config.yaml").read_text())["model"]["class_path"].startswith(f"{NAME}.")


@pytest.mark.long  # CI and make test-all; the copy's own tests again, without the example
@pytest.mark.slow
def test_the_no_example_copy_passes_its_unit_tests_and_the_skeletons_fit(bare, tmp_path):
    """The skeleton's own tests include a real ``python -m acme_ml fit`` through the CLI."""
    skeleton = REPO / "scripts" / "skeleton"
    skeleton_tests = [p.relative_to(skeleton).as_posix() for p in (skeleton / "tests").rglob("test_*.py")]
    assert skeleton_tests
    _pytest(bare, _env(bare, tmp_path / "blocker"), *sorted({*_unit_tests(bare), *skeleton_tests}))
