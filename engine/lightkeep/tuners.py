"""Lightning's tuners as callbacks, ``LearningRateFinder`` and ``BatchSizeFinder``, across a resume. Each searches
in its ``on_fit_start``: it saves a temporary checkpoint, trains on it, restores it and applies what it found. On a
resume that restore consumes the resume's loaded checkpoint, so Lightning then restores none of its training state
(optimizer, schedule, epoch and step: the run trained on from step 0 of the resumed weights, 3.7e-2 off with a
``LearningRateFinder``, measured), and the search is run again on a run that already has its result. On a fresh fit
Lightning takes the temporary file for the fit's checkpoint (``trainer.ckpt_path``), which made a fresh run's start
line a resume's. Upstream: docs/upstream.md, "A tuner callback's search loses a resume's training state".

So a fit of the engine's runs a tuner once, in the run's first fit: a resume continues with what it found (the
learning rate is in the checkpoint's optimizer; the batch size is the one the checkpoint's run trained with), and the
start line names the tuner as not run again."""

from typing import Any

import lightning as L
from lightning.pytorch import Callback
from lightning.pytorch.callbacks import BatchSizeFinder, LearningRateFinder
from lightning.pytorch.utilities.parsing import lightning_setattr

from lightkeep.compat import batch_size_finders_attribute
from lightkeep.resume import ExactResume
from lightkeep.schedule import LinearWarmupCosineAnnealingLR

TUNERS = (LearningRateFinder, BatchSizeFinder)


class TunersOnceARun(Callback):
    """Built by the CLI for every fit. On a resume the tuners are left out: the config's before the Trainer is built
    (``leave_out``: a ``BatchSizeFinder``'s own ``setup`` refuses DDP, which a resume may run on), the module's
    ``configure_callbacks``' at the fit's setup, where they have joined the Trainer's callbacks; the start line names
    each (``not_run_again``), and a left-out ``BatchSizeFinder``'s attribute gets the per-device batch size of the
    checkpoint's run (the engine's record of its shape, read as the checkpoint loads: before the train loader is
    built whatever the strategy). In a fresh fit: what the tuners' temporary checkpoint loads is not a resume's
    (``ExactResume.loads_are_a_tuners``, whose shape would be taken for the global batch to keep), and the fit stays
    fresh after their search."""

    def __init__(self, resuming: bool, resume: ExactResume) -> None:
        self.resuming, self.resume = resuming, resume
        self.not_run_again: list[str] = []
        self.batch_size_names: list[str] = []
        self.lr_finders: list[LearningRateFinder] = []
        self.searched = False

    def leave_out(self, callbacks: list[Any]) -> list[Any]:
        """``callbacks`` without their tuners on a resume (each noted), as they are otherwise."""
        if not self.resuming:
            return list(callbacks)
        for tuner in [c for c in callbacks if isinstance(c, TUNERS)]:
            self.not_run_again.append(type(tuner).__name__)
            if isinstance(tuner, BatchSizeFinder):
                self.batch_size_names.append(batch_size_finders_attribute(tuner))
            else:  # the attribute it set gets the rate it found again
                self.lr_finders.append(tuner)
        return [c for c in callbacks if not isinstance(c, TUNERS)]

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if self.resuming:  # a new list: Lightning is still going through the old one, calling each callback's setup
            trainer.callbacks = self.leave_out(trainer.callbacks)
            return
        self.lr_finders = [c for c in trainer.callbacks if isinstance(c, LearningRateFinder)]
        self.searched = any(isinstance(c, TUNERS) for c in trainer.callbacks)
        self.resume.loads_are_a_tuners = self.searched

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.searched:  # after the tuners' own on_fit_start (Lightning lists tuners first)
            self.resume.loads_are_a_tuners = False
            trainer.ckpt_path = None
            for finder in self.lr_finders:
                _start_the_schedules_from(trainer, finder)

    def on_load_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        if not self.resuming:
            return
        record = (checkpoint.get("callbacks") or {}).get(self.resume.state_key, {})
        if self.lr_finders:  # the found rate is in the optimizer; the attribute the finder set gets it back too
            saved = record.get("values", {}).get("", {})
            for name in ("lr", "learning_rate"):  # where a LearningRateFinder sets it (Lightning's lookup)
                if name in saved and type(getattr(pl_module, name, None)) is float:
                    setattr(pl_module, name, float(saved[name]))
        shape = record.get("shape")
        for name in self.batch_size_names:
            if shape is None:
                raise ValueError(
                    f"BatchSizeFinder is not run again on a resume, and the checkpoint holds no record of the "
                    f"engine's of the batch size its run trained with: give the one it found (--data.{name} or "
                    f"--model.{name}, wherever it is)"
                )
            lightning_setattr(pl_module, name, shape["batch_size"])


def _start_the_schedules_from(trainer: L.Trainer, finder: LearningRateFinder) -> None:
    """Lightning sets the rate a ``LearningRateFinder`` found on each param group, where a closed-form schedule
    (``LinearWarmupCosineAnnealingLR``) does not read it: its curve is computed from its base rates, so the search's
    result was dropped at the first step. The schedule now starts from it."""
    found = finder.optimal_lr.suggestion() if finder.optimal_lr is not None else None
    groups = [group for optimizer in trainer.optimizers for group in optimizer.param_groups]
    if found is None or any(group["lr"] != found for group in groups):  # no result, or update_attr=False
        return
    for config in trainer.lr_scheduler_configs:
        if isinstance(config.scheduler, LinearWarmupCosineAnnealingLR):
            config.scheduler.start_from([found] * len(config.scheduler.base_lrs))
