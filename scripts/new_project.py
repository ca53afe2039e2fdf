"""Start a new project from this template: python scripts/new_project.py DEST --name my_project

The copy is a working project of its own. The package ``project/`` becomes ``my_project/`` and every reference
to it follows: imports, ``class_path`` in configs, ``python -m project``, the console script, the name and
package settings in ``pyproject.toml``, the README title, tests and CI. The word "project" anywhere else stays:
prose, strings and keywords (W&B's ``args["project"]``, ``project=``), ``pyproject.toml``, TOML tables such as
``[project.scripts]``. The engine, ``engine/`` (the package ``lightkeep``), is no part of that: it travels as one
unit, byte for byte at its version, without its own suite (``engine/tests/``).

Files come from ``git ls-files`` plus the untracked files git does not ignore, or, outside git, from a walk that
honours ``.gitignore``; runs, checkpoints, caches, virtual environments and build outputs never travel. The
generator, its tests and ``scripts/skeleton/`` stay behind too, as do the benchmarks and their page
``docs/speed.md`` (``TEMPLATE_ONLY``), and lines between ``template-only:start`` and ``template-only:end`` markers
(e.g. the README's "Start your own project"). The copy gets a fresh ``git init`` with one commit. Only the
standard library is used, so it runs before any setup.

``--no-example`` replaces the digits DataModule with the skeleton in ``scripts/skeleton/`` (synthetic data in the
same resumable loaders) and leaves out the tests that mention the digits and the scripts that use their
DataModule; the Classifier and the nets stay. Where ruff is at hand, renamed Python files are re-sorted and
re-formatted, as a longer name can push a line past the limit.

The copy's ``.template.json`` records the template commit it came from and the answers (name, author, description,
--no-example); files taken with uncommitted changes are listed there too, and --update treats them as the user's.
``python scripts/new_project.py --update DEST``, run from a newer template checkout, copies the recorded commit and
the template's HEAD again with those answers and three-way merges the difference into DEST (``git merge-recursive``,
the older copy as base) on a new branch ``template-update-<sha>``: committed when clean; otherwise the conflicted
files are listed and left with git's markers, and the exit status is 1. The record then names the new commit and
engine version. The engine is taken whole, never merged: a copy whose ``engine/`` differs from the one it got is
refused, naming the files. DEST must be a git repository with no uncommitted changes, and the template a checkout
with none: otherwise nothing changes.
"""

import argparse
import keyword
import os
import re
import shutil
import subprocess
import sys
import tempfile
from importlib.util import find_spec
from pathlib import Path

# The generator's other modules, beside this script (sys.path[0] when it runs; all stay behind in a copy):
# which files travel and how each is written, the renaming, --no-example, --update.
from template_copy import (
    ENGINE,
    PACKAGE,
    RECORD,
    ROOT,
    UsageError,
    engine_version,
    make_record,
    n_files,
    parse_author,
    render,
    template_files,
    template_state,
)
from template_update import update

# fmt: off
# Names a package must not take: what projects made from this template import, and the test tools.
COMMON_MODULES = {"torch", "torchvision", "torchaudio", "torchtext", "lightning", "pytorch_lightning",
                  "lightning_fabric", "lightning_utilities", "torchmetrics", "jsonargparse", "tensorboard", "sklearn",
                  "numpy", "scipy", "pandas", "matplotlib", "yaml", "pytest", "ruff", "setuptools", "pip", "wheel",
                  "transformers", "datasets", "timm", "hydra", "omegaconf", "wandb", "mlflow", "einops", "tqdm"}
# fmt: on


def check_name(name: str, top_level: set[str], engine: set[str] = frozenset()) -> None:
    """``top_level``: the folders at the copy's root; ``engine``: the packages of the engine it vendors."""
    if not re.fullmatch(r"[a-z][a-z0-9_]*", name):
        hint = re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_") or "my_project"
        raise UsageError(f"--name {name!r} is not a valid package name: use lowercase letters, digits and underscores, "
                         f"starting with a letter, e.g. {hint if hint[0].isalpha() else 'my_' + hint!r}")  # fmt: skip
    why = None
    if keyword.iskeyword(name):
        why = "is a Python keyword"
    elif name == PACKAGE:
        why = "is the template's own package name; a copy needs a name of its own"
    elif name in {*sys.stdlib_module_names, *sys.builtin_module_names, "test"}:  # "test": CPython's own tests
        why = f"would shadow the standard-library module {name!r}"
    elif name in engine:
        why = f"would shadow the engine's package {name!r}, which the copy carries in {ENGINE}/"
    elif name in COMMON_MODULES:
        why = f"would shadow {name!r}, which projects made from this template (or their tests) import"
    elif name in top_level:
        why = f"would clash with the folder {name}/ at the project's root"
    else:
        try:
            spec = find_spec(name)
        except (ImportError, ValueError):
            spec = None
        origin = spec and (spec.origin or next(iter(spec.submodule_search_locations or []), None))
        if origin and not Path(origin).resolve().is_relative_to(ROOT):
            why = f"would shadow the module {name!r} installed at {origin}"
    if why:
        raise UsageError(f"--name {name!r} {why}; choose a more specific name, e.g. {name}_lab")


def check_dest(dest: Path) -> Path:
    dest = dest.expanduser().resolve()
    if dest.is_relative_to(ROOT):
        raise UsageError(f"DEST {dest} is inside the template {ROOT}; choose a folder outside it, "
                         f"e.g. {ROOT.parent / dest.name}")  # fmt: skip
    if dest.exists() and not dest.is_dir():
        raise UsageError(f"DEST {dest} exists and is not a folder")
    if dest.is_dir() and any(dest.iterdir()):
        raise UsageError(f"DEST {dest} exists and is not empty; choose a new or empty folder")
    return dest


def init_git(path: Path, author: dict[str, str], name: str) -> str:
    """``git init`` and one commit; returns what happened, in words."""
    if shutil.which("git") is None:
        return "git not found: no repository"
    env = {k: v for k, v in os.environ.items() if k not in ("GIT_DIR", "GIT_WORK_TREE", "GIT_INDEX_FILE")}
    env.update({f"GIT_{role}_{k.upper()}": v for k, v in author.items() for role in ("AUTHOR", "COMMITTER")})
    message = f"{name}: new project from the template"
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-q", "--no-verify", "-m", message]):
        proc = subprocess.run(["git", "-c", "commit.gpgsign=false", *args], cwd=path, env=env, capture_output=True,
                              text=True)  # fmt: skip
        if proc.returncode:
            return f"git {args[0]} failed ({proc.stderr.strip()}); finish by hand"
    return "git repository with one commit"


def generate(dest: Path, name: str, example: bool = True, author: str | None = None,
             description: str | None = None, git: bool = True) -> tuple[Path, str]:  # fmt: skip
    """Writes the new project to ``dest``, all or nothing; returns its path and what git did."""
    files = template_files()
    if not any(p.parts[0] == PACKAGE and p.name == "__init__.py" for p in files):
        raise RuntimeError(f"the template has no package {PACKAGE}/ at {ROOT}")
    engine = {p.parts[1] for p in files if p.parts[0] == ENGINE.name and len(p.parts) == 3 and p.name == "__init__.py"}
    check_name(name, {p.parts[0] for p in files if len(p.parts) > 1}, engine)
    dest, author_fields = check_dest(Path(dest)), parse_author(author)
    parent = next(p for p in dest.parents if p.is_dir())
    staging = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=parent))
    try:
        render(ROOT, files, staging, name, example, author_fields, description)
        commit, uncommitted = template_state()
        (staging / RECORD).write_text(
            make_record(commit, uncommitted, name, example, author, description, engine_version(ROOT))
        )
        note = init_git(staging, author_fields, name) if git else "no git (--no-git)"
        if commit is None:
            note += f"; the template is not a git checkout, so {RECORD} names no commit and --update can't run"
        elif uncommitted:
            note += (f"; the template had uncommitted changes in {n_files(len(uncommitted))} ({RECORD} lists them): "
                     f"--update will treat them as your own")  # fmt: skip
        dest.parent.mkdir(parents=True, exist_ok=True)
        if dest.is_dir():  # empty: keep the folder itself, it may be the user's working directory
            for child in staging.iterdir():
                child.rename(dest / child.name)
            staging.rmdir()
        else:
            staging.rename(dest)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return dest, note


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dest", type=Path, help="the new project's folder: new, or empty; with --update, a copy")
    parser.add_argument("--name", help="its package name, e.g. my_project (lowercase, digits, _)")
    parser.add_argument("--no-example", action="store_true", help="a DataModule skeleton instead of the digits")
    parser.add_argument("--author", help='"Name <email>" for pyproject.toml and the first commit')
    parser.add_argument("--description", help="one line for pyproject.toml and the README")
    parser.add_argument("--no-git", action="store_true", help="no git init and no first commit")
    parser.add_argument("--update", action="store_true", help=f"merge this template's changes into the copy DEST, "
                        f"on a new branch, with the answers in its {RECORD}")  # fmt: skip
    args = parser.parse_args(argv)
    if args.update:
        given = [f for f in ("name", "author", "description", "no_example", "no_git") if getattr(args, f)]
        if given:
            flags = ", ".join("--" + f.replace("_", "-") for f in given)
            parser.error(f"--update takes its answers from DEST/{RECORD}; leave out {flags}")
        try:
            report, conflicts = update(args.dest)
        except UsageError as error:
            parser.error(f"{error}. Nothing was changed.")
        except RuntimeError as error:
            print(f"new_project.py: error: {error}. Nothing was changed.", file=sys.stderr)
            return 1
        print(report)
        return 1 if conflicts else 0
    if not args.name:
        parser.error("the following arguments are required: --name")
    try:
        dest, note = generate(args.dest, args.name, not args.no_example, args.author, args.description, not args.no_git)
    except UsageError as error:
        parser.error(f"{error}. Nothing was created.")
    except RuntimeError as error:  # the template and its skeleton disagree: a bug to report, not a user error
        print(f"new_project.py: error: {error}. Nothing was created.", file=sys.stderr)
        return 1
    print(f"Created {dest}: package {args.name}/, {note}.\nNext: cd {dest} && make setup && make test")
    return 0


if __name__ == "__main__":
    sys.exit(main())
