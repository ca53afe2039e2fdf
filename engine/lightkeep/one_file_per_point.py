"""The callback that tells the background checkpoint writer (``lightkeep.checkpoint_io``) when training moves on
from a point, so that the saves of that point are one file under their names."""

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lightkeep.checkpoint_files import FilePath
from lightkeep.checkpoint_io import AtomicCheckpointIO
from lightkeep.compat import count_pending_saves_as_files, restore_file_exists


class OneFilePerPoint(Callback):
    """Tells the template's checkpoint writer (``AtomicCheckpointIO``) when training moves on from a point, so that
    the saves of that point are written as one file under their names, holding the state after the last of them.
    Held between a validation's end and the next training batch (or epoch start, or the end of ``fit``): a kill in
    between loses that point's files, as a kill during their write would. A name whose save is held or still being
    written counts as taken (``file_exists``), and a fit with another ``CheckpointIO`` first gives a linked
    ``last.ckpt`` a file of its own: why, in docs/checkpoints.md, 'One file per validation' and 'Atomic writes, in
    the background'.
    """

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        io = trainer.strategy.checkpoint_io
        if isinstance(io, AtomicCheckpointIO) and stage == "fit":
            io.hold_points = True
            for callback in trainer.checkpoint_callbacks:
                if isinstance(callback, ModelCheckpoint):
                    count_pending_saves_as_files(callback, _pending_write(io))

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # another writer may rewrite last.ckpt in place (Lightning's own, when its temporary folder is on another
        # filesystem): a last.ckpt an earlier fit linked to a best-k file gets a file of its own first
        if not isinstance(trainer.strategy.checkpoint_io, AtomicCheckpointIO) and trainer.is_global_zero:
            for callback in trainer.checkpoint_callbacks:
                if isinstance(callback, ModelCheckpoint) and callback.dirpath and "://" not in str(callback.dirpath):
                    for path in Path(callback.dirpath).glob(f"{ModelCheckpoint.CHECKPOINT_NAME_LAST}*.ckpt"):
                        if path.is_file() and path.stat().st_nlink > 1:
                            _own_file(path)

    def _close(self, trainer: L.Trainer, *_: Any) -> None:
        io = trainer.strategy.checkpoint_io
        if isinstance(io, AtomicCheckpointIO):
            io.close_point()

    on_train_epoch_start = on_train_batch_start = _close  # training moves on

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._close(trainer)
        for callback in trainer.checkpoint_callbacks:
            restore_file_exists(callback)  # the class's own again


def _own_file(path: Path) -> None:
    """``path`` as a file of its own, no longer linked to the others: a copy renamed over it, so that a kill at
    any moment leaves it whole."""
    tmp = path.with_name(f"{path.name}.tmp")
    tmp.unlink(missing_ok=True)
    try:
        shutil.copyfile(path, tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _pending_write(io: AtomicCheckpointIO) -> Callable[[FilePath, L.Trainer], bool]:
    def pending(filepath: FilePath, trainer: L.Trainer) -> bool:
        # rank 0 alone writes; every rank takes the same decision (one more collective, at a save only)
        return trainer.strategy.reduce_boolean_decision(trainer.is_global_zero and io.claims(filepath), all=False)

    return pending
