"""``CountSyncs``, the callback that counts the syncs of scripts/count_syncs.py's sides (b) and (c) (class path
``count_syncs_callback.CountSyncs``). In a module of its own so that the driver and the hand-written side never load
Lightning.
"""

from pathlib import Path
from typing import Any

import lightning as L
from count_syncs_counter import (
    SyncCounter,
    rank_file,
    write_counts,
)  # scripts/, on the path count_syncs.py gives its runs


class CountSyncs(L.Callback):
    """Installs a ``SyncCounter`` over training (validation left out) and writes its counts at the end.

    Args:
        out: JSON file the counts and the number of optimizer steps are written to; under DDP each rank writes
            ``<stem>.rank<R>.json`` beside it.
    """

    def __init__(self, out: str) -> None:
        self.out = Path(out)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.first_step, self.phase, self.step = trainer.global_step, "step", trainer.global_step
        self.mode = SyncCounter(
            lambda: pl_module.training and not trainer.sanity_checking, lambda: self.phase, lambda: self.step
        )
        self.mode.__enter__()

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.phase, self.step = "step", trainer.global_step  # what comes before the first batch (Lightning's checks)

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self.phase, self.step = "step", trainer.global_step  # the batch, and after it Lightning's logging and bar

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.phase = "epoch end"  # the module's epoch-end hook runs after the callbacks'; then validation

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.mode.__exit__(None, None, None)
        out = self.out if trainer.world_size == 1 else rank_file(self.out, trainer.global_rank)
        write_counts(out, self.mode, trainer.global_step - self.first_step)
