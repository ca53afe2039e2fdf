"""The engine's entry point, ``python -m lightkeep`` (or ``python -m <project>``, which passes its base config):
``fit|validate|test|predict`` go to the LightningCLI (``lightkeep.cli``), ``sweep`` to an Optuna study of fit runs
(``lightkeep.sweep.study``, which parses its trials' fit config with that CLI), ``compare`` to a comparison of two
checkpoint files (``lightkeep.compare``). Here, above them, so none imports another back."""

import sys
from collections.abc import Sequence
from pathlib import Path

from lightning.pytorch.cli import ArgsType

from lightkeep.cli import CLI
from lightkeep.config import entered, entry


def cli_main(
    args: ArgsType = None,
    run: bool = True,
    base_config: Path | str | Sequence[Path | str] | None = None,
    program: str | None = None,
) -> CLI | None:
    """``python -m lightkeep fit|validate|test|predict ...``, ``sweep ...`` (``lightkeep.sweep.study``) or
    ``compare A.ckpt B.ckpt`` (``lightkeep.compare``, which exits with its verdict: 0 equal, 1 differ, 2 unreadable).

    ``base_config``: the config read before any other (the first of these paths that is a file), e.g. a project's
    ``configs/default.yaml``; ``program``: what the user runs (``python -m <program>``), in the commands the engine
    prints and for a sweep's trials; both default to those of the invocation this one runs in, else ``lightkeep``
    without a base config. ``run=False``: parse and instantiate ``args`` (no subcommand) and run nothing.
    """
    outer = entry()
    with entered(program or outer.program, outer.base_config if base_config is None else base_config):
        argv = sys.argv[1:] if args is None else args
        tool = argv[0] if run and isinstance(argv, list | tuple) and argv else None
        if tool == "sweep":
            from lightkeep.sweep.study import sweep_main  # optuna, from the sweep extra, only when sweeping

            sweep_main(list(argv[1:]))
            return None
        if tool == "compare":
            from lightkeep.compare import compare_main  # a tool on files: no CLI, model or data is built

            raise SystemExit(compare_main(list(argv[1:])))
        return CLI(args=args, run=run)  # subclass mode: any LightningModule, DataModule or net by class_path
