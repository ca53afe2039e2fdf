"""``last.ckpt`` on a time interval, and always at the end of ``fit``: the default checkpoint policy's refresh."""

import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint

from lightkeep.agreement import AGREE_EVERY, Agreement
from lightkeep.compat import save_last_unless_saved_at_this_step
from lightkeep.compat_loops import accumulating

# The engine's file where a user's ModelCheckpoint names its own files "last" in the same folder (its best, say)
OWN_LAST = "last-lightkeep"


class LastCheckpoint(ModelCheckpoint):
    """A ``ModelCheckpoint`` that writes only ``last.ckpt``: every ``train_time_interval`` of training and once
    more when ``fit`` ends, so the file always holds the final state of a finished run.

    A time, not a step count: a save costs the same whatever the step takes, so a 1 GB model is not saved every
    few seconds and a 2 ms step not every 50 steps. Lightning's own end-of-fit save writes ``last.ckpt`` only if
    none was written during the fit, which leaves it up to ``train_time_interval`` old. What a crash between
    refreshes loses: docs/checkpoints.md, 'How much a crash loses'.

    The clock is rank 0's, and every rank saves at the same batch end (the save is a collective). Lightning's
    ``ModelCheckpoint`` broadcasts rank 0's decision at every batch end; here rank 0's "due" goes into an
    ``Agreement`` (``lightkeep.agreement``), so under DDP a refresh comes up to ``2 x AGREE_EVERY`` batches after the
    interval is up; in one process, at the first batch end after it. (Manual optimization is timed too: Lightning's
    timer skipped it.)

    A ``last.ckpt`` that a user's ``ModelCheckpoint`` writes as one of its own files (``filename="last"``: its best)
    stays theirs: this one then writes ``last-lightkeep.ckpt`` beside it, and ``moved`` says so for the start line.
    (A user's ``save_last`` file is the newest state, as this one is: the two share it.)

    Args:
        train_time_interval: How often ``last.ckpt`` is refreshed, e.g. ``"0:10:00"``.
        dirpath: Where; ``None``: the run's ``checkpoints/`` folder.
    """

    def __init__(self, train_time_interval: timedelta = timedelta(minutes=10), dirpath: str | None = None) -> None:
        super().__init__(
            dirpath=dirpath,
            train_time_interval=train_time_interval,  # jsonargparse reads "0:10:00" as a timedelta; the state key
            save_top_k=0,
            save_last=True,
            enable_version_counter=False,  # ModelCheckpoints writing last.ckpt share the file, never last-v1.ckpt
        )
        self._interval = train_time_interval.total_seconds()
        self._since = time.monotonic()  # the last refresh, or the start of training
        self._agreement: Agreement | None = None  # under DDP
        self._batch_ends = 0  # of this fit, the same count on every rank
        self._agreed = False  # a refresh read at an epoch's end, made at the next batch end
        self._held_stop = False  # a stop that came mid-accumulation, made at the batch that steps
        self.moved: str | None = None  # where this file went and why, when a user's file is named last.ckpt

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if stage == "fit" and trainer.world_size > 1 and dist.is_available() and dist.is_initialized():
            self._agreement = Agreement(trainer.strategy.root_device, 1)  # (rank 0's clock is up,)
            self._batch_ends, self._agreed = 0, False

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Every folder is known now (a ModelCheckpoint's setup resolves its own); the user's callbacks are read from
        # the trainer, where Lightning adds some after the CLI's list (add_lightning_class_args, configure_callbacks)
        folder, name = self.dirpath, type(self).CHECKPOINT_NAME_LAST + self.FILE_EXTENSION
        theirs = next((c for c in trainer.checkpoint_callbacks if c is not self and _names(c, name, folder)), None)
        self.CHECKPOINT_NAME_LAST = type(self).CHECKPOINT_NAME_LAST if theirs is None else OWN_LAST
        self.moved = None
        if theirs is not None:
            own = Path(str(folder)) / f"{OWN_LAST}{self.FILE_EXTENSION}"
            self.moved = (
                f"the engine's last checkpoint is {own}: {Path(str(folder)) / name} is the file of "
                f"{type(theirs).__name__}(filename={theirs.filename!r}), left to it"
            )

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        # the file is found by its name; a saved path (a user's last.ckpt, before this file moved) is never removed
        self.last_model_path = ""

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._since = time.monotonic()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *_: Any) -> None:
        due = self._due(trainer) if self._agreement is None else self._agree(trainer, self._agreement)
        if accumulating(trainer):
            # the step's gradients so far are in .grad, which no checkpoint holds: a save or a stop waits for the
            # batch that steps (a stop: max_time's, a callback's; listed among the last, after them)
            self._agreed = self._agreed or due  # under DDP: what the next batch end reads (one process: due again)
            self._held_stop = self._held_stop or trainer.should_stop
            trainer.should_stop = False
            return
        if self._held_stop:
            trainer.should_stop, self._held_stop = True, False
        if due:
            self._since = time.monotonic()
            save_last_unless_saved_at_this_step(self, trainer)

    def _due(self, trainer: L.Trainer) -> bool:
        return trainer.is_global_zero and time.monotonic() - self._since >= self._interval

    def _agree(self, trainer: L.Trainer, agreement: Agreement) -> bool:
        """Whether every rank refreshes at this batch end; every rank calls it at every batch end, so each starts
        and reads at the same batches."""
        self._batch_ends += 1
        due, self._agreed = self._agreed, False
        if self._batch_ends % AGREE_EVERY == 0:
            if agreement.pending:
                due = agreement.sums()[0] > 0 or due
            agreement.start([int(self._due(trainer))])
        return due

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._agreement is not None and self._agreement.pending:  # not left under way past the epoch
            self._agreed = self._agreement.sums()[0] > 0
        super().on_train_epoch_end(trainer, pl_module)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._end_agreement(wait=True)  # the fit ended first; then the collectives of the save
        save_last_unless_saved_at_this_step(self, trainer)

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._end_agreement(wait=False)  # a rank that failed may never finish it
        super().on_exception(trainer, pl_module, exception)

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._end_agreement(wait=True)
        super().teardown(trainer, pl_module, stage)

    def _end_agreement(self, wait: bool) -> None:
        agreement, self._agreement = self._agreement, None
        if wait and agreement is not None and agreement.pending:
            agreement.sums()


def _names(callback: Any, name: str, folder: Any) -> bool:
    """Whether ``callback`` (a ``ModelCheckpoint``) writes its top-k or periodic files as ``name`` in ``folder``."""
    if not isinstance(callback, ModelCheckpoint) or callback.save_top_k == 0:
        return False
    if f"{callback.filename}{callback.FILE_EXTENSION}" != name or callback.dirpath is None or folder is None:
        return False
    if "://" in f"{callback.dirpath}{folder}":
        return str(callback.dirpath) == str(folder)
    return Path(callback.dirpath).resolve() == Path(folder).resolve()
