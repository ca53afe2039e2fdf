"""How bad input is reported: one ``error:`` line that names the problem and the fix, not a traceback wall.

Exit code 2 when the problem is found before anything is written (arguments, config files, checkpoints, devices,
the output folder: the CLI calls jsonargparse's ``parser.error``), exit code 1 when it shows up during the run
(data too small for a batch, a full disk). ``JSONARGPARSE_DEBUG=true``, jsonargparse's own switch, brings the
tracebacks back (jsonargparse reads only ``true`` or ``false``: ``=1`` is itself an error).
"""

import enum
import itertools
import os
import re
import sys
import sysconfig
import traceback
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NoReturn

import jsonargparse
import yaml
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.cli import ArgsType, LightningArgumentParser, LightningCLI
from lightning.pytorch.utilities import rank_zero_only

from lightkeep.checkpoint_io import CheckpointWriteError
from lightkeep.compat import LightningChanged
from lightkeep.config import entry
from lightkeep.rank_failures import resume_command

# What bad input raises once a run has started; anything else is a bug and keeps its traceback.
# LightningChanged: a private API that moved (lightkeep.compat) stops the run in one line, too
RUN_ERRORS = (ValueError, OSError, MisconfigurationException, LightningChanged)
_NOT_USER_CODE = (sysconfig.get_paths()["stdlib"], os.path.dirname(jsonargparse.__file__), "<")
DEBUG = "JSONARGPARSE_DEBUG=true"  # what each line suggests; jsonargparse 4.52 and 4.53 raise on JSONARGPARSE_DEBUG=1


def debug_requested() -> bool:
    """``JSONARGPARSE_DEBUG`` read as jsonargparse reads it."""
    return os.environ.get("JSONARGPARSE_DEBUG", "").lower() == "true"


def check_yaml_files(parser: LightningArgumentParser, args: ArgsType) -> None:
    """Each ``--config`` file must be UTF-8 YAML that maps keys to values, each key once. jsonargparse names
    neither the file nor the line of one that is not valid YAML, says ``Unexpected config:`` and the content for
    an empty one or a list, ends a non-UTF-8 one in a codec traceback, and takes a key given twice silently, the
    last one winning: which one the user meant is unknown, so it is refused."""
    if not isinstance(args, list | tuple):
        return
    pairs = [*itertools.pairwise(args), *(a.split("=", 1) for a in args if a.startswith("--config="))]
    for flag, value in pairs:
        if flag in ("-c", "--config") and os.path.isfile(value):
            problem = _yaml_problem(Path(value).read_bytes())
            if problem:
                parser.error(f"--config {value} {problem}")


def _yaml_problem(raw: bytes) -> str | None:
    try:
        text = raw.decode()
    except UnicodeDecodeError as error:
        line = raw[: error.start].count(b"\n") + 1
        return f"is not UTF-8 text (byte {raw[error.start]:#x} on line {line}). Save it as UTF-8."
    try:
        content = yaml.safe_load(text)
        twice = _key_twice(yaml.compose(text, Loader=yaml.SafeLoader))
    except yaml.YAMLError as error:
        return f"is not valid YAML: {' '.join(str(error).split())}. Fix the file."
    if content is None:
        return "is empty: give it the keys to set (e.g. trainer: {max_epochs: 3}), or leave it out."
    if not isinstance(content, dict):
        return (
            f"holds a {type(content).__name__}, not keys: a config maps keys to values (e.g. trainer: {{max_epochs: "
            "3}). Fix the file."
        )
    if twice:
        key, first, second = twice
        lines = f"lines {first} and {second}" if first != second else f"both on line {first}"
        return f"sets {key} twice ({lines}): which one is meant is unclear. Keep one."
    return None


def _key_twice(root: yaml.Node | None) -> tuple[str, int, int] | None:
    """The first key that a mapping in the composed YAML holds twice: (its dotted path, the lines of both)."""
    seen: set[int] = set()  # an alias is the node it names: each is walked once, a recursive one too

    def walk(node: yaml.Node | None, path: str) -> tuple[str, int, int] | None:
        if node is None or id(node) in seen:
            return None
        seen.add(id(node))
        children: list[tuple[str, yaml.Node]] = []
        if isinstance(node, yaml.MappingNode):
            lines: dict[str, int] = {}
            for key, value in node.value:
                name = f"{path}.{key.value}" if path else str(key.value)
                if isinstance(key, yaml.ScalarNode):
                    if key.value in lines:
                        return name, lines[key.value], key.start_mark.line + 1
                    lines[key.value] = key.start_mark.line + 1
                children.append((name, value))
        elif isinstance(node, yaml.SequenceNode):
            children = [(f"{path}[{i}]", item) for i, item in enumerate(node.value)]
        return next((found for name, child in children if (found := walk(child, name))), None)

    return walk(root, "")


class OneLineParser(LightningArgumentParser):
    """LightningCLI's parser, each of its errors said in one line, with no usage line above it (``--help`` shows
    it): for a value inside a class (``--model.lr``, a ``class_path``) jsonargparse writes 10-15 lines of the union
    it tried, the cause deep inside and the file not named; here it is ``KEY in FILE: CAUSE (the fix)``."""

    given: Sequence[str] = ()  # what was parsed: where a bad value came from

    def parse_args(self, args: Sequence[str] | None = None, *rest: Any, **kwargs: Any) -> Any:
        self.given = [str(arg) for arg in (sys.argv[1:] if args is None else args)]
        return super().parse_args(args, *rest, **kwargs)

    def dump(self, cfg: Any, *args: Any, **kwargs: Any) -> str:
        # A str Enum default YAML cannot write (Lightning's Timer's, which stopped every command naming Timer) as its
        # value, the string the signature asks for; only one whose name is its value, so that one typed as its Enum
        # (written by name) gives the same string: docs/upstream.md, "Timer's interval default".
        return super().dump(_str_enums_as_values(cfg), *args, **kwargs)

    def error(self, message: str, ex: Exception | None = None) -> NoReturn:
        if not self.exit_on_error or debug_requested():
            super().error(message, ex)  # raises: to the parser of the class around this one, or as a traceback
        self.exit(2, f"error: {one_line(message, ex, self.given)}\n")


def _str_enums_as_values(value: Any) -> Any:
    if isinstance(value, jsonargparse.Namespace):
        return jsonargparse.Namespace(**{key: _str_enums_as_values(item) for key, item in vars(value).items()})
    if isinstance(value, (list, tuple)):
        return type(value)(_str_enums_as_values(item) for item in value)
    if isinstance(value, dict):
        return {key: _str_enums_as_values(item) for key, item in value.items()}
    if isinstance(value, enum.Enum) and isinstance(value, str) and value.name == value.value:
        return value.value
    return value


def one_line(message: str, error: BaseException | None, given: Sequence[str]) -> str:
    """jsonargparse's ``message`` in one line, read from the chain of exceptions under it: each level of a nested
    value raises ``Parser key "KEY"`` or ``Problem with given class_path 'CLASS'`` from the level below, down to
    the cause. A message of another shape (the engine's own, already one line) is kept, its lines joined."""
    subcommand = next((arg for arg in given if arg in LightningCLI.subcommands()), "fit")
    keys: list[str] = []
    owner: tuple[list[str], str] | None = None  # the innermost class named, and the keys that lead to it
    cause, above = error, ""
    while error is not None:
        text = str(error)
        if text != above:  # jsonargparse re-raises some levels unchanged
            if named := re.match(r'Parser key "([^"]+)"', text):
                keys += named[1].split(".")
            elif named := re.match(r"Problem with given class_path '([^']+)'", text):
                owner = (list(keys), named[1])
        cause, above, error = error, text, error.__cause__
    unknown = re.search(r"Option '([^']+)' is not accepted|does not accept option '([^']+)'", str(cause or message))
    if unknown:
        keys += (unknown[1] or unknown[2]).split(".")
    if not keys:
        return " ".join(message.split())
    help_command = f"{entry().command} {subcommand} " + (
        f"--{'.'.join(owner[0])}.help {owner[1]}" if owner else "--help"
    )
    bases = ("lightning.LightningModule", "lightning.LightningDataModule")
    if unknown and owner and owner[1] in bases and owner[0] in (["model"], ["data"]):
        # a config a LightningCLI of fixed classes printed (`LightningCLI(Net, Data)`): it names no class
        section = owner[0][0]
        return (
            f"{_where(keys, given, None)}: no {section} class is named for {keys[-1]!r}: give one before the config "
            f"(--{section} my.Class --config FILE) or in it ({section}: {{class_path: my.Class, init_args: ...}}), or "
            f"keep your own LightningCLI script with its LightningCLI imported from lightkeep"
        )
    if unknown:
        taker = f"{owner[1]} takes no argument {keys[-1]!r}" if owner else "no such option"
        return f"{_where(keys, given, None)}: {taker} ({help_command} lists them)"
    if expected := re.fullmatch(r"Expected a (.+?)\. Got value: (.*)", str(cause), re.DOTALL):
        where = _where(keys, given, expected[2])
        return f"{where}: expected {_short_types(expected[1])}, got {expected[2]!r} ({help_command} lists the types)"
    values = re.findall(r"^\s*Given value: (.*)$", message, re.MULTILINE)  # a union's
    value = values[-1] if values else None
    class_path = owner[1] if owner and owner[0] == keys else _class_path_in(value)
    where, raised_at = _where(keys, given, class_path or value), _in_user_code(cause)
    if class_path and raised_at:  # importing the class's module ran its code, which raised
        return (
            f"{where}: class_path {class_path}: importing it raised {type(cause).__name__}: {cause} "
            f"(at {raised_at}; {DEBUG} shows the traceback)"
        )
    if owner and (missing := re.match(r"the following arguments are required: (.+)", str(cause))):
        return (
            f"{where}: {owner[1]} needs {missing[1]} ({help_command} lists its arguments; one your own LightningCLI "
            "script links keeps that script, with its LightningCLI imported from lightkeep)"
        )
    if owner and owner[0] == keys:  # no line of the class's module ran: it is not there
        return f"{where}: class_path {class_path} cannot be imported: {cause}. Check the spelling and the Python path."
    return f"{where}: {' '.join(_short_types(str(cause)).split())}" + (f" (raised at {raised_at})" if raised_at else "")


def _class_path_in(value: str | None) -> str | None:
    """The class path in a union's given value: ``pkg.Class``, or ``{'class_path': 'pkg.Class', ...}`` (a class whose
    import raised other than ImportError: jsonargparse names no class then)."""
    if value and (named := re.search(r"'class_path': '([^']+)'", value)):
        return named[1]
    return value if value and re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+", value) else None


def _where(keys: list[str], given: Sequence[str], value: str | None) -> str:
    """``--FLAG``, or ``KEY in FILE``, that set ``keys`` to ``value``: the first to do so after the base config, as
    jsonargparse checks each file and flag in turn and stops at the first bad one. ``value=None`` (not known): the
    first file or flag given that sets the key, else the base config (which the tests parse)."""
    key = ".".join(keys)
    default = entry().base_config
    base = [(f"{key} in {_relative(str(default))}", _yaml(default))] if default else []
    sources = []
    for i, arg in enumerate(given):
        flag, _, text = arg.partition("=")
        text = text if "=" in arg else (given[i + 1] if i + 1 < len(given) else "")
        if flag in ("-c", "--config"):
            sources.append((f"{key} in {text}", _yaml(Path(text))))
        elif flag.startswith("--") and text != "null":  # null: what start_from_class_defaults puts before a class
            content = _yaml(text)
            for part in reversed([part for part in flag[2:].split(".") if part != "init_args"]):
                content = {part: content}
            sources.append((flag, content))
    ordered = [*base, *sources] if value is not None else [*sources, *base]
    for where, content in ordered:
        found = _value_at(content, keys)
        if found is not _ABSENT and (value is None or value in _leaves(found)):
            return where
    return f"--{key}"


_ABSENT = object()


def _value_at(content: Any, keys: list[str]) -> Any:
    """``content[k1][k2]...``, looking through a class's ``init_args`` and into each item of a list (of callbacks,
    say); ``_ABSENT`` where it sets no such key."""
    if not keys:
        return content
    if isinstance(content, list):
        return next((found for item in content if (found := _value_at(item, keys)) is not _ABSENT), _ABSENT)
    if isinstance(content, dict) and keys[0] not in content and isinstance(content.get("init_args"), dict):
        content = content["init_args"]
    return _value_at(content[keys[0]], keys[1:]) if isinstance(content, dict) and keys[0] in content else _ABSENT


def _leaves(value: Any) -> list[str]:
    if isinstance(value, dict | list):
        return [leaf for item in (value.values() if isinstance(value, dict) else value) for leaf in _leaves(item)]
    return [str(value)]


def _yaml(source: str | Path) -> Any:
    """A file's YAML (``None`` where it cannot be read), or a flag's value (as given where it is not YAML)."""
    try:
        return yaml.safe_load(source.read_text() if isinstance(source, Path) else source)
    except (OSError, ValueError, yaml.YAMLError):
        return None if isinstance(source, Path) else source


def _short_types(text: str) -> str:
    return re.sub(r"<class '(?:[\w.]+\.)?(\w+)'>", r"\1", text).replace("typing.", "")


def _relative(path: str) -> str:
    relative = os.path.relpath(path)
    return path if relative.startswith("..") else relative


def root_cause(error: BaseException) -> BaseException:
    """The constructor's own error under jsonargparse's wrapping (e.g. "lr (-0.1) must be > 0")."""
    while error.__cause__ is not None:
        error = error.__cause__
    return error


# Lightning's RuntimeErrors of a step that every rank raises alike, by a part of their message, with what to do
# (None: Lightning's message says it)
KNOWN_RUNTIME_ERRORS: dict[str, str | None] = {
    # EarlyStopping(strict=True) at the first epoch end where its monitor is not logged, naming what is
    "Early stopping conditioned on metric": None,
    # DDP's reducer finds parameters without a gradient in a step
    "parameters that were not used in producing the loss": (
        "DDP found parameters that took no part in a step's loss (a GAN's other network, a branch not taken, a "
        "layer not used): add --trainer.strategy ddp_find_unused_parameters_true, or make every parameter take part "
        "in each step's loss"
    ),
    # MixedPrecision.clip_gradients refuses any optimizer with a fused step, also under bf16, where nothing is scaled
    # (the check could be made for 16-mixed only, upstream: lightning/pytorch/plugins/precision/amp.py)
    "does not allow for gradient clipping because it performs unscaling": (
        "Lightning's mixed precision does not clip the gradients of a fused optimizer (fused=True, as in "
        "AdamW(..., fused=True)), under bf16 too: pass fused=False to the optimizer in configure_optimizers, or "
        "leave trainer.gradient_clip_val unset"
    ),
}


@contextmanager
def one_line_errors() -> Iterator[None]:
    """Turns a ``RUN_ERRORS`` exception into ``error: MESSAGE (raised at FILE:LINE ...)`` on rank 0 and exit code 1
    on every rank."""
    try:
        yield
    except RuntimeError as error:  # raised alike on every rank: said once, by rank 0, exit code 1 on each
        said = [fix or " ".join(str(error).split()) for part, fix in KNOWN_RUNTIME_ERRORS.items() if part in str(error)]
        if debug_requested() or not said:
            raise
        if rank_zero_only.rank != 0:
            sys.exit(1)
        sys.exit(f"error: {said[0]} ({DEBUG} shows the traceback)")
    except RUN_ERRORS as error:
        if debug_requested():
            raise
        message = error.strerror if isinstance(error, OSError) and error.strerror else str(error)
        if isinstance(error, OSError) and error.filename:
            message += f": {error.filename}"
        if rank_zero_only.rank != 0:
            # Raised alike on every rank, it is said once, by rank 0. An error of this rank alone is named by rank
            # 0's report of a failed rank (lightkeep.rank_failures) from the note this rank left.
            sys.exit(1)
        if isinstance(error, CheckpointWriteError):  # a full disk, not a place in the code: the command to resume
            sys.exit(f"error: {message}: {resume_command(sys.argv)}")
        sys.exit(f"error: {message} (raised at {_raised_at(error)}; {DEBUG} shows the traceback)")


def _raised_at(error: BaseException) -> str:
    # where to look, without the traceback of the whole stack
    frames = traceback.extract_tb(error.__traceback__)
    return _in_user_code(error) or (f"{_relative(frames[-1].filename)}:{frames[-1].lineno}" if frames else "?")


def _in_user_code(error: BaseException | None) -> str | None:
    """``FILE:LINE``, the innermost line outside Python's own modules, installed packages and jsonargparse that
    raised ``error``; ``None`` where no line of the user's code ran."""
    if isinstance(error, SyntaxError) and error.filename:
        return f"{_relative(error.filename)}:{error.lineno}"
    frames = reversed(traceback.extract_tb(error.__traceback__)) if error is not None else iter(())
    user = (f for f in frames if not f.filename.startswith(_NOT_USER_CODE) and "site-packages" not in f.filename)
    frame = next(user, None)
    return f"{_relative(frame.filename)}:{frame.lineno}" if frame else None
