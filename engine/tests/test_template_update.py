"""scripts/new_project.py --update: a copy takes the template's later commits in a three-way merge on a new branch,
keeps the user's changes and deletions, lists conflicts, and is refused with nothing changed when it can't be done."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO
from tests.test_new_project import GIT_ID, NAME, _env, _pytest

ENV = {**os.environ, **GIT_ID}
ENGINE = "engine/steadfast/schedule.py"  # an engine file the copy's tests/test_schedule.py imports
USER_FILE = "project/module.py"
TEMPLATE_FIX = "\n\ndef template_fix() -> int:\n    return 17\n"
NEW_FILE = ("engine/steadfast/fix.py", '"""A fix."""\n\nfrom steadfast.schedule import template_fix\n')
NEW_TEST = ("tests/test_fix.py", "from steadfast.fix import template_fix\n\n\ndef test_fix():\n"
            "    assert template_fix() == 17\n")  # fmt: skip


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


def state(copy: Path) -> tuple[str, str, str, dict[str, bytes]]:
    """HEAD, branches, ``git status`` and every file's bytes: what a refused update must leave as it was."""
    files = {
        p.relative_to(copy).as_posix(): p.read_bytes() for p in copy.rglob("*") if p.is_file() and ".git" not in p.parts
    }
    if not (copy / ".git").exists():
        return "", "", "", files
    return git(copy, "rev-parse", "HEAD"), git(copy, "branch", "-a"), git(copy, "status", "--porcelain"), files


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


def commit_b(template: Path, engine_addition: str = TEMPLATE_FIX) -> str:
    """Template commit B: a fix at the end of the engine file, a new engine file and a test that uses both."""
    append(template / ENGINE, engine_addition)
    for rel, text in (NEW_FILE, NEW_TEST):
        (template / rel).write_text(text)
    return commit_all(template, "B: a fix")


def test_update_merges_the_template_fix_with_the_users_changes(repos):
    template, copy = repos
    user_top = "# the user's note on the schedule\n"
    engine = copy / in_copy(ENGINE)
    engine.write_text(user_top + engine.read_text())
    user_module = append(copy / in_copy(USER_FILE), "\n# the user's own model code\n")
    user_head = commit_all(copy, "user's changes")
    (copy / "runs" / "x").mkdir(parents=True)
    (copy / "runs" / "x" / "last.ckpt").write_bytes(b"weights")
    theirs = commit_b(template)
    assert TEMPLATE_FIX not in engine.read_text()  # precondition: the fix is not in the copy yet

    proc = run_script(template, "--update", str(copy))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    branch = f"template-update-{theirs[:7]}"
    assert branch in proc.stdout and "no conflicts" in proc.stdout
    assert git(copy, "branch", "--show-current").strip() == branch and git(copy, "status", "--porcelain") == ""
    assert git(copy, "rev-parse", "HEAD~1").strip() == user_head
    merged = engine.read_text()
    assert merged.startswith(user_top) and merged.endswith(TEMPLATE_FIX)  # both changes, each in its place
    assert (copy / in_copy(NEW_FILE[0])).read_text() == NEW_FILE[1].replace("project.", f"{NAME}.")
    assert (copy / in_copy(USER_FILE)).read_text() == user_module
    assert (copy / "runs" / "x" / "last.ckpt").read_bytes() == b"weights"
    assert json.loads((copy / ".template.json").read_text())["template_commit"] == theirs


@pytest.mark.slow
def test_the_updated_copy_passes_its_own_tests(repos):
    """Its schedule tests import the merged engine file; the template's new test imports the renamed new file."""
    template, copy = repos
    engine = copy / in_copy(ENGINE)
    engine.write_text("# the user's note on the schedule\n" + engine.read_text())
    commit_all(copy, "user's note")
    commit_b(template)
    proc = run_script(template, "--update", str(copy))
    assert proc.returncode == 0 and (copy / NEW_TEST[0]).is_file(), proc.stdout + proc.stderr
    _pytest(copy, _env(copy, copy.parent / "blocker"), "tests/test_schedule.py", NEW_TEST[0])


def test_a_change_both_made_is_a_listed_conflict_with_markers(repos):
    template, copy = repos
    ours = append(copy / in_copy(ENGINE), "\n# the user's ending\n")
    commit_all(copy, "user's ending")
    theirs = commit_b(template)

    proc = run_script(template, "--update", str(copy))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"  {in_copy(ENGINE)}\n" in proc.stdout and "conflicts in 1 file:" in proc.stdout
    text = (copy / in_copy(ENGINE)).read_text()
    ending = f"<<<<<<< HEAD\n# the user's ending\n=======\n{TEMPLATE_FIX[1:]}>>>>>>> template {theirs[:7]}\n"
    assert text == ours[: ours.rindex("# the user's ending")] + ending  # the blank line both added is merged
    assert f"UU {in_copy(ENGINE)}" in git(copy, "status", "--porcelain").splitlines()
    assert (copy / in_copy(NEW_FILE[0])).is_file()  # the rest merged


def test_a_file_the_user_deleted_stays_deleted(repos):
    template, copy = repos
    git(copy, "rm", "-q", "scripts/plot_run.py", "tests/test_plot.py")
    commit_all(copy, "no plots")
    commit_b(template)
    proc = run_script(template, "--update", str(copy))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert not (copy / "scripts" / "plot_run.py").exists() and not (copy / "tests" / "test_plot.py").exists()
    assert (copy / in_copy(NEW_FILE[0])).is_file() and git(copy, "status", "--porcelain") == ""


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
