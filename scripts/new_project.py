"""Start a new project from this template: python scripts/new_project.py DEST --name my_project

The copy is a working project of its own. The package ``project/`` becomes ``my_project/`` and every reference
to it follows: imports, ``class_path`` in configs, ``python -m project``, the console script, the name and
package settings in ``pyproject.toml``, the README title, tests and CI. The word "project" anywhere else stays:
prose, strings and keywords (W&B's ``args["project"]``, ``project=``), ``pyproject.toml``, TOML tables such as
``[project.scripts]``.

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
files are listed and left with git's markers, and the exit status is 1. The record then names the new commit. DEST
must be a git repository with no uncommitted changes, and the template a checkout with none: otherwise nothing
changes.
"""

import argparse
import ast
import fnmatch
import io
import json
import keyword
import os
import re
import shutil
import subprocess
import sys
import tempfile
import tokenize
from collections.abc import Sequence
from importlib.util import find_spec
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "project"
SKELETON = Path(__file__).resolve().parent / "skeleton"
# What stays behind: the generator and its tests, and the template's benchmarks with the page of their figures
# (a copy's owner times their own model; the figures name the template's code). Paths, folders/ or patterns.
TEMPLATE_ONLY = (
    Path(__file__).resolve().relative_to(ROOT).as_posix(),
    "tests/test_new_project.py",
    "tests/test_template_update.py",
    "scripts/skeleton/",
    "scripts/benchmark*.py",
    "tests/test_benchmark.py",
    "docs/speed.md",
)
RECORD = ".template.json"  # in the copy: the template commit and the answers it was made from; --update reads it
EXAMPLE_WORD = "digits"  # --no-example leaves out the tests that mention it
# fmt: off
LEFT_OUT_DIRS = {".git", ".hg", ".svn", ".venv", "venv", "__pycache__", ".pytest_cache", ".ruff_cache", ".mypy_cache",
                 ".ipynb_checkpoints", "runs", "lightning_logs", "wandb", "mlruns", "build", "dist", "*.egg-info"}
LEFT_OUT_FILES = {"*.pyc", "*.pyo", "*.ckpt", ".DS_Store", ".env"}
# Names a package must not take: what projects made from this template import, and the test tools.
COMMON_MODULES = {"torch", "torchvision", "torchaudio", "torchtext", "lightning", "pytorch_lightning",
                  "lightning_fabric", "lightning_utilities", "torchmetrics", "jsonargparse", "tensorboard", "sklearn",
                  "numpy", "scipy", "pandas", "matplotlib", "yaml", "pytest", "ruff", "setuptools", "pip", "wheel",
                  "transformers", "datasets", "timm", "hydra", "omegaconf", "wandb", "mlflow", "einops", "tqdm"}
# Keys of pyproject's [project] table: ``project.scripts`` there is a table, not a module of the package.
PEP621_KEYS = {"name", "version", "description", "readme", "requires-python", "license", "license-files", "authors",
               "maintainers", "keywords", "classifiers", "urls", "scripts", "gui-scripts", "entry-points",
               "dependencies", "optional-dependencies", "dynamic", "import-names", "import-namespaces"}
# fmt: on


class UsageError(ValueError):
    """A bad name or DEST: reported before anything is written."""


class Renamer:
    """Rewrites references to the package ``old`` as ``new``, file type by file type, and nothing else."""

    def __init__(self, old: str, new: str, submodules: set[str]) -> None:
        self.old, self.new, self.submodules = old, new, submodules
        o = re.escape(old)
        self._dotted = re.compile(rf"(?<![\w.\-/]){o}(?=\.([A-Za-z_][\w\-]*))")  # project.nets.MLP
        self._refs = [
            re.compile(rf"(?<=-m ){o}\b(?!-)"),  # python -m project
            re.compile(rf"(?:(?<=\./)|(?<![\w.\-/])){o}(?=/)"),  # project/data.py
            re.compile(rf"(?<=`){o}(?=[`\s])"),  # `project`, ``project fit``
        ]
        self._quoted = re.compile(rf"(?<=([\"'])){o}(?=\*?\1)")  # "project", "project*"
        self._leading = re.compile(rf"^([A-Za-z]{{0,2}}['\"]){o}(?=[\s'\"])")  # a string's first word
        self._module_arg = re.compile(rf"((['\"])-m\2\s*,\s*(['\"])){o}(?=\3)")  # "-m", "project" in code in a string
        self._shell_word = re.compile(rf"(?:^|(?<=[\s='\"(])|(?<=bin/)|(?<=[)}}]/)){o}(?=$|[\s'\";)|&:*/,])", re.M)
        self._scalar = re.compile(rf"((?:^|[:=\[,]|^\s*-)\s*([\"']?)){o}(?=\2\s*(?:$|[,\]#]))", re.M)  # key: project

    def _dotted_name(self, found: re.Match) -> str:
        table = found.group(1) in PEP621_KEYS and found.group(1) not in self.submodules  # [project.scripts]
        return found.group(0) if table else self.new

    def refs(self, text: str) -> str:
        """References that can sit in prose: dotted names, ``-m project``, ``project/`` paths, backticked."""
        text = self._dotted.sub(self._dotted_name, text)
        for pattern in self._refs:
            text = pattern.sub(self.new, text)
        return text

    def shell(self, line: str) -> str:
        directive = re.match(r"\s*#(SBATCH|PBS|BSUB)\b", line)  # scheduler directives: comments that are code
        code, comment = (line, "") if directive else _split_comment(line)
        return self.refs(self._shell_word.sub(self.new, code)) + self.refs(comment)

    def python(self, text: str) -> str:
        """Import statements, names bound by ``import project``, and references inside strings and comments."""
        try:
            tokens = list(tokenize.generate_tokens(io.StringIO(text).readline))
        except (tokenize.TokenError, SyntaxError):
            return self.refs(text)
        starts = [0]
        for line in text.splitlines(keepends=True):
            starts.append(starts[-1] + len(line))
        edits, names, binds = [], [], False
        stmt, expect, pending, at_start, prev, depth = None, False, False, True, "", 0
        texts = {tokenize.STRING, tokenize.COMMENT, getattr(tokenize, "FSTRING_MIDDLE", -1)}
        blank = (tokenize.NL, tokenize.COMMENT, tokenize.INDENT, tokenize.DEDENT, tokenize.NEWLINE, tokenize.ENDMARKER)
        code = [t for t in tokens if t.type not in blank]
        around = {id(t): ([c.string for c in code[max(i - 2, 0) : i][::-1]], [c.string for c in code[i + 1 : i + 2]])
                  for i, t in enumerate(code)}  # fmt: skip
        for tok in tokens:
            a, b = starts[tok.start[0] - 1] + tok.start[1], starts[tok.end[0] - 1] + tok.end[1]
            before, after = around.get(id(tok), ([], []))
            if tok.type in texts:
                new = self.refs(text[a:b])
                if tok.type == tokenize.STRING:
                    new = self._module_arg.sub(lambda m: m.group(1) + self.new, new)
                    if re.search(r"-m (['\"])\s*$", text[max(0, a - 200) : a]):  # "python -m " "project fit"
                        new = self._leading.sub(lambda m: m.group(1) + self.new, new)
                    if new.strip("'\"") == self.old and self._names_module(before, after):
                        new = new.replace(self.old, self.new)
                if new != text[a:b]:
                    edits.append((a, b, new))
            elif tok.type == tokenize.NEWLINE or tok.string == ";":
                binds, stmt, pending, at_start = binds or pending, None, False, True
            elif tok.type == tokenize.NAME:
                if at_start and tok.string in ("import", "from"):
                    stmt, expect = tok.string, True
                elif stmt == "from" and tok.string == "import":
                    stmt = "names"
                elif stmt in ("import", "from") and expect:
                    if tok.string == self.old and prev != ".":
                        edits.append((a, b, self.new))
                        pending = stmt == "import"
                    expect = False
                elif stmt == "import" and tok.string == "as":
                    pending = False
                elif tok.string == self.old and prev != "." and stmt is None and not (depth and after[:1] == ["="]):
                    names.append((a, b, self.new))  # not f(project=...): a keyword, not the package
            elif stmt == "import" and tok.string == ",":
                binds, pending, expect = binds or pending, False, True
            elif tok.type == tokenize.OP and tok.string in ("(", "[", "{", ")", "]", "}"):
                depth += 1 if tok.string in "([{" else -1
            if tok.type not in (tokenize.NL, tokenize.COMMENT, tokenize.INDENT, tokenize.DEDENT, tokenize.NEWLINE):
                at_start, prev = tok.string == ";", tok.string
        for a, b, new in sorted(edits + (names if binds else []), reverse=True):
            text = text[:a] + new + text[b:]
        return text

    @staticmethod
    def _names_module(before: list[str], after: list[str]) -> bool:
        """Whether a string that reads exactly the package's name stands for it: ``"-m", "project"``, a path
        ``root / "project"``, ``import_module("project")``. A dict key or a value (``args["project"]``) does not."""
        prev = [*before, "", ""]
        if prev[0] == "," and prev[1] in ('"-m"', "'-m'"):
            return True
        if prev[0] == "/" or after[:1] == ["/"]:
            return True
        return prev[0] == "(" and prev[1] in ("import_module", "find_spec", "run_module", "__import__")

    def toml(self, text: str) -> str:
        """Values and console-script keys; table headers such as ``[project.scripts]`` never change."""
        out, table = [], ""
        for line in text.splitlines(keepends=True):
            header = re.match(r"\s*\[\[?\s*([^\]]+?)\s*\]", line)
            if header:
                table = header.group(1)
                out.append(line)
                continue
            key = re.match(r"(\s*)([\w.\-\"']+)(\s*=)", line)
            head, rest = (line[: key.end()], line[key.end() :]) if key else ("", line)
            scripts = table in ("project.scripts", "project.gui-scripts") or table.startswith("project.entry-points")
            if key and scripts and key.group(2).strip("\"'") == self.old:
                head = key.group(1) + key.group(2).replace(self.old, self.new) + key.group(3)
            out.append(head + self._quoted.sub(self.new, self.refs(rest)))
        return "".join(out)

    def config(self, text: str) -> str:
        """YAML and INI: values (``class_path: project.x``, ``key: project``); YAML ``run:`` steps as shell."""
        out, shell_indent = [], None
        for line in text.splitlines(keepends=True):
            indent = len(line) - len(line.lstrip())
            if shell_indent is not None and (not line.strip() or indent > shell_indent):
                out.append(self.shell(line))
                continue
            shell_indent = None
            run = re.match(r"(\s*(?:-\s+)?run:\s*)(.*)", line, re.S)
            if run and run.group(2).strip() in ("|", ">", "|-", ">-", "|+", ">+"):
                shell_indent = indent
            elif run:
                line = run.group(1) + self.shell(run.group(2))
            if not re.match(r"\s*\[[^\]]*\]\s*$", line):  # INI section headers stay
                code, comment = _split_comment(line)
                line = self._scalar.sub(lambda m: m.group(1) + self.new, self.refs(code)) + self.refs(comment)
            out.append(line)
        return "".join(out)

    def markdown(self, text: str) -> str:
        """Prose gets the references that can sit in prose; fenced code blocks are renamed by their language."""
        out, block, fence, lang = [], [], None, ""
        for line in text.splitlines(keepends=True):
            opening = re.match(r"\s*(```+|~~~+)\s*([\w+-]*)", line)
            if fence is None and opening:
                fence, lang = opening.group(1), opening.group(2).lower()
                out.append(line)
            elif fence is not None and line.strip().startswith(fence):
                code = "".join(block)
                if lang in ("python", "py", "toml", "yaml", "yml", "ini"):
                    code = {"python": self.python, "py": self.python, "toml": self.toml}.get(lang, self.config)(code)
                else:
                    code = "".join(self.shell(code_line) for code_line in block)
                out += [code, line]
                block, fence = [], None
            elif fence is not None:
                block.append(line)
            else:
                out.append(self.refs(line))
        return "".join(out + block)

    def file(self, rel: Path, text: str) -> str:
        suffix, first = rel.suffix.lower(), text.split("\n", 1)[0]
        if suffix in (".py", ".pyi") or re.match(r"#!.*python", first):
            return self.python(text)
        if suffix == ".toml":
            return self.toml(text)
        if suffix in (".yaml", ".yml", ".ini", ".cfg") or rel.name in (".flake8", ".coveragerc"):
            return self.config(text)
        if suffix == ".md":
            return self.markdown(text)
        if suffix in (".sh", ".bash", ".mk") or rel.name in ("Makefile", "GNUmakefile", "Dockerfile", "Containerfile"):
            return "".join(self.shell(line) for line in text.splitlines(keepends=True))
        if re.match(r"#!.*\b(ba|z|da)?sh\b", first):
            return "".join(self.shell(line) for line in text.splitlines(keepends=True))
        return self._quoted.sub(self.new, self.refs(text)) if suffix == ".json" else self.refs(text)


def _split_comment(line: str) -> tuple[str, str]:
    found = re.search(r"(?:^|(?<=\s))#", line)
    return (line[: found.start()], line[found.start() :]) if found else (line, "")


def _left_out(rel: Path, patterns: Sequence[str] = ()) -> bool:
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
            dirs[:] = [d for d in dirs if not _left_out(rel / d / "-", patterns)]  # a child: the folder's own rules
            paths += [rel / n for n in names]
    return sorted(p for p in paths if ((ROOT / p).is_file() or (ROOT / p).is_symlink()) and not _left_out(p, patterns))


def _is_git_top(path: Path) -> bool:
    top = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=path, capture_output=True, text=True)
    return top.returncode == 0 and Path(top.stdout.strip()).resolve() == path.resolve()


def check_name(name: str, top_level: set[str]) -> None:
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


def drop_example(texts: dict[Path, str], skeleton: Path = SKELETON) -> dict[str, str]:
    """Merges ``skeleton`` into ``texts``; returns ``{example class: skeleton class}`` to rename."""
    skeletons = sorted(p for p in skeleton.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    renames: dict[str, str] = {}
    for path in skeletons:
        rel = path.relative_to(skeleton)
        if rel.parts[0] == PACKAGE and rel.suffix == ".py":
            if rel not in texts:
                raise RuntimeError(f"--no-example: the template has no {rel} for {path} to go into")
            module = ".".join(rel.with_suffix("").parts)
            texts[rel], removed, added = _swap_datamodule(texts[rel], path.read_text(), module)
            renames.update(dict.fromkeys(removed, added))
    # Tests that mention the example go; so does any other module outside the package that uses its classes.
    uses = re.compile(rf"\b({'|'.join(map(re.escape, renames))})\b")
    mentions = re.compile(f"{uses.pattern}|{re.escape(EXAMPLE_WORD)}", re.I)
    for rel in [r for r in texts if r.suffix == ".py" and r.parts[0] != PACKAGE and r.name != "conftest.py"]:
        if (mentions if rel.name.startswith("test_") else uses).search(texts[rel]):
            del texts[rel]
    for path in skeletons:
        rel = path.relative_to(skeleton)
        if rel.parts[0] != PACKAGE:
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


def _git(cwd: Path, *args: str, env: dict[str, str] | None = None, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-c", "commit.gpgsign=false", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, check=check)  # fmt: skip


def template_state() -> tuple[str | None, list[str]]:
    """The template's HEAD commit (None outside git) and the files a copy takes that differ from it."""
    if shutil.which("git") is None or not _is_git_top(ROOT):
        return None, []
    head = _git(ROOT, "rev-parse", "--verify", "-q", "HEAD^{commit}", check=False).stdout.strip()
    if not head:  # a repository without commits
        return None, []
    changed = _git(ROOT, "diff", "--name-only", "-z", "HEAD").stdout
    changed += _git(ROOT, "ls-files", "-z", "--others", "--exclude-standard").stdout
    return head, sorted({p for p in changed.split("\0") if p and not _left_out(Path(p))})


def _files(n: int) -> str:
    return f"{n} file{'s' * (n != 1)}"


def make_record(commit: str | None, uncommitted: list[str], name: str, example: bool, author: str | None,
                description: str | None) -> str:  # fmt: skip
    """``uncommitted``: template files the copy took as they were on disk, not as in ``commit``."""
    fields = {"template_commit": commit, "uncommitted": uncommitted, "name": name, "example": example,
              "author": author, "description": description}  # fmt: skip
    return json.dumps(fields, indent=2, ensure_ascii=False) + "\n"


def render(root: Path, files: list[Path], out: Path, name: str, example: bool = True,
           author: dict[str, str] | None = None, description: str | None = None) -> None:  # fmt: skip
    """Writes the copy of the template at ``root`` (its ``files``) to the empty folder ``out``, renamed to ``name``."""
    texts: dict[Path, str] = {}
    raw: dict[Path, Path] = {}  # binary files and links travel as they are
    for rel in files:
        data = b"\0" if (root / rel).is_symlink() else (root / rel).read_bytes()
        try:
            if b"\0" in data:
                raise UnicodeDecodeError("utf-8", data, 0, 1, "binary")
            texts[rel] = drop_template_only(data.decode("utf-8"))
        except UnicodeDecodeError:
            raw[rel] = root / rel
    renames = {} if example else drop_example(texts, root / SKELETON.relative_to(ROOT))
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


def generate(dest: Path, name: str, example: bool = True, author: str | None = None,
             description: str | None = None, git: bool = True) -> tuple[Path, str]:  # fmt: skip
    """Writes the new project to ``dest``, all or nothing; returns its path and what git did."""
    files = template_files()
    if not any(p.parts[0] == PACKAGE and p.name == "__init__.py" for p in files):
        raise RuntimeError(f"the template has no package {PACKAGE}/ at {ROOT}")
    check_name(name, {p.parts[0] for p in files if len(p.parts) > 1})
    dest, author_fields = check_dest(Path(dest)), parse_author(author)
    parent = next(p for p in dest.parents if p.is_dir())
    staging = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=parent))
    try:
        render(ROOT, files, staging, name, example, author_fields, description)
        commit, uncommitted = template_state()
        (staging / RECORD).write_text(make_record(commit, uncommitted, name, example, author, description))
        note = init_git(staging, author_fields, name) if git else "no git (--no-git)"
        if commit is None:
            note += f"; the template is not a git checkout, so {RECORD} names no commit and --update can't run"
        elif uncommitted:
            note += (f"; the template had uncommitted changes in {_files(len(uncommitted))} ({RECORD} lists them): "
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


def _copy_as_tree(dest: Path, rev: str, answers: dict, record: str, tmp: Path) -> str:
    """The copy the template at ``rev`` gives with ``answers``, stored as a tree in DEST's repository; its id."""
    src, out, index = tmp / f"{rev}-template", tmp / f"{rev}-copy", tmp / f"{rev}.index"
    env = {**os.environ, "GIT_INDEX_FILE": str(index)}
    _git(ROOT, "read-tree", rev, env=env)
    _git(ROOT, "checkout-index", "-a", f"--prefix={src}/", env=env)
    listed = _git(ROOT, "ls-files", "-z", env=env).stdout.split("\0")
    files = sorted(Path(p) for p in listed if p and not _left_out(Path(p)))
    author = parse_author(answers.get("author"))
    render(src, files, out, answers["name"], answers.get("example", True), author, answers.get("description"))
    (out / RECORD).write_text(record)
    index.unlink()
    _git(dest, "--work-tree", str(out), "add", "-A", "-f", env=env)  # -f: the copy's .gitignore keeps nothing out
    return _git(dest, "write-tree", env=env).stdout.strip()


def check_update(dest: Path) -> tuple[dict, str, str]:
    """DEST's record, its text and the template's HEAD, or a UsageError saying what stands in the way."""
    if not dest.is_dir() or shutil.which("git") is None or not _is_git_top(dest):
        raise UsageError(f"DEST {dest} is not the root of a git repository; --update merges on a new branch there: "
                         f"run it on the copy's own folder, or git init and commit the copy first")  # fmt: skip
    if _git(dest, "rev-parse", "--verify", "-q", "HEAD", check=False).returncode:
        raise UsageError(f"DEST {dest} has no commits yet; commit the copy first")
    if _git(dest, "status", "--porcelain").stdout:
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
    if _git(ROOT, "cat-file", "-e", f"{old}^{{commit}}", check=False).returncode:
        raise UsageError(f"the template commit {old} that DEST came from is not in {ROOT}; git fetch it there, or "
                         f"run --update from a clone that has it")  # fmt: skip
    if old != head and _git(ROOT, "merge-base", "--is-ancestor", old, head, check=False).returncode:
        raise UsageError(f"the template's HEAD {head[:12]} does not contain {old[:12]}, the commit DEST came from; "
                         f"check out a newer template commit")  # fmt: skip
    branch = f"template-update-{head[:7]}"
    if _git(dest, "rev-parse", "--verify", "-q", f"refs/heads/{branch}", check=False).returncode == 0:
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
                             answers.get("description"))  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        base = _copy_as_tree(dest, old, answers, old_record, Path(tmp))
        theirs = _copy_as_tree(dest, head, answers, new_record, Path(tmp))
    start = _git(dest, "symbolic-ref", "-q", "--short", "HEAD", check=False).stdout.strip()
    start = start or _git(dest, "rev-parse", "HEAD").stdout.strip()
    branch = f"template-update-{head[:7]}"
    _git(dest, "checkout", "-q", "-b", branch)
    labels = {f"GITHEAD_{base}": f"template {old[:7]}", f"GITHEAD_{theirs}": f"template {head[:7]}"}  # in markers
    merged = _git(dest, "merge-recursive", base, "--", "HEAD", theirs, env={**os.environ, **labels}, check=False)
    conflicts = sorted(p for p in _git(dest, "diff", "--name-only", "-z", "--diff-filter=U").stdout.split("\0") if p)
    if merged.returncode and not conflicts:  # git refused before merging, e.g. an ignored file in the way
        _git(dest, "reset", "-q", "--hard")
        _git(dest, "checkout", "-q", start)
        _git(dest, "branch", "-q", "-D", branch)
        raise RuntimeError(f"git merge-recursive failed in {dest}: {(merged.stderr or merged.stdout).strip()}")
    log = _git(ROOT, "log", "--oneline", "--no-decorate", f"{old}..{head}").stdout
    message = f"Template update {old[:7]}..{head[:7]}\n\n{log}"
    if conflicts:
        squash_msg = _git(dest, "rev-parse", "--git-path", "SQUASH_MSG").stdout.strip()
        (dest / squash_msg).write_text(message)  # git commit offers it
        return (f"Merged template {old[:7]}..{head[:7]} into {dest} on branch {branch}, with conflicts in "
                f"{_files(len(conflicts))}:\n" + "".join(f"  {p}\n" for p in conflicts) +
                "Resolve the <<<<<<< markers, git add the files and git commit; or give up with git reset --hard "
                f"&& git switch {start} && git branch -D {branch}."), conflicts  # fmt: skip
    changes = _git(dest, "diff", "--cached", "--name-status", "HEAD").stdout.splitlines()
    counts = {k: sum(line[0] == k for line in changes) for k in "MAD"}
    committed = _git(dest, "commit", "-q", "--no-verify", "-m", message, check=False)
    done = "committed" if committed.returncode == 0 else f"staged, not committed ({committed.stderr.strip()})"
    return (f"Merged template {old[:7]}..{head[:7]} into {dest} on branch {branch}, {done}: {_files(counts['M'])} "
            f"changed, {counts['A']} added, {counts['D']} removed, no conflicts.\n"
            f"Next: make test there, then git switch {start} && git merge {branch}."), []  # fmt: skip


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
