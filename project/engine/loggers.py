"""Loggers the template adds to Lightning's own."""

import math
import time
from typing import Any

from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_only


class ThrottledTensorBoardLogger(TensorBoardLogger):
    """Lightning's TensorBoard logger, handing its values to the event writer every ``flush_seconds`` in one batch
    rather than a few at every step.

    TensorBoard writes events from a background thread. Fed after every step, that thread wakes a few times per
    step and takes the interpreter lock from the training loop; Lightning also flushes (waits for it to drain)
    after every step. On a small model that was ~0.6 ms a step, a third of the step. Here the values wait in a
    list and go out together: every value is still written, in order. At most ``flush_seconds`` of values wait in
    memory; each checkpoint (``ExactResume``) and the end of the run write them out, so a run killed after a
    checkpoint keeps every point up to it.

    Args:
        flush_seconds: Least time between two hand-overs to the writer.
        **kwargs: Lightning's ``TensorBoardLogger`` arguments (``save_dir``, ``name``, ...).
    """

    def __init__(self, *args: Any, flush_seconds: float = 5.0, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if flush_seconds < 0:
            raise ValueError(f"flush_seconds ({flush_seconds}) must be >= 0")
        self.flush_seconds = flush_seconds
        self._flushed_at = -math.inf
        self._pending: list[tuple[dict[str, float], int | None]] = []

    @rank_zero_only
    def log_metrics(self, metrics: dict[str, Any], step: int | None = None) -> None:
        self._pending.append((dict(metrics), step))

    @rank_zero_only
    def save(self) -> None:  # Lightning calls this after every log_metrics
        if time.monotonic() - self._flushed_at >= self.flush_seconds:
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
        if self._experiment is not None:
            self.flush()
        super().finalize(status)


class HeldUntilCheckpoint:
    """Stands in for a logger's ``log_metrics``: values wait until the next checkpoint, then go out in order.

    For loggers that cannot drop points (MLflow, W&B): a run killed after a checkpoint is resumed from it and logs
    the steps after it again, which such a logger would then hold twice. Held back, only values of steps before a
    checkpoint's ever reach it (Lightning logs a step's values after that step's checkpoint is saved, so they go
    out at the next batch start), so a resumed run continues it with no step twice and none missing. The cost:
    what it shows lags by up to one checkpoint interval, and the values since the last checkpoint are lost with a
    killed process (the resumed run logs them again).
    """

    def __init__(self, logger: Any) -> None:
        self.logger, self.log_metrics = logger, logger.log_metrics
        self.pending: list[tuple[dict[str, float], int | None]] = []
        logger.log_metrics = self.hold

    def hold(self, metrics: dict[str, Any], step: int | None = None) -> None:
        self.pending.append((dict(metrics), step))

    def release(self, before: int | None = None) -> None:
        """Hands over the values logged at steps < ``before`` (all of them when ``None``), in order."""
        out = [(m, s) for m, s in self.pending if before is None or s is None or s < before]
        self.pending = [(m, s) for m, s in self.pending if not (before is None or s is None or s < before)]
        for metrics, step in out:
            self.log_metrics(metrics, step)
        if out:
            self.logger.save()

    def detach(self) -> None:
        self.logger.log_metrics = self.log_metrics
