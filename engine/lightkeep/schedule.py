"""Linear warmup followed by cosine annealing, computed in closed form from the step count, and fitted to the run's
real length by the engine (``FitScheduleToRun``)."""

import math
import sys
from typing import Any, Literal

import lightning as L
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from lightkeep.compat_torch import set_last_lr

UNENDING = sys.maxsize // 2  # a horizon no run reaches


def warmup_cosine_lr(
    t: int, base_lr: float, warmup_epochs: int, max_epochs: int, warmup_start_lr: float, eta_min: float
) -> float:
    """Learning rate after ``t`` scheduler steps (pl_bolts' curve, with its edge cases fixed).

    - ``t < W``: linear from ``warmup_start_lr`` (t = 0) to ``base_lr`` (t = W - 1); W = 1 is one step at
      ``warmup_start_lr``, W = 0 has no warmup.
    - ``W <= t <= M``: cosine from ``base_lr`` (t = W) down to ``eta_min`` (t = M).
    - ``t >= M``: ``eta_min`` for good (pl_bolts climbs back up; M == W has no cosine phase).
    """
    if t < warmup_epochs:
        return warmup_start_lr + t * (base_lr - warmup_start_lr) / max(1, warmup_epochs - 1)
    if t >= max_epochs:
        return eta_min
    progress = (t - warmup_epochs) / (max_epochs - warmup_epochs)
    return eta_min + 0.5 * (base_lr - eta_min) * (1 + math.cos(math.pi * progress))


class LinearWarmupCosineAnnealingLR(LRScheduler):
    """Drop-in replacement for ``pl_bolts.optimizers.lr_scheduler.LinearWarmupCosineAnnealingLR``: the curve, and how
    the engine (``FitScheduleToRun``) converts a schedule in epochs stepped every optimizer step to the run's real
    steps per epoch, in docs/schedule.md.

    ``warmup_epochs`` and ``max_epochs`` count ``unit``s; under the engine ``max_epochs=None`` spans the run, without
    it "epochs" are scheduler steps, as in pl_bolts. The rate is a pure function of ``last_epoch``, so it neither
    drifts nor depends on how many times ``step()`` was called before a checkpoint was taken.

    ``warmup_start_lr=None``: one warmup increment of each group's rate (``lr / W``), so no step runs at rate 0.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        warmup_epochs: int,
        max_epochs: int | None = None,
        warmup_start_lr: float | None = 0.0,
        eta_min: float = 0.0,
        last_epoch: int = -1,
        unit: Literal["epoch", "step"] = "epoch",
    ) -> None:
        _check_horizon(warmup_epochs, UNENDING if max_epochs is None else max_epochs)
        for name, value in (("warmup_start_lr", warmup_start_lr or 0.0), ("eta_min", eta_min)):
            if value < 0:
                raise ValueError(f"{name} ({value}) must be >= 0")
        self.warmup_epochs, self.max_epochs, self.unit = warmup_epochs, max_epochs, unit  # as given, in units
        # W and M in scheduler steps: the counts as given (pl_bolts) until fit_to converts them to this run's steps
        self.warmup_steps, self.total_steps = warmup_epochs, UNENDING if max_epochs is None else max_epochs
        # optimizer steps an epoch, as the run's first fit counted them; a checkpoint keeps it (the state dict is
        # __dict__), so a resume converts its epochs as the uninterrupted run did, whatever its own epoch's length
        self.steps_per_epoch: int | None = None
        self.warmup_start_lr = warmup_start_lr
        self.eta_min = eta_min
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> list[float]:
        return [
            warmup_cosine_lr(
                self.last_epoch, base_lr, self.warmup_steps, self.total_steps, self._start(base_lr), self.eta_min
            )
            for base_lr in self.base_lrs
        ]

    def _start(self, base_lr: float) -> float:
        return base_lr / max(self.warmup_steps, 1) if self.warmup_start_lr is None else self.warmup_start_lr

    def fit_to(self, trainer: Any, interval: str) -> None:
        """Sets the horizon for this run, once its length is known (``on_train_start``): the constructor's counts in
        ``unit`` (epoch or step), converted to scheduler steps (one per ``interval``).

        ``max_epochs=None`` spans the run: the trainer's ``max_epochs`` epochs, or ``max_steps`` when that ends it
        sooner (also ``fast_dev_run`` and ``max_epochs: -1``). A run shorter than its warmup still trains: the
        warmup is shortened to the run and one line says so.
        """
        # the constructor checked the counts; _horizon keeps warmup <= total
        self.steps_per_epoch = self.steps_per_epoch or _steps_per_epoch(trainer)
        self.warmup_steps, self.total_steps, note = _horizon(trainer, self.warmup_epochs, self.max_epochs, self.unit,
                                                             interval, self.steps_per_epoch)  # fmt: skip
        self._apply_lr()
        if self.unit == "epoch" and interval == "step" and trainer.reload_dataloaders_every_n_epochs > 0:
            counted = (
                f"an epoch is counted as {self.steps_per_epoch} steps (the first epoch's), but the train loaders are "
                "reloaded each epoch and may change length: give the schedule in steps (unit 'step') to count them"
            )
            note = f"{note}; {counted}" if note else counted
        if note:
            rank_zero_info(f"LR schedule: {note}")

    def start_from(self, base_lrs: list[float]) -> None:
        """Base rates set before training's first step (a ``LearningRateFinder``'s result, ``lightkeep.tuners``):
        the curve runs from them, as if the optimizer had been built with them."""
        self.base_lrs = list(base_lrs)
        for group, lr in zip(self.optimizer.param_groups, base_lrs, strict=True):
            group["initial_lr"] = lr
        self._apply_lr()

    def load_state_dict(self, state_dict: dict) -> None:
        if "max_schedule" in state_dict:  # engine <= 1.4.0 kept the counts as given in warmup/max_schedule, and
            # the horizon in steps in warmup_epochs/max_epochs
            renamed = {"warmup_epochs": "warmup_steps", "max_epochs": "total_steps", "warmup": "warmup_epochs",
                       "max_schedule": "max_epochs"}  # fmt: skip
            state_dict = {renamed.get(key, key): value for key, value in state_dict.items()}
        # Re-derive the rate from the restored step, whatever order the optimizer's own state was loaded in.
        super().load_state_dict(state_dict)
        self._apply_lr()

    def _apply_lr(self) -> None:
        for group, lr in zip(self.optimizer.param_groups, self.get_lr(), strict=True):
            group["lr"] = lr
        set_last_lr(self, [group["lr"] for group in self.optimizer.param_groups])


class FitScheduleToRun(Callback):
    """Fits each ``LinearWarmupCosineAnnealingLR`` of the module's ``configure_optimizers`` to the run at the start
    of training, the first moment its length is known (epochs, steps per epoch, limits, accumulation, a short
    debug run). Not in ``configure_optimizers``: reading ``trainer.estimated_stepping_batches`` there loads the
    train data early and drops a resumable loader's state (Lightning issue #20550)."""

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        for config in trainer.lr_scheduler_configs:
            if isinstance(config.scheduler, LinearWarmupCosineAnnealingLR):
                config.scheduler.fit_to(trainer, config.interval)


def _check_horizon(warmup_epochs: int, max_epochs: int) -> None:  # the constructor's
    if warmup_epochs < 0 or max_epochs < 0:
        raise ValueError(f"warmup_epochs ({warmup_epochs}) and max_epochs ({max_epochs}) must be >= 0")
    if warmup_epochs > max_epochs:
        raise ValueError(f"warmup_epochs ({warmup_epochs}) must be <= max_epochs ({max_epochs})")


def _steps_per_epoch(trainer: Any) -> int | None:
    """Optimizer steps in the epoch training starts in (``None``: a train loader without a length)."""
    batches = trainer.num_training_batches
    return max(1, -(-int(batches) // trainer.accumulate_grad_batches)) if batches != float("inf") else None


def _horizon(
    trainer: Any, warmup: int, max_schedule: int | None, unit: str, interval: str, per_epoch: int | None
) -> tuple[int, int, str]:
    """(warmup, total) in scheduler steps, and what was adapted (empty when nothing was), an epoch counted as
    ``per_epoch`` optimizer steps."""
    max_epochs = trainer.max_epochs if trainer.max_epochs is not None and trainer.max_epochs >= 0 else None
    max_steps = trainer.max_steps if trainer.max_steps >= 0 else None
    if unit == "epoch" and interval == "step":
        if per_epoch is None:
            raise ValueError("the train loader has no length: give the LR schedule's warmup and length in steps")
        to_steps = per_epoch
    elif unit == "step" and interval == "epoch":
        raise ValueError("an LR schedule in steps that Lightning steps once per epoch: use interval 'step'")
    else:
        to_steps = 1
    warmup_steps = warmup * to_steps
    if max_schedule is not None:
        return warmup_steps, max_schedule * to_steps, ""
    # The run's length in scheduler steps: whichever of max_epochs and max_steps ends it first.
    if interval == "step":
        lengths = [n for n in (max_steps, max_epochs * per_epoch if max_epochs and per_epoch else None) if n]
    else:
        lengths = [n for n in (max_epochs, -(-max_steps // per_epoch) if max_steps and per_epoch else None) if n]
    if not lengths:
        note = "this run has no set end, so after the warmup the rate stays at lr (the schedule's max_epochs decays it)"
        return warmup_steps, UNENDING, note
    total = min(lengths)
    what = "steps" if interval == "step" else "epochs"
    if warmup_steps > total:
        note = f"warmup ({warmup} {unit}s = {warmup_steps} {what}) is longer than this run ({total} {what})"
        return total, total, f"{note}: warmup shortened to {total} {what}, no cosine decay"
    return warmup_steps, total, ""
