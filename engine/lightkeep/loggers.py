"""Loggers the template adds to Lightning's own."""

import math
import time
from pathlib import Path
from typing import Any

from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_only

from lightkeep.compat_logging import experiment_opened, replace_log_metrics
from lightkeep.compat_loops import logging_step


class ThrottledTensorBoardLogger(TensorBoardLogger):
    """Lightning's TensorBoard logger, handing its values to the event writer every ``flush_seconds`` in one batch
    rather than a few at every step.

    TensorBoard writes events from a background thread. Fed after every step, that thread wakes a few times per
    step and takes the interpreter lock from the training loop; Lightning also flushes (waits for it to drain)
    after every step. On a small model that was ~0.6 ms a step, a third of the step. Here the values wait in a
    list and go out together: every value is still written, in order. At most ``flush_seconds`` of values wait in
    memory; each checkpoint (``ExactResume``) and the end of the run write them out, and so does every hand-over
    from a checkpoint to the next batch (``flush_each_save``: the checkpoint step's own values, which Lightning
    logs after saving), so a run killed after a checkpoint keeps every point up to it.

    Args:
        save_dir: Folder of the logs; the CLI sets it to the run folder's parent.
        name: Experiment subfolder (the CLI sets it).
        version: Run subfolder (the CLI sets it).
        log_graph: Add the model's graph (needs ``example_input_array`` on the module).
        default_hp_metric: Log a placeholder ``hp_metric`` with the hyperparameters.
        prefix: Put before every metric's name.
        sub_dir: Subfolder of the run folder for the event files.
        flush_seconds: Least time between two hand-overs to the writer.
        max_queue: Events the writer's queue holds before a hand-over waits for it (0: no limit).
        comment: ``SummaryWriter``'s: suffix of a log folder it names itself (unused here).
        purge_step: ``SummaryWriter``'s: hide the events of this step on, left by a crashed run (the CLI sets it
            on resume).
        flush_secs: ``SummaryWriter``'s: how often its thread flushes the event file by itself.
        filename_suffix: ``SummaryWriter``'s: suffix of the event file names.
    """

    # Lightning's and SummaryWriter's arguments written out, typed, rather than taken as **kwargs: the CLI then
    # reads them from this signature; finding them behind **kwargs cost 0.15 s of every start (reading the source
    # of both classes, and a Python process for SummaryWriter's untyped ones). test_loggers checks that none is
    # missing after an upgrade.
    def __init__(
        self,
        save_dir: str | Path,
        name: str | None = "lightning_logs",
        version: int | str | None = None,
        log_graph: bool = False,
        default_hp_metric: bool = True,
        prefix: str = "",
        sub_dir: str | Path | None = None,
        flush_seconds: float = 5.0,
        max_queue: int = 0,
        comment: str = "",
        purge_step: int | None = None,
        flush_secs: int = 120,
        filename_suffix: str = "",
    ) -> None:
        # The writer's queue unbounded (SummaryWriter's default holds 10): a hand-over of a few thousand values
        # then never waits for the writer thread value by value, trading the interpreter lock with it (1200
        # values: 81-89 ms against 143-171 ms here). flush() waits until the queue is empty, so it never holds
        # more than one hand-over.
        super().__init__(save_dir=save_dir, name=name, version=version, log_graph=log_graph,
                         default_hp_metric=default_hp_metric, prefix=prefix, sub_dir=sub_dir, comment=comment,
                         purge_step=purge_step, max_queue=max_queue, flush_secs=flush_secs,
                         filename_suffix=filename_suffix)  # fmt: skip
        if flush_seconds < 0:
            raise ValueError(f"flush_seconds ({flush_seconds}) must be >= 0")
        self.flush_seconds = flush_seconds
        self._flushed_at = -math.inf
        self.flush_each_save = False
        self._pending: list[tuple[dict[str, float], int | None]] = []

    @rank_zero_only
    def log_metrics(self, metrics: dict[str, Any], step: int | None = None) -> None:
        self._pending.append((dict(metrics), step))

    @rank_zero_only
    def save(self) -> None:  # Lightning calls this after every log_metrics
        if self.flush_each_save or time.monotonic() - self._flushed_at >= self.flush_seconds:
            self.flush()

    @rank_zero_only
    def flush(self) -> None:
        """Writes every waiting value and flushes the event file."""
        pending, self._pending = self._pending, []
        for metrics, step in pending:
            super().log_metrics(metrics, step)
        super().save()
        self.experiment.flush()
        self._flushed_at = time.monotonic()

    @rank_zero_only
    def finalize(self, status: str) -> None:
        if experiment_opened(self):
            self.flush()
        super().finalize(status)


class StepGate:
    """Stands in for a logger's ``log_metrics`` during ``fit``, so that each step reaches the logger exactly once
    across a kill and a resume.

    - A resumed run drops values of steps before its checkpoint's (``resumed_at``): the interrupted run logged
      them, also the epoch-end values Lightning logs again when the checkpoint came from the validation before an
      epoch's end. Values of the checkpoint's step on are new; TensorBoard's ``purge_step`` and the CSV trim remove
      the interrupted run's copies of those.
    - ``hold`` (loggers that cannot drop points: MLflow, W&B): values wait and only those of steps before the last
      checkpoint's go out (``release``), so a killed run never hands over a step its resume logs again. What such a
      logger shows lags by up to one checkpoint interval.
    - A value logged while ``trainer`` validates takes the place of the training step the validation runs at
      (``place``), whatever step it is logged at: Lightning logs a ``validation_step`` value logged with
      ``on_step=True`` at its count of the evaluation batches this process ran, from 0, not at a training step (a
      resumed run's were below ``resumed_at``, all dropped). Dropped, held and handed over as that training
      step's values are, in the order they came. Without a ``trainer`` every value is of the step it is logged at.
    """

    def __init__(self, logger: Any, resumed_at: int, hold: bool, trainer: Any = None) -> None:
        self.logger, self.log_metrics = logger, replace_log_metrics(logger, self.gate)
        self.resumed_at, self.hold, self.trainer = resumed_at, hold, trainer
        self.pending: list[tuple[dict[str, float], int | None, int | None]] = []  # (metrics, step, place)

    def place(self, step: int | None) -> int | None:
        """The training step a value logged now at ``step`` belongs to: during a validation (or the sanity check),
        the one the validation runs at, Lightning's logging step (its epoch-end values' step too); else ``step``."""
        trainer = self.trainer
        if trainer is not None and (trainer.validating or trainer.sanity_checking):
            return logging_step(trainer)
        return step

    def gate(self, metrics: dict[str, Any], step: int | None = None) -> None:
        place = self.place(step)
        if place is not None and place < self.resumed_at:
            return
        if self.hold:
            self.pending.append((dict(metrics), step, place))
        else:
            self.log_metrics(metrics, step)

    def release(self, before: int | None = None) -> None:
        """Hands over the held values of steps < ``before`` (all of them when ``None``), in order; a value logged
        during a validation counts as of the step the validation ran at (``place``)."""
        later = [before is not None and place is not None and place >= before for *_, place in self.pending]
        out = [item for item, keep in zip(self.pending, later, strict=True) if not keep]
        self.pending = [item for item, keep in zip(self.pending, later, strict=True) if keep]
        for metrics, step, _ in out:
            self.log_metrics(metrics, step)
        if out:
            self.logger.save()

    def detach(self) -> None:
        replace_log_metrics(self.logger, self.log_metrics)


def let_appended_loggers_parse(args: list[str]) -> list[str]:
    """``args`` with a placeholder ``save_dir`` after each ``--trainer.logger+=CSVLogger`` (or TensorBoard) that
    gives none.

    Those loggers require ``save_dir``, and jsonargparse stops with a page-long Union error when a logger appended
    with ``+=`` lacks it, though the engine sets it to the run folder right after parsing
    (``runs.point_loggers_at``). A ``save_dir`` given later on the command line still comes after, and wins; one
    given right after the class is left alone, so that the arguments come out the same when filled again (a DDP
    rank re-runs them).
    """
    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

    out: list[str] = []
    for i, arg in enumerate(args):
        out.append(arg)
        if arg.startswith("--trainer.logger+="):
            name = arg.partition("=")[2]
        elif i > 0 and args[i - 1] == "--trainer.logger+":  # the class as the argument after the flag
            name = arg
        else:
            continue
        given = i + 1 < len(args) and args[i + 1].startswith("--trainer.logger.init_args.save_dir")
        cls = class_named(name)
        if not given and cls is not None and issubclass(cls, (TensorBoardLogger, CSVLogger)):
            out.append("--trainer.logger.init_args.save_dir=runs")  # replaced by the run folder's parent
    return out


def class_named(name: str) -> type | None:
    """A class from its import path, or from its name in ``lightning.pytorch.loggers``; ``None`` if neither."""
    import importlib

    module, _, attribute = name.strip().rpartition(".")
    try:
        found = getattr(importlib.import_module(module or "lightning.pytorch.loggers"), attribute)
    except (ImportError, AttributeError, ValueError, TypeError):  # TypeError: a relative name ("..X")
        return None
    return found if isinstance(found, type) else None
