"""The command line: ``python -m project fit|validate|test|predict``, a LightningCLI and nothing more."""

from pathlib import Path
from typing import Any

from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ProgressBar
from lightning.pytorch.cli import ArgsType, LightningArgumentParser, LightningCLI

from project.callbacks import (
    DestroyProcessGroup,
    ExactResume,
    LossProgressBar,
    Preemption,
    SaveConfigOnce,
    StopOnNonFinite,
)
from project.runs import ResumeError, resolve_resume

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "default.yaml"
SUBCOMMANDS = ("fit", "validate", "test", "predict")


class CLI(LightningCLI):
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.link_arguments("data.num_classes", "model.init_args.num_classes", apply_on="instantiate")

    def parse_arguments(self, parser: LightningArgumentParser, args: ArgsType) -> None:
        super().parse_arguments(parser, args)
        subcommand = self.config.get("subcommand")
        if subcommand:
            try:
                resolve_resume(self.config[subcommand], continue_run=subcommand == "fit")
            except ResumeError as error:
                parser.error(str(error))  # a one-paragraph message and exit code 2, not a traceback

    def instantiate_classes(self) -> None:
        try:
            super().instantiate_classes()
        except ValueError as error:  # e.g. "lr (-0.1) must be > 0" from a constructor, under jsonargparse's wrapping
            while error.__cause__ is not None:
                error = error.__cause__
            self.parser.error(str(error))

    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        # LossProgressBar in place of Lightning's default bar; not in the config's callback list, because there
        # it would make `--trainer.enable_progress_bar false` an error. A bar the config brings wins.
        config = {**self._get(self.config_init, "trainer", default={}), **kwargs}
        callbacks = config.get("callbacks") or []
        callbacks = callbacks if isinstance(callbacks, list) else [callbacks]
        if config.get("enable_progress_bar") is not False and not any(isinstance(c, ProgressBar) for c in callbacks):
            kwargs["callbacks"] = [*callbacks, LossProgressBar()]
        return super().instantiate_trainer(**kwargs)


def cli_main(args: ArgsType = None) -> CLI:
    # Subclass mode (no model/data class given): any LightningModule, DataModule or net is one class_path away.
    defaults = [str(DEFAULT_CONFIG)] if DEFAULT_CONFIG.is_file() else []
    return CLI(
        save_config_callback=SaveConfigOnce,
        # Always on, whatever callbacks a config lists: without them a resume is not exact / a preempted run
        # looks finished.
        trainer_defaults={"callbacks": [ExactResume(), Preemption(), StopOnNonFinite(), DestroyProcessGroup()]},
        parser_kwargs={sub: {"default_config_files": defaults} for sub in SUBCOMMANDS},
        args=args,
    )
