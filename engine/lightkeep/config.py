"""Where the base config is found, and the run's config file, saved once per invocation without ever overwriting
the one a run began with."""

import contextlib
import os
import shlex
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import yaml
from lightning.pytorch.cli import SaveConfigCallback


@dataclass(frozen=True)
class Entry:
    """What the user runs: ``python -m <program>``, or ``python <program>`` for a script (a ``.py`` file: an existing
    project's own ``main.py`` with ``lightkeep.LightningCLI``), and the base config it reads first (a project's
    ``configs/default.yaml``; none for ``python -m lightkeep``). ``cli_main`` or the CLI's constructor sets it for the
    invocation; the commands the engine prints (a resume, ``--help``) and a sweep's trials use it."""

    program: str = "lightkeep"
    base_config: Path | None = None
    looked: tuple[Path, ...] = ()  # where a base config was looked for, when none was found

    @property
    def launch(self) -> list[str]:
        """The interpreter's arguments that run the program: ``["-m", program]``, or ``[script]``."""
        return [self.program] if self.program.endswith(".py") else ["-m", self.program]

    @property
    def command(self) -> str:
        return shlex.join(["python", *self.launch])


_DEFAULT = _entry = Entry()


def entry() -> Entry:
    return _entry


def invoked() -> str:
    """The program this process runs, as ``Entry.program``: ``python -m pkg`` gives ``pkg``, ``python main.py``
    gives ``main.py``."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is not None and spec.name:
        return spec.name.removesuffix(".__main__")
    return sys.argv[0] if sys.argv and sys.argv[0].endswith(".py") else _entry.program


def entered_here() -> contextlib.AbstractContextManager[Entry]:
    """This invocation's program and no base config, unless ``cli_main`` entered them already (a LightningCLI
    constructed by the user's own script enters here)."""
    return contextlib.nullcontext(_entry) if _entry is not _DEFAULT else entered(invoked(), None)


@contextlib.contextmanager
def entered(program: str, base_config: Path | str | Sequence[Path | str] | None) -> Iterator[Entry]:
    """``program`` with the first of ``base_config``'s candidates that is a file, for the invocation only."""
    global _entry
    candidates = [] if base_config is None else [base_config] if isinstance(base_config, str | Path) else base_config
    candidates = list(dict.fromkeys(Path(c).resolve() for c in candidates))
    found = next((path for path in candidates if path.is_file()), None)
    before, _entry = _entry, Entry(program, found, () if found else tuple(candidates))
    try:
        yield _entry
    finally:
        _entry = before


def base_monitor() -> str | None:
    """``run.monitor`` of the base config (a project's ``configs/default.yaml``), ``None`` without one."""
    path = _entry.base_config
    if path is None:
        return None
    with open(path) as f:
        config = yaml.safe_load(f) or {}
    run = config.get("run") if isinstance(config, dict) else None
    return run.get("monitor") if isinstance(run, dict) else None


class SaveConfigOnce(SaveConfigCallback):
    """Saves the run's config as ``<run>/config.yaml``; a resumed run adds ``config.1.yaml``, ``config.2.yaml``, ...

    Lightning's callback writes into the first logger's folder (MLflow's store, or nowhere without a logger) and
    refuses to start when ``config.yaml`` exists, which a resumed run always meets; overwriting it would lose how
    the run began. Here it goes into the run folder (``trainer.default_root_dir``, which the CLI sets to it). Only
    rank 0 looks at the folder; the choice is broadcast.
    """

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self.already_saved:
            return
        if self.save_to_log_dir:
            run_dir = trainer.strategy.broadcast(trainer.default_root_dir)
            if trainer.is_global_zero:
                path, n = os.path.join(run_dir, "config.yaml"), 0
                while os.path.exists(path):
                    n += 1
                    path = os.path.join(run_dir, f"config.{n}.yaml")
                os.makedirs(run_dir, exist_ok=True)
                # validated when parsed: checking it again would cost 0.03 s of every start
                self.parser.save(self.config, path, skip_none=False, skip_validation=True, multifile=self.multifile)
        if trainer.is_global_zero:
            self.save_config(trainer, pl_module, stage)
            self.already_saved = True
        self.already_saved = trainer.strategy.broadcast(self.already_saved)


SWITCHABLE = ("--model", "--data")


def start_from_class_defaults(args: list[str], switchable: Sequence[str] = SWITCHABLE) -> list[str]:
    """``--model my.Model`` / ``--data my.Data``, or a ``--config`` file naming a model or data class: that class
    with its own defaults. ``switchable``: the flags of the classes in subclass mode (a script's fixed class cannot
    be null, and its ``--data data.yaml`` is its arguments, as in plain Lightning).

    jsonargparse keeps, by design, the arguments of the class it replaces that the new class accepts, defaults
    included: ``--model my.Model`` would inherit the example's ``lr``. A ``--model null`` put before it leaves
    nothing to inherit; the arguments given after it (``--model.lr 0.1``) still apply.
    """
    out: list[str] = []
    for i, arg in enumerate(args):
        flag, _, value = arg.partition("=")
        value = value if "=" in arg else (args[i + 1] if i + 1 < len(args) else "")
        if flag in switchable and _is_class_path(value):
            switched = [flag]
        elif flag in ("-c", "--config"):
            switched = [named for named in _classes_named_in(value) if named in switchable]
        else:
            switched = []
        for key in switched:
            if out[-2:] != [key, "null"]:
                out += [key, "null"]
        out.append(arg)
    return out


def _classes_named_in(config: str) -> list[str]:
    """The switchable flags whose class a ``--config`` file names (``model: my.Model`` or ``model: {class_path:
    ...}``); none for a file that cannot be read here (the parser then says why)."""
    try:
        content = yaml.safe_load(Path(config).read_text())
    except (OSError, ValueError, yaml.YAMLError):
        return []
    if not isinstance(content, dict):
        return []
    named = []
    for flag in SWITCHABLE:
        value = content.get(flag[2:])
        if (isinstance(value, str) and _is_class_path(value)) or (isinstance(value, dict) and "class_path" in value):
            named.append(flag)
    return named


def _is_class_path(value: str) -> bool:
    if not value or value == "null" or value.startswith(("{", "-")) or "\n" in value:
        return False
    # a config file of the class's arguments (`--data data.yaml`), which jsonargparse reads as one
    return Path(value).suffix not in (".yaml", ".yml", ".json") and not Path(value).is_file()


def its_arguments(class_path: str, values: dict[str, Any]) -> dict[str, Any]:
    """The entries of ``values`` that ``class_path``'s ``__init__`` takes by name: of a checkpoint's
    ``hyper_parameters``, those that rebuild the saved module (``save_hyperparameters(ignore=...)`` and
    ``self.hparams`` additions are none of them)."""
    import importlib
    import inspect

    module_name, _, class_name = class_path.rpartition(".")
    takes = set(inspect.signature(getattr(importlib.import_module(module_name), class_name).__init__).parameters)
    return {k: v for k, v in values.items() if k in takes - {"self", "args", "kwargs"}}
