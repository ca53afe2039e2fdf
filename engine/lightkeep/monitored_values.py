"""The values a run's callbacks and schedulers judge by (``trainer.callback_metrics``: the last validation's
``val_loss``, the last step's ``train_loss``), carried across a resume. What Lightning does without them (a resumed
run has none until its next validation; a ``ReduceLROnPlateau`` reduced an epoch late; a fit stopped mid-epoch
judged at its stop's validation): docs/upstream.md, "The values callbacks judge by are not in a checkpoint".

Each checkpoint keeps rank 0's values (the file rank 0 writes; a monitored value is the same on every rank when logged
with ``sync_dist`` or a torchmetrics ``Metric``), a resume sets them again before its first batch, and the plateau
step Lightning skips is taken at the next epoch's start (or the fit's end), with the epoch's values then in, counted
as of the epoch it belongs to (a plateau with ``frequency`` 2 steps after epochs 1, 3, ...); a checkpoint saved
before its epoch's plateau step says so, and the resume takes that step first. A checkpoint of engine 1.5 (no saved
values) has the skipped step taken too.

A fit that stops mid-epoch (``max_time``, ``trainer.should_stop`` set by a callback) is an interruption, as a kill
is: ``fit --ckpt_path last`` continues that epoch (``lightkeep.resume``). Its validation is logged, and judged by
no ``EarlyStopping`` or monitored ``ModelCheckpoint``: those save no file at it, and the checkpoints written after
it hold their states (and the monitored values) from before it.
"""

import copy
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, EarlyStopping, ModelCheckpoint

from lightkeep.compat import skip_saves_at_this_step
from lightkeep.compat_loops import (
    lightning_skips_the_plateau_step,
    plateau_step_pending,
    step_the_plateau_schedulers,
    stopping_mid_epoch,
    validation_due_without_the_stop,
)


class MonitoredValues(Callback):
    """Saves ``trainer.callback_metrics`` in each checkpoint of a fit, sets them again on resume, and lets Lightning
    step ``ReduceLROnPlateau`` at the end of a resumed epoch (see the module's docstring)."""

    def __init__(self) -> None:
        self._trainer: L.Trainer | None = None
        self._saved: dict[str, torch.Tensor] | None = None  # loaded from the checkpoint resumed from
        self._epoch: int | None = None  # the epoch of the checkpoint resumed from
        self._pending_saved = False  # that checkpoint was saved at its epoch's end, before its plateau step
        self._resumed = False  # this fit resumed: its first epoch's end is checked for Lightning's skip
        self._skipped: int | None = None  # the epoch whose plateau step Lightning skipped: taken next
        # before a mid-epoch stop's validation: the states of the callbacks judging by a monitor, and the values
        self._judges_before_stop: dict[str, Any] | None = None
        self._values_before_stop: dict[str, torch.Tensor] | None = None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._trainer = trainer
        self._judges_before_stop = self._values_before_stop = None

    def state_dict(self) -> dict[str, Any]:
        trainer = self._trainer
        if trainer is None or trainer.state.fn != "fit":
            return {}
        if self._values_before_stop is not None:
            return {"values": self._values_before_stop, "plateau_pending": False}
        values = {}
        for key, value in trainer.callback_metrics.items():
            if isinstance(value, int | float):
                value = torch.tensor(value)
            if isinstance(value, torch.Tensor) and value.numel() == 1:
                values[key] = value.detach().cpu().clone()
        return {"values": values, "plateau_pending": plateau_step_pending(trainer)}  # of the checkpoint's "epoch"

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        during_a_fit = trainer.state.fn == "fit" and not trainer.sanity_checking
        if during_a_fit and stopping_mid_epoch(trainer) and not validation_due_without_the_stop(trainer):
            self._keep_the_judges_out_of_the_stop(trainer)

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        if self._judges_before_stop is not None:  # the judges as before the stop (this callback's: state_dict)
            checkpoint.setdefault("callbacks", {}).update(self._judges_before_stop)

    def on_load_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        self._epoch = checkpoint.get("epoch")

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._saved = state_dict.get("values")
        self._pending_saved = bool(state_dict.get("plateau_pending"))

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        saved, self._saved = self._saved, None
        if trainer.ckpt_path is None:
            return
        self._resumed = True  # also from a checkpoint without saved values: the skipped step needs none
        device = pl_module.device  # where Lightning keeps the values it logs
        current = trainer.callback_metrics  # the dict itself: what a callback reads next
        for key, value in (saved or {}).items():
            current.setdefault(key, value.to(device))
        if self._pending_saved:  # the step the checkpoint's run took right after saving it
            self._skipped = self._epoch
        self._pending_saved = False
        self._step_the_skipped(trainer)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if stopping_mid_epoch(trainer):  # its end hooks run before the fit ends (also when it did not validate)
            self._keep_the_judges_out_of_the_stop(trainer)
        if self._resumed:  # the epoch a resume landed in: Lightning skips its plateau step when it was mid-epoch
            self._skipped = trainer.current_epoch if lightning_skips_the_plateau_step(trainer) else None
            self._resumed = False

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._step_the_skipped(trainer)  # before anything of the epoch trains with the LR

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._step_the_skipped(trainer)  # the last epoch's: before the end's last.ckpt (listed first)

    def _step_the_skipped(self, trainer: L.Trainer) -> None:
        if self._skipped is not None:
            step_the_plateau_schedulers(trainer, self._skipped)
        self._skipped = None

    def _keep_the_judges_out_of_the_stop(self, trainer: L.Trainer) -> None:
        """At a mid-epoch stop, before its validation (or its epoch's end hooks): the states of the callbacks that
        judge by a monitor, and the monitored values, are kept for the checkpoints written after it, and those
        ``ModelCheckpoint``s save no file at this step (listed first, this runs before their hooks)."""
        if self._judges_before_stop is not None:
            return
        judges = [c for c in trainer.callbacks if isinstance(c, EarlyStopping | ModelCheckpoint) and c.monitor]
        self._values_before_stop = self.state_dict()["values"]
        self._judges_before_stop = {c.state_key: copy.deepcopy(c.state_dict()) for c in judges}
        for callback in judges:
            if isinstance(callback, ModelCheckpoint):
                skip_saves_at_this_step(callback, trainer)
