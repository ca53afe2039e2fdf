"""scripts/new_project.py --update: a copy takes the template's later commits on a new branch. The engine (engine/)
comes as one unit: replaced whole by the newer version, its version in the record; a copy whose engine/ differs from
the one it got is refused, naming the files, with nothing changed. The owner's own files are three-way merged:
their changes and deletions kept, conflicts listed. A refused update changes nothing. Template-only
(scripts/template_copy.py: TEMPLATE_ONLY). "Later" template commits are made in a temporary git repository holding
this checkout's files."""

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO
from tests.test_new_project import GIT_ID, NAME, _env, _pytest

ENV = {**os.environ, **GIT_ID}
ENGINE_FILE = "engine/lightkeep/schedule.py"  # an engine file the example's module imports (the schedule)
ENGINE_PYPROJECT = "engine/pyproject.toml"
USER_FILE = "project/module.py"  # the owner's: renamed in the copy, merged by --update
ENGINE_FIX = "\n\ndef template_fix() -> int:\n    return 17\n"
USER_FILE_FIX = "\n\ndef template_helper() -> int:\n    return 3\n"  # the template's change to an owner's file
NEW_ENGINE_FILE = ("engine/lightkeep/fix.py", '"""A fix."""\n\nfrom lightkeep.schedule import template_fix\n')
NEW_ENGINE_TEST = ("engine/tests/test_fix.py", "def test_engine_fix():\n    pass\n")  # the suite: never in a copy
NEW_TEST = ("tests/test_fix.py", "from lightkeep.fix import template_fix\n\n\ndef test_fix():\n"
            "    assert template_fix() == 17\n")  # fmt: skip
VERSION = re.compile(r'^version = "(\d+)\.(\d+)\.(\d+)"', re.M)


def git(cwd: Path, *args: str) -> str:
    cmd = ["git", "-c", "commit.gpgsign=false", *args]
    return subprocess.run(cmd, cwd=cwd, env=ENV, capture_output=True, text=True, check=True).stdout


def commit_all(repo: Path, message: str) -> str:
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "--no-verify", "-m", message)
    return git(repo, "rev-parse", "HEAD").strip()


def run_script(template: Path, *args: str) -> subprocess.CompletedProcess:
    script = template / "scripts" / "new_project.py"
    return subprocess.run([sys.executable, str(script), *args], env=ENV, capture_output=True, text=True, timeout=120)


def in_copy(rel: str) -> str:
    return rel.replace("project/", f"{NAME}/", 1) if rel.startswith("project/") else rel


def append(path: Path, text: str) -> str:
    path.write_text(path.read_text() + text)
    return path.read_text()


def engine_version(root: Path) -> str:
    return ".".join(VERSION.search((root / ENGINE_PYPROJECT).read_text()).groups())


def engine_hashes(root: Path, listed: list[str]) -> dict[str, str]:
    """sha256 of each file of engine/ but its suite, of ``listed`` (paths relative to ``root``)."""
    engine = [p for p in listed if p.startswith("engine/") and not p.startswith("engine/tests/")]
    return {p: hashlib.sha256((root / p).read_bytes()).hexdigest() for p in engine}


def files(root: Path) -> list[str]:
    return [p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file() and ".git" not in p.parts]


def state(copy: Path) -> tuple[str, str, str, dict[str, bytes]]:
    """HEAD, branches, ``git status`` and every file's bytes: what a refused update must leave as it was."""
    contents = {p: (copy / p).read_bytes() for p in files(copy)}
    if not (copy / ".git").exists():
        return "", "", "", contents
    return git(copy, "rev-parse", "HEAD"), git(copy, "branch", "-a"), git(copy, "status", "--porcelain"), contents


@pytest.fixture(scope="module")
def at_a(tmp_path_factory) -> tuple[Path, Path]:
    """A template repository at commit A (this checkout's files and generator) and a copy made from it."""
    root = tmp_path_factory.mktemp("at_a")
    template = root / "template"
    for rel in git(REPO, "ls-files", "-co", "--exclude-standard").splitlines():
        if (REPO / rel).is_file():
            (template / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / rel, template / rel)
    git(template, "init", "-q")
    commit_all(template, "A")
    proc = run_script(template, str(root / "copy"), "--name", NAME)
    assert proc.returncode == 0, proc.stderr
    return template, root / "copy"


@pytest.fixture
def repos(at_a, tmp_path) -> tuple[Path, Path]:
    template, copy = tmp_path / "template", tmp_path / "copy"
    shutil.copytree(at_a[0], template, symlinks=True)
    shutil.copytree(at_a[1], copy, symlinks=True)
    return template, copy


def commit_b(template: Path) -> str:
    """Template commit B, the engine's next version: its version bumped, a fix at the end of an engine file, a new
    engine file and an engine test; and in the owner's files a helper at the end of the module and a test that uses
    the new engine file."""
    pyproject = template / ENGINE_PYPROJECT
    major, minor, patch = VERSION.search(pyproject.read_text()).groups()
    pyproject.write_text(VERSION.sub(f'version = "{major}.{minor}.{int(patch) + 1}"', pyproject.read_text(), 1))
    append(template / ENGINE_FILE, ENGINE_FIX)
    append(template / USER_FILE, USER_FILE_FIX)
    for rel, text in (NEW_ENGINE_FILE, NEW_ENGINE_TEST, NEW_TEST):
        (template / rel).write_text(text)
    return commit_all(template, "B: the engine's next version")


def test_update_takes_the_next_engine_whole_and_merges_the_owners_files(repos):
    template, copy = repos
    old_version, old_engine = engine_version(copy), engine_hashes(copy, files(copy))
    assert old_engine == engine_hashes(template, files(template))  # precondition: the copy got engine A whole
    user_top = "# the user's note on their model\n"
    module = copy / in_copy(USER_FILE)
    module.write_text(user_top + module.read_text())
    user_head = commit_all(copy, "user's changes")
    (copy / "runs" / "x").mkdir(parents=True)
    (copy / "runs" / "x" / "last.ckpt").write_bytes(b"weights")
    theirs = commit_b(template)
    new_version = engine_version(template)
    assert new_version != old_version and engine_hashes(template, files(template)) != old_engine  # precondition

    proc = run_script(template, "--update", str(copy))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    branch = f"template-update-{theirs[:7]}"
    assert branch in proc.stdout and "no conflicts" in proc.stdout
    assert f"lightkeep {old_version} -> {new_version}" in proc.stdout
    assert git(copy, "branch", "--show-current").strip() == branch and git(copy, "status", "--porcelain") == ""
    assert git(copy, "rev-parse", "HEAD~1").strip() == user_head
    # the engine: B's files, byte for byte, and no more (not its suite); the record names B and its version
    assert engine_hashes(copy, files(copy)) == engine_hashes(template, git(template, "ls-files").splitlines())
    assert not (copy / "engine" / "tests").exists()
    record = json.loads((copy / ".template.json").read_text())
    assert (record["template_commit"], record["engine"]) == (theirs, new_version)
    # the owner's files: both changes, each in its place; the template's new test, renamed
    merged = module.read_text()
    assert merged.startswith(user_top) and merged.endswith(USER_FILE_FIX)
    assert (copy / NEW_TEST[0]).read_text() == NEW_TEST[1]
    assert (copy / "runs" / "x" / "last.ckpt").read_bytes() == b"weights"


@pytest.mark.slow
def test_the_updated_copy_passes_its_own_tests_on_its_new_engine(repos):
    """The template's new test imports the new engine file, which only the copy's engine/ has (the template's
    engine installed in .venv has not); the configs parse with the new engine."""
    template, copy = repos
    module = copy / in_copy(USER_FILE)
    module.write_text("# the user's note on their model\n" + module.read_text())
    commit_all(copy, "user's note")
    commit_b(template)
    proc = run_script(template, "--update", str(copy))
    assert proc.returncode == 0 and (copy / NEW_TEST[0]).is_file(), proc.stdout + proc.stderr
    _pytest(copy, _env(copy, copy.parent / "blocker"), "tests/test_configs.py", NEW_TEST[0])


def test_a_change_both_made_to_an_owners_file_is_a_listed_conflict_with_markers(repos):
    template, copy = repos
    ours = append(copy / in_copy(USER_FILE), "\n# the user's ending\n")
    commit_all(copy, "user's ending")
    theirs = commit_b(template)

    proc = run_script(template, "--update", str(copy))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"  {in_copy(USER_FILE)}\n" in proc.stdout and "conflicts in 1 file:" in proc.stdout
    text = (copy / in_copy(USER_FILE)).read_text()
    ending = f"<<<<<<< HEAD\n# the user's ending\n=======\n{USER_FILE_FIX[1:]}>>>>>>> template {theirs[:7]}\n"
    assert text == ours[: ours.rindex("# the user's ending")] + ending  # the blank line both added is merged
    assert f"UU {in_copy(USER_FILE)}" in git(copy, "status", "--porcelain").splitlines()
    assert engine_hashes(copy, files(copy)) == engine_hashes(template, git(template, "ls-files").splitlines())


def test_a_file_the_user_deleted_stays_deleted(repos):
    template, copy = repos
    git(copy, "rm", "-q", "scripts/plot_run.py", "configs/wandb.yaml")
    commit_all(copy, "no plots, no W&B")
    commit_b(template)
    proc = run_script(template, "--update", str(copy))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert not (copy / "scripts" / "plot_run.py").exists() and not (copy / "configs" / "wandb.yaml").exists()
    assert (copy / NEW_ENGINE_FILE[0]).is_file() and git(copy, "status", "--porcelain") == ""


@pytest.mark.parametrize("how", ["edited", "added", "deleted"])
def test_a_copy_whose_engine_was_changed_is_refused_naming_the_file(repos, how):
    """Never a merge of two engines: the update is refused before anything changes (no branch), naming the file."""
    template, copy = repos
    deleted = "engine/lightkeep/export/formats.py"
    rel = {"edited": ENGINE_FILE, "added": "engine/lightkeep/mine.py", "deleted": deleted}[how]
    if how == "deleted":
        git(copy, "rm", "-q", rel)
    else:
        (copy / rel).write_text((copy / rel).read_text() + "# mine\n" if how == "edited" else "# mine\n")
    commit_all(copy, f"user {how} {rel}")
    commit_b(template)
    before = state(copy)
    proc = run_script(template, "--update", str(copy))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert rel in proc.stderr and "the engine is updated as one unit" in proc.stderr, proc.stderr
    assert "Nothing was changed" in proc.stderr and proc.stdout == ""
    assert state(copy) == before and "template-update" not in before[1]


def test_an_engine_taken_with_uncommitted_template_changes_is_refused_saying_so(repos, tmp_path):
    """The template had an uncommitted change in an engine file when the copy was made: the copy's engine is not
    the version's, and the refusal says where it came from."""
    template, _ = repos
    append(template / ENGINE_FILE, "# the template's unfinished work\n")
    proc = run_script(template, str(tmp_path / "dirty_copy"), "--name", NAME)
    assert proc.returncode == 0 and "uncommitted changes in 1 file" in proc.stdout, proc.stdout + proc.stderr
    copy = tmp_path / "dirty_copy"
    assert json.loads((copy / ".template.json").read_text())["uncommitted"] == [ENGINE_FILE]
    commit_b(template)  # B commits the unfinished work too
    before = state(copy)
    proc = run_script(template, "--update", str(copy))
    assert proc.returncode == 2 and f"{ENGINE_FILE}: uncommitted in the template" in proc.stderr, proc.stderr
    assert state(copy) == before


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("modified", "has uncommitted changes; commit or stash them"),
        ("untracked", "has uncommitted changes; commit or stash them"),
        ("no_record", "has no .template.json"),
        ("not_git", "is not the root of a git repository"),
        ("template_dirty", "has uncommitted changes (project/nets.py)"),
        ("answers_given", "--update takes its answers from DEST/.template.json; leave out --name"),
    ],
)
def test_an_update_that_cant_be_done_safely_is_refused_and_changes_nothing(repos, case, message):
    template, copy = repos
    commit_b(template)
    if case == "modified":
        append(copy / in_copy(USER_FILE), "# half done\n")
    elif case == "untracked":
        (copy / "notes.txt").write_text("mine")
    elif case == "no_record":
        git(copy, "rm", "-q", ".template.json")
        commit_all(copy, "no record")
    elif case == "not_git":
        shutil.rmtree(copy / ".git")
    elif case == "template_dirty":
        append(template / "project" / "nets.py", "# unfinished\n")
    before = state(copy)
    proc = run_script(template, "--update", str(copy), *(["--name", NAME] if case == "answers_given" else []))
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert proc.stderr.splitlines()[-1].startswith("new_project.py: error: ") and proc.stdout == ""
    assert state(copy) == before
