"""``CountSyncs``, the callback that counts the syncs of scripts/count_syncs.py's sides (b) and (c) (class path
``count_syncs_callback.CountSyncs``). In a module of its own so that the driver and the hand-written side never load
Lightning.
"""

from pathlib import Path
from typing import Any

import lightning as L
from count_syncs_counter import SyncCounter, write_counts  # scripts/, on the path count_syncs.py gives its runs


class CountSyncs(L.Callback):
    """Installs a ``SyncCounter`` over training (validation left out) and writes its counts at the end.

    Args:
        out: JSON file the counts and the number of optimizer steps are written to.
    """

    def __init__(self, out: str) -> None:
        self.out = Path(out)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.first_step, self.phase = trainer.global_step, "step"
        self.mode = SyncCounter(lambda: pl_module.training and not trainer.sanity_checking, lambda: self.phase)
        self.mode.__enter__()

    def on_train_batch_start(self, *args: Any) -> None:
        self.phase = "step"  # the batch, and after it Lightning's logging and bar

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.phase = "epoch end"  # the module's epoch-end hook runs after the callbacks'; then validation

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.mode.__exit__(None, None, None)
        write_counts(self.out, self.mode, trainer.global_step - self.first_step)
