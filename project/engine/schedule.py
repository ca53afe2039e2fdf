"""Linear warmup followed by cosine annealing, computed in closed form from the step count."""

import math

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler


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
    """Drop-in replacement for ``pl_bolts.optimizers.lr_scheduler.LinearWarmupCosineAnnealingLR``.

    "Epochs" are scheduler steps: call ``step()`` once per epoch, or once per optimizer step with both counts
    given in steps. The rate is a pure function of ``last_epoch``, so it neither drifts nor depends on how many
    times ``step()`` was called before a checkpoint was taken.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        warmup_epochs: int,
        max_epochs: int,
        warmup_start_lr: float = 0.0,
        eta_min: float = 0.0,
        last_epoch: int = -1,
    ) -> None:
        _check_horizon(warmup_epochs, max_epochs)
        for name, value in (("warmup_start_lr", warmup_start_lr), ("eta_min", eta_min)):
            if value < 0:
                raise ValueError(f"{name} ({value}) must be >= 0")
        self.warmup_epochs = warmup_epochs
        self.max_epochs = max_epochs
        self.warmup_start_lr = warmup_start_lr
        self.eta_min = eta_min
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> list[float]:
        return [
            warmup_cosine_lr(
                self.last_epoch, base_lr, self.warmup_epochs, self.max_epochs, self.warmup_start_lr, self.eta_min
            )
            for base_lr in self.base_lrs
        ]

    # torch uses this when step() is given an explicit epoch; ours is closed-form anyway.
    _get_closed_form_lr = get_lr

    def set_horizon(self, warmup_epochs: int, max_epochs: int) -> None:
        """Change W and M (e.g. epochs converted to steps once the data is known) and apply the new rate now."""
        _check_horizon(warmup_epochs, max_epochs)
        self.warmup_epochs, self.max_epochs = warmup_epochs, max_epochs
        self._apply_lr()

    def load_state_dict(self, state_dict: dict) -> None:
        # Re-derive the rate from the restored step, whatever order the optimizer's own state was loaded in.
        super().load_state_dict(state_dict)
        self._apply_lr()

    def _apply_lr(self) -> None:
        for group, lr in zip(self.optimizer.param_groups, self.get_lr(), strict=True):
            group["lr"] = lr
        self._last_lr = [group["lr"] for group in self.optimizer.param_groups]


def _check_horizon(warmup_epochs: int, max_epochs: int) -> None:
    if warmup_epochs < 0 or max_epochs < 0:
        raise ValueError(f"warmup_epochs ({warmup_epochs}) and max_epochs ({max_epochs}) must be >= 0")
    if warmup_epochs > max_epochs:
        raise ValueError(f"warmup_epochs ({warmup_epochs}) must be <= max_epochs ({max_epochs})")
