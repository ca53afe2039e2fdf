"""Loggers the template adds to Lightning's own."""

import math
import time
from typing import Any

from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_only


class ThrottledTensorBoardLogger(TensorBoardLogger):
    """Lightning's TensorBoard logger, flushed to disk at most every ``flush_seconds`` rather than after every step.

    Lightning calls ``save()`` after each ``log_metrics``, so with ``log_every_n_steps: 1`` every step waits for
    the event writer thread to drain and stats the log folder: ~0.1 ms, a few percent of a small model's step.
    Every value is still written, in order; at most ``flush_seconds`` worth waits in memory (TensorBoard's own
    writer waits up to 120 s), each checkpoint flushes (``ExactResume``) and so does the end of the run.

    Args:
        flush_seconds: Least time between two flushes.
        **kwargs: Lightning's ``TensorBoardLogger`` arguments (``save_dir``, ``name``, ...).
    """

    def __init__(self, *args: Any, flush_seconds: float = 5.0, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if flush_seconds < 0:
            raise ValueError(f"flush_seconds ({flush_seconds}) must be >= 0")
        self.flush_seconds = flush_seconds
        self._flushed_at = -math.inf

    @rank_zero_only
    def save(self) -> None:
        now = time.monotonic()
        if now - self._flushed_at >= self.flush_seconds:
            self._flushed_at = now
            super().save()
