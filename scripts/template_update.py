"""``--update``: a copy takes the template's later commits. The template at the commit the copy records and at its
HEAD are each rendered as a copy with the recorded answers (``template_copy.render``, this checkout's generator,
the files of that commit), and git three-way merges the difference into the copy on a new branch. Used by
scripts/new_project.py; only the standard library.
"""

import json
import os
import re
import shutil
import tempfile
from pathlib import Path

from template_copy import (
    ENGINE,
    RECORD,
    ROOT,
    UsageError,
    git,
    is_git_top,
    left_out,
    make_record,
    n_files,
    parse_author,
    render,
    template_state,
)


def _copy_as_tree(dest: Path, rev: str, answers: dict, record: str, tmp: Path) -> str:
    """The copy the template at ``rev`` gives with ``answers``, stored as a tree in DEST's repository; its id."""
    src, out, index = tmp / f"{rev}-template", tmp / f"{rev}-copy", tmp / f"{rev}.index"
    env = {**os.environ, "GIT_INDEX_FILE": str(index)}
    git(ROOT, "read-tree", rev, env=env)
    git(ROOT, "checkout-index", "-a", f"--prefix={src}/", env=env)
    listed = git(ROOT, "ls-files", "-z", env=env).stdout.split("\0")
    files = sorted(Path(p) for p in listed if p and not left_out(Path(p)))
    author = parse_author(answers.get("author"))
    render(src, files, out, answers["name"], answers.get("example", True), author, answers.get("description"))
    (out / RECORD).write_text(record)
    index.unlink()
    git(dest, "--work-tree", str(out), "add", "-A", "-f", env=env)  # -f: the copy's .gitignore keeps nothing out
    return git(dest, "write-tree", env=env).stdout.strip()


def _engine_version_at(rev: str) -> str | None:
    """The engine's version in the template at ``rev``."""
    text = git(ROOT, "show", f"{rev}:{ENGINE.as_posix()}/pyproject.toml", check=False).stdout
    found = re.search(r'^version\s*=\s*"([^"]+)"', text, re.M)
    return found[1] if found else None


def check_update(dest: Path) -> tuple[dict, str, str]:
    """DEST's record, its text and the template's HEAD, or a UsageError saying what stands in the way."""
    if not dest.is_dir() or shutil.which("git") is None or not is_git_top(dest):
        raise UsageError(f"DEST {dest} is not the root of a git repository; --update merges on a new branch there: "
                         f"run it on the copy's own folder, or git init and commit the copy first")  # fmt: skip
    if git(dest, "rev-parse", "--verify", "-q", "HEAD", check=False).returncode:
        raise UsageError(f"DEST {dest} has no commits yet; commit the copy first")
    if git(dest, "status", "--porcelain").stdout:
        raise UsageError(f"DEST {dest} has uncommitted changes; commit or stash them (git stash -u) first")
    try:
        text = (dest / RECORD).read_text()
        answers = json.loads(text)
    except FileNotFoundError:
        raise UsageError(f"DEST {dest} has no {RECORD}, so the template commit it came from is unknown; write one, "
                         f'{{"template_commit": "<sha>", "name": "<package>"}}, and commit it') from None  # fmt: skip
    except (OSError, ValueError) as error:
        raise UsageError(f"{dest / RECORD} can't be read ({error}); restore it from the copy's history") from None
    old = answers.get("template_commit") if isinstance(answers, dict) else None
    if not old or not answers.get("name"):
        raise UsageError(f"{dest / RECORD} names no template_commit or no name (a copy of a template outside git); "
                         f"set both to the template commit it came from and its package, and commit it")  # fmt: skip
    head, uncommitted = template_state()
    if head is None:
        raise UsageError(f"the template {ROOT} is not a git checkout with commits; run --update from a clone of it")
    if uncommitted:
        raise UsageError(f"the template {ROOT} has uncommitted changes ({', '.join(uncommitted[:3])}); commit or "
                         f"stash them, so that {RECORD} names the commit that was merged")  # fmt: skip
    if git(ROOT, "cat-file", "-e", f"{old}^{{commit}}", check=False).returncode:
        raise UsageError(f"the template commit {old} that DEST came from is not in {ROOT}; git fetch it there, or "
                         f"run --update from a clone that has it")  # fmt: skip
    if old != head and git(ROOT, "merge-base", "--is-ancestor", old, head, check=False).returncode:
        raise UsageError(f"the template's HEAD {head[:12]} does not contain {old[:12]}, the commit DEST came from; "
                         f"check out a newer template commit")  # fmt: skip
    branch = f"template-update-{head[:7]}"
    if git(dest, "rev-parse", "--verify", "-q", f"refs/heads/{branch}", check=False).returncode == 0:
        raise UsageError(f"DEST already has a branch {branch}; merge or delete it (git branch -D {branch}) first")
    return answers, text, head


def update(dest: Path) -> tuple[str, list[str]]:
    """Merges what the template changed since DEST's recorded commit into DEST, on a new branch, and says how.

    A three-way merge: the base is this script's copy of the recorded commit, theirs its copy of the template's
    HEAD, both with DEST's recorded answers; ours is DEST's HEAD. Returns a report and the conflicted paths.
    """
    dest = dest.expanduser().resolve()
    answers, old_record, head = check_update(dest)
    old = answers["template_commit"]
    if old == head:
        return f"{dest} is already at the template's commit {head[:7]}; nothing to do.", []
    new_record = make_record(head, [], answers["name"], answers.get("example", True), answers.get("author"),
                             answers.get("description"), _engine_version_at(head))  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        base = _copy_as_tree(dest, old, answers, old_record, Path(tmp))
        theirs = _copy_as_tree(dest, head, answers, new_record, Path(tmp))
    # The engine is taken whole: a copy whose engine/ is not the one it was given would get a merge of two engines,
    # neither of them tested. Refused before anything changes, naming the files.
    edited = git(dest, "diff", "--name-only", "-z", base, "HEAD", "--", ENGINE.as_posix()).stdout.split("\0")
    if edited := sorted(p for p in edited if p):
        version = answers.get("engine") or "the version it came with"
        # a copy made from a template with uncommitted engine changes got them: not the version's files either
        dirty = [p for p in edited if p in (answers.get("uncommitted") or [])]
        came = f" ({', '.join(dirty[:3])}: uncommitted in the template when the copy was made, {RECORD} lists them)"
        raise UsageError(f"{', '.join(edited[:3])}{' ...' if len(edited) > 3 else ''} differ(s) from lightkeep "
                         f"{version} at template commit {old[:7]}{came if dirty else ''}: the engine is updated as "
                         f"one unit, never merged. Move your change out of engine/ (a subclass or callback in your "
                         f"package; a fix the engine needs: propose it to the template), undo the edits (git log -p "
                         f"-- engine/ shows them), commit, and --update again")  # fmt: skip
    start = git(dest, "symbolic-ref", "-q", "--short", "HEAD", check=False).stdout.strip()
    start = start or git(dest, "rev-parse", "HEAD").stdout.strip()
    branch = f"template-update-{head[:7]}"
    git(dest, "checkout", "-q", "-b", branch)
    labels = {f"GITHEAD_{base}": f"template {old[:7]}", f"GITHEAD_{theirs}": f"template {head[:7]}"}  # in markers
    merged = git(dest, "merge-recursive", base, "--", "HEAD", theirs, env={**os.environ, **labels}, check=False)
    conflicts = sorted(p for p in git(dest, "diff", "--name-only", "-z", "--diff-filter=U").stdout.split("\0") if p)
    if merged.returncode and not conflicts:  # git refused before merging, e.g. an ignored file in the way
        git(dest, "reset", "-q", "--hard")
        git(dest, "checkout", "-q", start)
        git(dest, "branch", "-q", "-D", branch)
        raise RuntimeError(f"git merge-recursive failed in {dest}: {(merged.stderr or merged.stdout).strip()}")
    log = git(ROOT, "log", "--oneline", "--no-decorate", f"{old}..{head}").stdout
    engines = (answers.get("engine"), _engine_version_at(head))
    engine = f"; the engine lightkeep {engines[0]} -> {engines[1]}, whole" if engines[0] != engines[1] else ""
    message = f"Template update {old[:7]}..{head[:7]}{engine}\n\n{log}"
    if conflicts:
        squash_msg = git(dest, "rev-parse", "--git-path", "SQUASH_MSG").stdout.strip()
        (dest / squash_msg).write_text(message)  # git commit offers it
        return (f"Merged template {old[:7]}..{head[:7]} into {dest} on branch {branch}, with conflicts in "
                f"{n_files(len(conflicts))}:\n" + "".join(f"  {p}\n" for p in conflicts) +
                "Resolve the <<<<<<< markers, git add the files and git commit; or give up with git reset --hard "
                f"&& git switch {start} && git branch -D {branch}."), conflicts  # fmt: skip
    changes = git(dest, "diff", "--cached", "--name-status", "HEAD").stdout.splitlines()
    counts = {k: sum(line[0] == k for line in changes) for k in "MAD"}
    committed = git(dest, "commit", "-q", "--no-verify", "-m", message, check=False)
    done = "committed" if committed.returncode == 0 else f"staged, not committed ({committed.stderr.strip()})"
    return (f"Merged template {old[:7]}..{head[:7]}{engine} into {dest} on branch {branch}, {done}: "
            f"{n_files(counts['M'])} changed, {counts['A']} added, {counts['D']} removed, no conflicts.\n"
            f"Next: make test there, then git switch {start} && git merge {branch}."), []  # fmt: skip
