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

from steadfast.compat import batch_size_finders_attribute
from steadfast.elastic import GlobalBatch
from steadfast.schedule import LinearWarmupCosineAnnealingLR

TUNERS = (LearningRateFinder, BatchSizeFinder)


class TunersOnceARun(Callback):
    """Built by the CLI for a fit with tuners among its callbacks (``leave_out_on_a_resume``): keeps a fresh fit
    fresh after their search, and on a resume gives a left-out ``BatchSizeFinder``'s attribute the per-device batch
    size the checkpoint's run trained with (the engine's record of its shape, ``elastic.GlobalBatch``)."""

    def __init__(
        self, resuming: bool, batch_size_names: list[str], batches: GlobalBatch, lr_finders: list[LearningRateFinder]
    ) -> None:
        self.resuming, self.batch_size_names, self.batches = resuming, batch_size_names, batches
        self.lr_finders = lr_finders

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self.resuming:  # after the tuners' own on_fit_start (Lightning lists tuners first)
            trainer.ckpt_path = None
            for finder in self.lr_finders:
                _start_the_schedules_from(trainer, finder)
            return
        saved = self.batches.saved  # restored by now; the train loader is built next
        for name in self.batch_size_names:
            if saved is None:
                raise ValueError(
                    f"BatchSizeFinder is not run again on a resume, and the checkpoint holds no record of the "
                    f"engine's of the batch size its run trained with: give the one it found (--data.{name} N)"
                )
            lightning_setattr(pl_module, name, saved.batch_size)


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


def leave_out_on_a_resume(callbacks: list[Any], resuming: bool, batches: GlobalBatch) -> tuple[list[Any], list[str]]:
    """The callbacks of a fit, with its tuners left out where it resumes, and their names for the start line."""
    tuners = [c for c in callbacks if isinstance(c, TUNERS)]
    if not tuners:
        return callbacks, []
    sizes = [batch_size_finders_attribute(c) for c in tuners if isinstance(c, BatchSizeFinder)]
    kept = [c for c in callbacks if not (resuming and isinstance(c, TUNERS))]
    left_out = [type(c).__name__ for c in tuners] if resuming else []
    finders = [c for c in tuners if isinstance(c, LearningRateFinder)]
    return [*kept, TunersOnceARun(resuming, sizes if resuming else [], batches, finders)], left_out
