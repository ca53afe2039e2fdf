"""What a copy of the template is made of: which files travel (``template_files``; ``TEMPLATE_ONLY`` and runs,
caches, build outputs stay behind), and how each is written into the copy (``render``: renamed, template-only
blocks dropped, metadata set, re-formatted). scripts/new_project.py writes a new copy with it and
scripts/template_update.py the copies of two template commits it merges. Only the standard library.
"""

import fnmatch
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from template_no_example import drop_example
from template_renamer import Renamer

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "project"
SKELETON = Path(__file__).resolve().parent / "skeleton"
# The generator: what makes copies and is no part of one.
GENERATOR = ("scripts/new_project.py", "scripts/template_copy.py", "scripts/template_renamer.py",
             "scripts/template_no_example.py", "scripts/template_update.py", "scripts/skeleton/")  # fmt: skip
# What stays behind: the generator, its tests and the CI run of a copy; the template's benchmarks with the page of
# their figures (a copy's owner times their own model; the figures name the template's code). Paths, folders/ or
# patterns.
TEMPLATE_ONLY = (
    *GENERATOR,
    "engine/tests/",  # the engine's own suite stays with the engine (the template's CI runs it); a copy self-checks
    "tests/test_new_project.py",
    "tests/test_template_update.py",
    "tests/test_example_apart.py",  # it scans engine/tests, which a copy has not
    "scripts/benchmark*.py",
    "tests/test_benchmark.py",
    "scripts/count_syncs*.py",  # it runs the benchmark's hand loop and plain Lightning beside the template
    "tests/test_count_syncs*.py",
    "tests/test_count_syncs.py",
    "docs/speed.md",
    ".ci/test_copy.sh",
)
RECORD = ".template.json"  # in the copy: the template commit and the answers it was made from; --update reads it
ENGINE = Path("engine")  # vendored into a copy as it is, one unit at its version: never renamed or merged
# fmt: off
LEFT_OUT_DIRS = {".git", ".hg", ".svn", ".venv", "venv", "__pycache__", ".pytest_cache", ".ruff_cache", ".mypy_cache",
                 ".ipynb_checkpoints", "runs", "lightning_logs", "wandb", "mlruns", "build", "dist", "*.egg-info"}
LEFT_OUT_FILES = {"*.pyc", "*.pyo", "*.ckpt", ".DS_Store", ".env"}
# fmt: on


class UsageError(ValueError):
    """A bad name or DEST: reported before anything is written."""


def left_out(rel: Path, patterns: Sequence[str] = ()) -> bool:
    posix = rel.as_posix()
    if any(fnmatch.fnmatchcase(posix, t) or (t.endswith("/") and posix.startswith(t)) for t in TEMPLATE_ONLY):
        return True
    in_left_out_dir = any(fnmatch.fnmatch(d, p) for d in rel.parts[:-1] for p in LEFT_OUT_DIRS)
    if in_left_out_dir or any(fnmatch.fnmatch(rel.name, p) for p in LEFT_OUT_FILES):
        return True
    for pattern in patterns:  # a walk outside git: .gitignore's plain patterns, no negation
        anchored, dir_only, pattern = "/" in pattern.rstrip("/"), pattern.endswith("/"), pattern.strip("/")
        candidates = [Path(*rel.parts[: i + 1]) for i in range(len(rel.parts) - (1 if dir_only else 0))]
        if any(fnmatch.fnmatch(c.as_posix() if anchored else c.name, pattern) for c in candidates):
            return True
    return False


def template_files() -> list[Path]:
    """The template's files, relative to its root: what git tracks or would track, or a walk without git."""
    try:
        listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                                capture_output=True, check=True).stdout  # fmt: skip
        paths, patterns = [Path(p) for p in os.fsdecode(listed).split("\0") if p], []
    except (OSError, subprocess.CalledProcessError):
        paths = []
    if not paths:  # no git, or a repository that ignores the template
        ignore = ROOT / ".gitignore"
        lines = ignore.read_text().splitlines() if ignore.is_file() else []
        patterns = [p.strip() for p in lines if p.strip() and not p.startswith(("#", "!"))]
        paths = []
        for folder, dirs, names in os.walk(ROOT):
            rel = Path(folder).relative_to(ROOT)
            dirs[:] = [d for d in dirs if not left_out(rel / d / "-", patterns)]  # a child: the folder's own rules
            paths += [rel / n for n in names]
    return sorted(p for p in paths if ((ROOT / p).is_file() or (ROOT / p).is_symlink()) and not left_out(p, patterns))


def is_git_top(path: Path) -> bool:
    top = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=path, capture_output=True, text=True)
    return top.returncode == 0 and Path(top.stdout.strip()).resolve() == path.resolve()


def git(cwd: Path, *args: str, env: dict[str, str] | None = None, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-c", "commit.gpgsign=false", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, check=check)  # fmt: skip


def template_state() -> tuple[str | None, list[str]]:
    """The template's HEAD commit (None outside git) and the files a copy takes that differ from it."""
    if shutil.which("git") is None or not is_git_top(ROOT):
        return None, []
    head = git(ROOT, "rev-parse", "--verify", "-q", "HEAD^{commit}", check=False).stdout.strip()
    if not head:  # a repository without commits
        return None, []
    changed = git(ROOT, "diff", "--name-only", "-z", "HEAD").stdout
    changed += git(ROOT, "ls-files", "-z", "--others", "--exclude-standard").stdout
    return head, sorted({p for p in changed.split("\0") if p and not left_out(Path(p))})


def n_files(n: int) -> str:
    return f"{n} file{'s' * (n != 1)}"


def engine_version(root: Path) -> str | None:
    """The vendored engine's version, from ``engine/pyproject.toml`` under ``root``."""
    path = root / ENGINE / "pyproject.toml"
    found = re.search(r'^version\s*=\s*"([^"]+)"', path.read_text(), re.M) if path.is_file() else None
    return found[1] if found else None


def is_engine(rel: Path) -> bool:
    return rel.parts[:1] == ENGINE.parts


def make_record(commit: str | None, uncommitted: list[str], name: str, example: bool, author: str | None,
                description: str | None, engine: str | None = None) -> str:  # fmt: skip
    """``uncommitted``: template files the copy took as they were on disk, not as in ``commit``; ``engine``: the
    version of the engine vendored."""
    fields = {"template_commit": commit, "uncommitted": uncommitted, "name": name, "example": example,
              "author": author, "description": description, "engine": engine}  # fmt: skip
    return json.dumps(fields, indent=2, ensure_ascii=False) + "\n"


def parse_author(author: str | None) -> dict[str, str]:
    """``"Ada Lovelace <ada@example.org>"`` -> ``{"name": ..., "email": ...}``; either part may be left out."""
    if author is None:
        return {}
    found = re.fullmatch(r"\s*(?P<name>[^<>]*?)\s*(?:<(?P<email>[^<>\s]+)>)?\s*", author)
    if not found or not (found["name"] or found["email"]):
        raise UsageError(f'--author {author!r}: give "Name <email>", "Name" or "<email>"')
    return {k: v for k, v in found.groupdict().items() if v}


def set_metadata(pyproject: str, author: dict[str, str], description: str | None) -> str:
    """Sets ``description`` and ``authors`` in the ``[project]`` table."""
    lines = pyproject.splitlines(keepends=True)
    start = next(i for i, line in enumerate(lines) if line.strip() == "[project]") + 1
    end = next((i for i in range(start, len(lines)) if lines[i].lstrip().startswith("[")), len(lines))
    keys = {m.group(1): i for i in range(start, end) if (m := re.match(r"\s*([\w-]+)\s*=", lines[i]))}
    anchor = keys.get("description", keys.get("version", keys.get("name", start - 1)))
    if description is not None:
        line = f"description = {json.dumps(description, ensure_ascii=False)}\n"
        if "description" in keys:
            lines[anchor] = line
        else:
            lines.insert(anchor + 1, line)
            keys = {k: i + (i > anchor) for k, i in keys.items()}
            anchor += 1
    if author:
        fields = ", ".join(f"{k} = {json.dumps(v, ensure_ascii=False)}" for k, v in author.items())
        line = f"authors = [{{ {fields} }}]\n"
        if "authors" in keys:  # the old value goes, over as many lines as its brackets span
            first = last = keys["authors"]
            while "".join(lines[first : last + 1]).count("[") > "".join(lines[first : last + 1]).count("]"):
                last += 1
            lines[first : last + 1] = [line]
        else:
            lines.insert(anchor + 1, line)
    return "".join(lines)


def retitle(readme: str, name: str, description: str | None) -> str:
    """The first ``# `` heading outside code becomes the project's name, then the description if one is given."""
    lines, fence = readme.splitlines(keepends=True), False
    title = [f"# {name}\n"] + ([f"\n{description}\n"] if description else [])
    for i, line in enumerate(lines):
        fence ^= line.lstrip().startswith(("```", "~~~"))
        if not fence and line.startswith("# "):
            return "".join(lines[:i] + title + lines[i + 1 :])
    return "".join([*title, "\n", *lines])


def drop_template_only(text: str) -> str:
    return re.sub(r"^[^\n]*template-only:start.*?template-only:end[^\n]*(\n|$)", "", text, flags=re.M | re.S)


def tidy(paths: list[Path]) -> None:
    """A new name can unsort imports and lengthen lines: ruff redoes both, where one is at hand."""
    found = [shutil.which("ruff"), ROOT / ".venv" / "bin" / "ruff", Path(sys.executable).parent / "ruff"]
    ruff = next((str(r) for r in found if r and Path(r).is_file()), None)
    for args in (["check", "--fix", "--select", "I", "--quiet"], ["format", "--quiet"]) if ruff and paths else ():
        subprocess.run([ruff, *args, "--no-cache", *map(str, paths)], capture_output=True)


def render(root: Path, files: list[Path], out: Path, name: str, example: bool = True,
           author: dict[str, str] | None = None, description: str | None = None) -> None:  # fmt: skip
    """Writes the copy of the template at ``root`` (its ``files``) to the empty folder ``out``, renamed to ``name``."""
    texts: dict[Path, str] = {}
    raw: dict[Path, Path] = {}  # binary files and links travel as they are
    for rel in files:
        if is_engine(rel):  # the engine travels as it is: one unit, its files byte for byte the version's
            raw[rel] = root / rel
            continue
        data = b"\0" if (root / rel).is_symlink() else (root / rel).read_bytes()
        try:
            if b"\0" in data:
                raise UnicodeDecodeError("utf-8", data, 0, 1, "binary")
            texts[rel] = drop_template_only(data.decode("utf-8"))
        except UnicodeDecodeError:
            raw[rel] = root / rel
    renames = {} if example else drop_example(texts, root / SKELETON.relative_to(ROOT), PACKAGE)
    renamer = Renamer(
        PACKAGE, name, {Path(p.parts[1]).stem for p in files if p.parts[0] == PACKAGE and len(p.parts) > 1}
    )
    renamed = []
    for rel in sorted({*texts, *raw}):
        target = out / (Path(name, *rel.parts[1:]) if rel.parts[0] == PACKAGE else rel)
        target.parent.mkdir(parents=True, exist_ok=True)
        if rel in raw:
            shutil.copy2(raw[rel], target, follow_symlinks=False)
            continue
        text = texts[rel]
        for old, new in renames.items():
            text = re.sub(rf"\b{re.escape(old)}\b", new, text)
        text = renamer.file(rel, text)
        if rel == Path("pyproject.toml") and (author or description is not None):
            text = set_metadata(text, author or {}, description)
        if rel == Path("README.md"):
            text = retitle(text, name, description)
        target.write_text(text)
        if (root / rel).exists():
            shutil.copymode(root / rel, target)
        if target.suffix == ".py" and text != texts[rel]:
            renamed.append(target)
    tidy(renamed)
