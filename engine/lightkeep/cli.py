"""The command line: ``python -m lightkeep fit|validate|test|predict``, a LightningCLI that plans the run folder
(``lightkeep.runs``) before anything is built; bad input ends in one ``error:`` line
(``lightkeep.errors``)."""

import sys
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch import LightningDataModule, LightningModule, Trainer
from lightning.pytorch.callbacks import (
    LearningRateMonitor,
    ModelCheckpoint,
    ProgressBar,
    SpikeDetection,
    TQDMProgressBar,
)
from lightning.pytorch.cli import ArgsType, LightningArgumentParser, LightningCLI
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_only

from lightkeep.checkpoint_files import check_fits
from lightkeep.checkpoint_policy import CheckpointPolicy
from lightkeep.compat import (
    ParsesPlainLightningCheckpoints,
    class_args_callback_keys,
    cli_section,
    spike_detection_loads_its_state,
)
from lightkeep.config import SaveConfigOnce, base_monitor, entered_here, entry, start_from_class_defaults
from lightkeep.distributed import DestroyProcessGroup
from lightkeep.elastic import GlobalBatch
from lightkeep.errors import OneLineParser, check_yaml_files, one_line_errors, root_cause
from lightkeep.guarantees import Guarantees
from lightkeep.guards import StopOnNonFinite
from lightkeep.hang_watchdog import HangWatchdog
from lightkeep.judge import CheckMonitored, Judging, ReadsJudge, run_monitor_callbacks, test_best
from lightkeep.liveness import Liveness
from lightkeep.loggers import let_appended_loggers_parse
from lightkeep.module_hooks import ModuleHooksBeforeSaves
from lightkeep.monitored_values import MonitoredValues
from lightkeep.one_file_per_point import OneFilePerPoint
from lightkeep.predictions import PredictionWriter
from lightkeep.rank_failures import RankFailures
from lightkeep.resume import ExactResume
from lightkeep.run_folder import FolderBefore, RunFolder, clean_up_failed_start, remove_if_empty
from lightkeep.run_loggers import LoggerFolder, default_logger, keep_csv_history, point_loggers_at
from lightkeep.run_scope import for_the_run, freeze_what_was_built
from lightkeep.runs import RunPlan, Runs, plan_run
from lightkeep.schedule import FitScheduleToRun
from lightkeep.sharded.folders import check_same_network
from lightkeep.sharded.strategy import ShardedStrategy as Sharded
from lightkeep.signals import Preemption
from lightkeep.speed.profiler import NoProfiler
from lightkeep.speed.switches import MatmulPrecision, Speed, SpeedSwitch
from lightkeep.stream_resume import StreamResume
from lightkeep.trainable import Trainable
from lightkeep.tuners import TunersOnceARun
from lightkeep.user_loaders import UserLoaders

SUBCOMMANDS = ("fit", "validate", "test", "predict")


class CLI(ParsesPlainLightningCheckpoints, LightningCLI):
    run_plan: RunPlan | None = None
    run_folder: RunFolder | None = None
    folder_before: FolderBefore | None = None  # a continued run's folder as found, for a failed start to restore
    unknown_loggers: list[str] = []
    asked: tuple[str | None, list[str]] = (None, [])  # the ckpt_path and arguments given, which _plan reads
    judge: ModelCheckpoint | None = None  # the run's checkpoint with a monitor (lightkeep.judge.judge_of)

    def __init__(
        self,
        model_class: type[LightningModule] | None = None,
        datamodule_class: type[LightningDataModule] | None = None,
        *,
        args: ArgsType = None,
        run: bool = True,
        trainer_defaults: dict[str, Any] | None = None,
        parser_kwargs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        """Lightning's ``LightningCLI`` with every guarantee of the engine: a project's own script keeps its
        subclass (``add_arguments_to_parser`` and its links, fixed classes, its arguments) and imports this class in
        place of Lightning's. ``trainer_defaults``' callbacks join the config's list where the engine reads it (a
        progress bar or ModelCheckpoint of them counts as the config's), and its ``logger`` replaces the engine's
        default; ``parser_kwargs`` go where Lightning puts them (flat: the main parser; per subcommand: its own)."""
        argv = sys.argv[1:] if args is None else args
        given = argv[0] if isinstance(argv, list | tuple) and argv else None
        self.only = given if run and given in SUBCOMMANDS else None
        defaults = dict(trainer_defaults or {})
        own = defaults.get("callbacks") or []
        self.default_callbacks = [*own] if isinstance(own, list) else [own]  # read with the config's list
        # Always on, whatever callbacks a config lists: without them a resume is not exact / a preempted run looks
        # finished / predict writes nothing / the saves of one validation are written once each. (A dead or hung
        # rank's report comes from instantiate_trainer.) The module's batch-end and validation-end hooks run before
        # the callbacks that save there rather than after them, so the checkpoints saved there hold what they change.
        preemption = Preemption()
        defaults["callbacks"] = [
            *(preemption, StopOnNonFinite(), DestroyProcessGroup(), OneFilePerPoint(), PredictionWriter()),
            ModuleHooksBeforeSaves(saves_at_batch_end=preemption),
        ]
        kwargs.setdefault("save_config_callback", SaveConfigOnce)
        # each error in one line, without the usage line; the short usage atop --help, not all 60 options
        kwargs.setdefault("parser_class", OneLineParser)
        # signals, warning filters, gc, patches: as they were once the run returns or raises
        with entered_here(), for_the_run(), one_line_errors():
            parser_kwargs = self._engine_parser_kwargs(argv, run, parser_kwargs or {})
            try:
                super().__init__(model_class, datamodule_class, args=args, run=run, trainer_defaults=defaults,
                                 parser_kwargs=parser_kwargs, **kwargs)  # fmt: skip
                remove_if_empty(self.run_plan)  # a run that wrote nothing leaves no folder
            except BaseException:
                # a failed start leaves no empty folder, and nothing in the run it continued
                clean_up_failed_start(self.run_plan, self.run_folder, getattr(self, "trainer", None),
                                      self.folder_before)  # fmt: skip
                raise

    def _engine_parser_kwargs(self, argv: ArgsType, run: bool, given: dict[str, Any]) -> dict[str, Any]:
        """Each subcommand parser's keyword arguments: the base config (``cli_main``'s) read first and the short
        usage line, under what the caller gave (for all subcommands, or one)."""
        default, looked = entry().base_config, entry().looked
        if looked and isinstance(argv, list) and not {"-c", "--config", "-h", "--help"} & set(map(str, argv)):
            where = " or ".join(str(path) for path in looked)
            rank_zero_only(print)(f"note: no base config at {where}: only the --config files and flags given apply")
        ours = {"default_config_files": [str(default)] if default else [],
                "usage": "%(prog)s [-h] [-c CONFIG] [--KEY VALUE ...]"}  # fmt: skip
        main = {k: v for k, v in given.items() if k not in SUBCOMMANDS}  # Lightning's main parser's, as it reads them
        if not run:
            return {**ours, **main}
        built = [self.only] if self.only else SUBCOMMANDS
        return {**main, **{sub: {**ours, **given.get(sub, {})} for sub in built}}

    def subcommands(self) -> dict[str, set[str]]:  # type: ignore[override]
        # Only the parser of the subcommand given is built: each one is the Trainer's ~60 options plus the model's
        # and the data's, read from their signatures and docstrings (0.27 s a parse with all four, 0.15 s with
        # one). `python -m lightkeep --help` and a misspelt subcommand still build and list all four.
        every = LightningCLI.subcommands()
        return {self.only: every[self.only]} if self.only in every else every

    def add_core_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        # The engine's sections beside Lightning's core ones, not in add_arguments_to_parser: a project's own
        # subclass overrides that one (for its links) without calling up.
        super().add_core_arguments_to_parser(parser)
        parser.add_class_arguments(Runs, "run")
        parser.add_class_arguments(CheckpointPolicy, "checkpoints")
        parser.add_class_arguments(Speed, "speed")
        # Lightning's default logger, TensorBoard, as a parsed default rather than a None the Trainer fills in: a
        # user's --trainer.logger+=CSVLogger then adds to it, as Lightning's docs read, instead of replacing it.
        # runs.point_loggers_at points it at the run folder; `false` or a list of the user's own replaces it, and so
        # does a logger in a script's trainer_defaults.
        if "logger" not in self.trainer_defaults:
            parser.set_defaults({"trainer.logger": default_logger()})

    def parse_arguments(self, parser: LightningArgumentParser, args: ArgsType) -> None:
        check_yaml_files(parser, sys.argv[1:] if args is None else args)
        # the classes a flag or --config file can switch: a script's fixed ones cannot be
        modes = {"--model": self.subclass_mode_model, "--data": self.subclass_mode_data}
        switchable = [flag for flag, subclass_mode in modes.items() if subclass_mode]
        if args is None:  # sys.argv itself: Lightning warns when args and sys.argv differ (DDP re-runs sys.argv)
            sys.argv[1:] = start_from_class_defaults(let_appended_loggers_parse(sys.argv[1:]), switchable)
        elif isinstance(args, list | tuple):
            args = start_from_class_defaults(let_appended_loggers_parse(list(args)), switchable)
        super().parse_arguments(parser, args)
        subcommand = self.config.get("subcommand")
        if subcommand:
            # as filled in above, which a DDP rank re-running them fills in alike
            command = [str(arg) for arg in (sys.argv[1:] if args is None else args if isinstance(args, list) else [])]
            self.asked = (self.config[subcommand].get("ckpt_path"), command)  # for a plan made again
            try:
                self._plan(subcommand)
            except ValueError as error:
                parser.error(str(error))  # a one-paragraph message and exit code 2, not a traceback

    def _plan(self, subcommand: str, family: Path | None = None) -> RunPlan:
        """Plans the run (``lightkeep.runs``) and points the loggers at it; ``family``: where a logger's link applied
        at instantiation puts its runs (``run_loggers.LoggerFolder``)."""
        section = self.config[subcommand]
        section["ckpt_path"], command = self.asked  # as given: a plan made again resolves it again
        self.run_plan = plan_run(section, subcommand, self._fixed_classes(), command, family)
        continued = self.run_plan.continues and rank_zero_only.rank == 0
        self.folder_before = FolderBefore.take(self.run_plan.dir) if continued else None
        self.unknown_loggers = point_loggers_at(self.run_plan, section["trainer"])
        return self.run_plan

    def _follow_logger(self, family: Path) -> RunPlan:
        """The run planned again in ``family``, where a link applied at instantiation put a logger's folder."""
        plan, subcommand = self.run_plan, self.subcommand
        if plan is None or subcommand is None or family.resolve() == plan.dir.parent.resolve():
            return plan  # type: ignore[return-value]  # registered for a planned run only
        remove_if_empty(plan)  # the folder claimed at parsing, still empty
        return self._plan(subcommand, family)

    def _fixed_classes(self) -> dict[str, str]:
        """The class paths of a project's own script's fixed model and data classes (``LightningCLI(Net, Data)``),
        which its config does not name."""
        fixed = {"model": (self.model_class, self.subclass_mode_model),
                 "data": (self.datamodule_class, self.subclass_mode_data)}  # fmt: skip
        return {
            key: f"{cls.__module__}.{cls.__qualname__}"
            for key, (cls, subclass_mode) in fixed.items()
            if isinstance(cls, type) and not subclass_mode
        }

    def instantiate_classes(self) -> None:
        if self.run_plan is not None:
            for cls in (TensorBoardLogger, CSVLogger):
                self.parser.add_instantiator(LoggerFolder(self._follow_logger), cls)
        try:
            super().instantiate_classes()
            ckpt_path = self.config[self.subcommand].get("ckpt_path") if self.subcommand else None
            if ckpt_path is not None and Path(ckpt_path).is_file():
                check_fits(ckpt_path, self.model)
            if ckpt_path is not None and Path(ckpt_path).is_dir() and isinstance(self.trainer.strategy, Sharded):
                check_same_network(Path(ckpt_path), self.model)  # before any rank starts or anything is written
            elif ckpt_path is not None and Path(ckpt_path).is_dir():
                raise ValueError(
                    f"{ckpt_path} is a sharded checkpoint: resume it with --config configs/fsdp.yaml (on any number "
                    "of devices), or make a single file of it with scripts/export.py"
                )
            if self.run_plan is not None and rank_zero_only.rank == 0:
                keep_csv_history(self.run_plan, self.trainer.loggers)
            freeze_what_was_built()
        except ValueError as error:  # e.g. "lr (-0.1) must be > 0" from a constructor
            self.parser.error(str(root_cause(error)))
        except MisconfigurationException as error:  # the Trainer's, e.g. more devices than the machine has
            self.parser.error(
                f"{error} Check the --trainer arguments: this machine has {torch.cuda.device_count()} CUDA GPU(s)."
            )

    def after_fit(self) -> None:  # LightningCLI calls it once fit has returned: not after a preemption or a crash
        if self.config["fit"]["run"]["test_after_fit"]:
            test_best(self.trainer, self.model, self.datamodule, self.judge)

    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        if self.run_plan is not None:  # as planned again where a logger's link moved the run (_follow_logger)
            kwargs["default_root_dir"] = str(self.run_plan.dir)
            self.config_init[self.subcommand]["ckpt_path"] = self.config[self.subcommand]["ckpt_path"]
        config = {**cli_section(self, self.config_init, "trainer"), **kwargs}
        callbacks = config.get("callbacks") or []
        # the callbacks of the script's add_lightning_class_args (a --checkpoint.monitor): the user's, which Lightning
        # appends to the Trainer's list itself
        added = [cli_section(self, self.config_init, key) for key in class_args_callback_keys(self)]
        callbacks = [*(callbacks if isinstance(callbacks, list) else [callbacks]), *self.default_callbacks, *added]
        # Lightning's bar, redrawn every 10 batches rather than after each (~0.1 ms of Python a redraw); not in the
        # config's callback list, where it would make `--trainer.enable_progress_bar false` an error. A bar the
        # config brings wins.
        policy: CheckpointPolicy = cli_section(self, self.config_init, "checkpoints")
        runs = cli_section(self, self.config_init, "run")
        # The engine's parts, each handed the others it reads: the run's shape is planned where the train loader is
        # built and saved by the resume state; the start line reads both and the streams.
        streams = StreamResume(runs.stream_resume)  # the train streams' positions, per rank and loader worker
        batches = GlobalBatch()
        resume = ExactResume(batches)
        loaders = UserLoaders(seed_per_sample=runs.seed_per_sample, streams=streams, batches=batches)
        guarantees = None
        if self.run_plan is not None:  # before the bar: the start line is printed before the bar's first frame
            self.run_folder = RunFolder(self.run_plan)
            guarantees = Guarantees(self.run_plan, self.unknown_loggers, policy, streams, resume, loaders)
            callbacks += [self.run_folder, guarantees]
        # run.monitor's ModelCheckpoint and EarlyStopping (in every subcommand: a checkpoint names their states),
        # checked before either acts
        from_run, monitor, said = run_monitor_callbacks(runs, callbacks, base_monitor())
        if said and self.subcommand == "fit":
            rank_zero_only(print)(said, flush=True)
        checks = [CheckMonitored(from_run)] if self.subcommand == "fit" else []
        # last.ckpt, the periodic files, the LR curve, the summary: whatever list the config gave
        callbacks = [*checks, *from_run, *callbacks, *policy.callbacks(callbacks)]
        speed: Speed = cli_section(self, self.config_init, "speed")
        callbacks += speed.callbacks(callbacks)
        for switch in callbacks:
            if isinstance(switch, MatmulPrecision):  # before the Trainer's GPU set-up reads it
                switch.set_for_the_run()
        if guarantees is not None:  # the switches on, the config's own (a copy made before 1.0.0 lists them) among them
            guarantees.switches = [c for c in callbacks if isinstance(c, SpeedSwitch)]
        plugins = config.get("plugins") or []
        kwargs["plugins"] = policy.plugins([*plugins] if isinstance(plugins, list) else [plugins])
        if config.get("enable_progress_bar") is not False and not any(isinstance(c, ProgressBar) for c in callbacks):
            callbacks.append(TQDMProgressBar(refresh_rate=10, leave=False))
        if config.get("enable_checkpointing") is False or config.get("fast_dev_run"):
            # Lightning refuses ModelCheckpoint callbacks with checkpointing off, and under fast_dev_run (which
            # documents "checkpointing is suppressed") 2.6 still writes last.ckpt at the end: the flag is the intent
            callbacks = [c for c in callbacks if not isinstance(c, ModelCheckpoint)]
        if config.get("logger") in (False, []) and any(isinstance(c, LearningRateMonitor) for c in callbacks):
            # it refuses a Trainer without a logger; `--trainer.logger false` should not need a second flag
            callbacks = [c for c in callbacks if not isinstance(c, LearningRateMonitor)]
        for spikes in [c for c in callbacks if isinstance(c, SpikeDetection)]:
            spike_detection_loads_its_state(spikes)  # Lightning 2.6's own load fails: a resume would end in a traceback
        if self.subcommand == "fit":  # a tuner searches in the run's first fit only
            tuners = TunersOnceARun(resuming=self.config["fit"].get("ckpt_path") is not None, resume=resume)
            callbacks = [*tuners.leave_out(callbacks), tuners]  # configure_callbacks' are found at the fit's setup
            if guarantees is not None:
                guarantees.tuners = tuners
        # What judges the run, handed to what reads its best (the summary, a sweep's trial), to the resume record
        # (which names it in each checkpoint) and to after_fit / the sweep (the CLI's judge)
        readers = [self, resume, *(c for c in callbacks if isinstance(c, ReadsJudge))]
        judging = Judging(monitor, readers, checks)
        judging.hand_over(callbacks)
        # a dead rank, or a hung one (run.hang_timeout), ends the run in one line on every machine (each rank's
        # progress, seen from every rank: lightkeep.liveness); before DestroyProcessGroup
        liveness = Liveness()
        failures = RankFailures(liveness)
        kwargs["callbacks"] = [
            # the values callbacks and plateau schedulers judge by, across a resume; first: its plateau step at the
            # fit's end comes before the end's last.ckpt
            MonitoredValues(),
            judging,  # again at setup, with the module's configure_callbacks
            *(c for c in callbacks if c not in added),
            liveness,  # before failures: its thread ends at an exception, before the report reads the store
            failures,
            HangWatchdog(runs.hang_timeout, liveness, failures.report),
            loaders,  # the engine's samplers in the user's loaders
            streams,
            FitScheduleToRun(),  # the LR schedule fitted to the run, before the resume compares its rates
            resume,
            Trainable(),  # which parameters train: across a resume, and synced under DDP
        ]
        if config.get("profiler") is None:
            kwargs["profiler"] = NoProfiler()
        return super().instantiate_trainer(**kwargs)
