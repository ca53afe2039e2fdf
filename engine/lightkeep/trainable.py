"""Which parameters train, kept across a resume and synced under DDP; what Lightning does without it (Lightning
#21901: frozen again after a resume past the unfreeze; #20340: the ranks part after an unfreeze under DDP):
docs/upstream.md, "Other findings of the third audit".

``requires_grad`` and a BatchNorm's ``track_running_stats`` are in no ``state_dict``. Here each checkpoint names the
parameters that do not train and the BatchNorms that do not track their statistics, and a resume sets them so as the
checkpoint is loaded (after every callback's ``setup``, before DDP wraps the module and before any epoch-start hook).
Under DDP each training batch starts by comparing the parameters that train with those DDP syncs, and where they
differ, DDP is built again around the module (``compat.rewrap_ddp``), at the same batch on every rank (the change
comes from a hook every rank runs alike), and the start of that batch says so. A parameter unfrozen during a
training step, whose gradient DDP did not sync, is refused in one line before the optimizer steps.
"""

from typing import Any

import lightning as L
import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities import rank_zero_only
from torch.nn.parallel import DistributedDataParallel

from lightkeep.compat import rewrap_ddp


class Trainable(Callback):
    """Saves which parameters train (and which BatchNorms track their statistics) in each checkpoint, sets them again
    on resume, and keeps DDP syncing exactly those that train (see the module's docstring)."""

    def __init__(self) -> None:
        self._fitting = False
        self._module: L.LightningModule | None = None
        self._params: list[tuple[str, torch.nn.Parameter]] = []  # the module's, in order
        self._synced: list[bool] | None = None  # under DDP: which of them DDP syncs (requires_grad when it was built)

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._module = pl_module
        self._fitting = stage == "fit"

    def state_dict(self) -> dict[str, Any]:
        module = self._module
        if module is None:
            return {}
        return {
            "frozen": [name for name, p in module.named_parameters() if not p.requires_grad],
            # BatchNorms (and InstanceNorms) whose statistics a freeze stopped (Lightning's ``freeze_module``)
            "untracked": [n for n, m in module.named_modules() if getattr(m, "track_running_stats", None) is False],
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # Lightning loads callback states after every callback's setup (a BaseFinetuning's freeze) and the module's
        # configure_model, and before the strategy wraps the module (DDP) and any epoch-start hook: set here, DDP is
        # built around the parameters that train, and an unfreeze the resumed epoch's start makes comes after it.
        module = self._module
        if "frozen" not in state_dict or module is None or not self._fitting:  # before engine 1.6.3: no record
            return
        frozen, untracked = set(state_dict["frozen"]), set(state_dict["untracked"])
        for name, param in module.named_parameters():
            param.requires_grad_(name not in frozen)
        for name, sub in module.named_modules():
            if hasattr(sub, "track_running_stats"):
                sub.track_running_stats = name not in untracked

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # DDP wrapped the module in the strategy's setup, after every callback's setup and the module's configure_model
        self._params = list(pl_module.named_parameters())
        ddp = isinstance(trainer.strategy, DDPStrategy) and isinstance(trainer.strategy.model, DistributedDataParallel)
        self._synced = [p.requires_grad for _, p in self._params] if ddp and trainer.world_size > 1 else None

    def on_train_batch_start(self, trainer: L.Trainer, *_: Any) -> None:
        if self._synced is None:
            return
        now = [p.requires_grad for _, p in self._params]
        if now == self._synced:
            return
        changed = [name for (name, _), a, b in zip(self._params, now, self._synced, strict=True) if a != b]
        rewrap_ddp(trainer)
        self._synced = now
        more = f", ... ({len(changed)} in all)" if len(changed) > 3 else ""
        rank_zero_only(print)(
            f"Step {trainer.global_step}: the parameters that train changed ({', '.join(changed[:3])}{more}): "
            "DistributedDataParallel built again around the module, so that it syncs their gradients",
            flush=True,
        )

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        if self._synced is None:
            return
        # a gradient DDP did not sync: the parameter was unfrozen after this batch's start (in the step itself)
        unsynced = [n for (n, p), synced in zip(self._params, self._synced, strict=True)
                    if not synced and p.requires_grad and p.grad is not None]  # fmt: skip
        if unsynced:
            raise MisconfigurationException(  # every rank alike: one line
                f"{', '.join(unsynced[:3])}{', ...' if len(unsynced) > 3 else ''} began to train during training step "
                f"{trainer.global_step} under DDP, which did not sync their gradients: the ranks would part. Unfreeze "
                "in a hook before the batch (on_train_epoch_start, on_train_batch_start: BaseFinetuning does), where "
                "the engine builds DDP again around the module"
            )
