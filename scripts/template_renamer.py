"""How a copy renames the package: ``Renamer`` rewrites references to ``project`` as the new name, file type by
file type (Python by its tokens, TOML, YAML/INI, Markdown with its fenced code, shell), and nothing else: the word
in prose, strings and keywords that only read "project" (W&B's ``args["project"]``), ``pyproject.toml`` and TOML
tables such as ``[project.scripts]`` stay. Used by scripts/new_project.py; only the standard library.
"""

import io
import re
import tokenize
from pathlib import Path

# fmt: off
# Keys of pyproject's [project] table: ``project.scripts`` there is a table, not a module of the package.
PEP621_KEYS = {"name", "version", "description", "readme", "requires-python", "license", "license-files", "authors",
               "maintainers", "keywords", "classifiers", "urls", "scripts", "gui-scripts", "entry-points",
               "dependencies", "optional-dependencies", "dynamic", "import-names", "import-namespaces"}
# fmt: on


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
