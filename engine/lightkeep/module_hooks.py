"""The module's own hooks at the points where checkpoints are saved: ``on_train_batch_end`` and
``on_validation_end`` of the module run before the checkpoint callbacks' (``ModelCheckpoint``, the engine's files),
so what the module changes there is in the checkpoint saved at that point, and a resume from it is exact: an EMA of
the weights updated at each batch end (Lightning's order: one update behind), weights that ``on_validation_start``
swapped for their average and ``on_validation_end`` swaps back (Lightning's order: the average saved as the weights
at every validation that saves, 2e-2 off after a resume, measured). Every other callback that is not a checkpoint
still runs before the module's hook, as in Lightning (the module's ``configure_callbacks`` too); a module hook that
reads a ``ModelCheckpoint``'s ``best_model_score`` there now sees the previous point's."""

from typing import Any

import lightning as L
from lightning.pytorch import Callback
from lightning.pytorch.callbacks import Checkpoint
from lightning.pytorch.trainer.states import TrainerFn

from lightkeep.compat_loops import HOOKS_BEFORE_SAVES, call_the_modules_hook_before_the_saves, forget_the_early_calls


def own_hook(obj: Any, name: str, base: type) -> bool:
    """Whether ``obj`` (a callback, a module) has hook ``name`` written outside Lightning and the engine (a subclass
    of Lightning's callback that keeps Lightning's hook has not)."""
    hook = getattr(type(obj), name, None)
    where = getattr(hook, "__module__", "") or ""
    return hook is not getattr(base, name) and not where.startswith(("lightning.", "lightkeep."))


class ModuleHooksBeforeSaves(Callback):
    """Moves itself, at a fit's setup, after every other callback that is not a checkpoint and before
    ``saves_at_batch_end`` (the engine's preemption callback, whose SLURM handler saves there) and the checkpoint
    callbacks, which Lightning lists after all others."""

    def __init__(self, saves_at_batch_end: Callback | None = None) -> None:
        self.saves_at_batch_end = saves_at_batch_end
        self._own: set[str] = set()

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        forget_the_early_calls(pl_module)  # an earlier fit that ended in an exception before its on_exception here
        fitting = trainer.state.fn == TrainerFn.FITTING  # validate and test save nothing: Lightning's order there
        self._own = {name for name in HOOKS_BEFORE_SAVES if fitting and own_hook(pl_module, name, L.LightningModule)}
        if self._own:  # a new list: Lightning's loop over the old one calls the rest of this setup as listed
            late = [c for c in (self, self.saves_at_batch_end) if c is not None]
            checkpoints = [c for c in trainer.callbacks if isinstance(c, Checkpoint)]
            others = [c for c in trainer.callbacks if not isinstance(c, Checkpoint) and all(c is not x for x in late)]
            trainer.callbacks = [*others, *late, *checkpoints]

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if "on_train_batch_end" in self._own:
            call_the_modules_hook_before_the_saves(pl_module, "on_train_batch_end", *args)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if "on_validation_end" in self._own:
            call_the_modules_hook_before_the_saves(pl_module, "on_validation_end")

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        forget_the_early_calls(pl_module)

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        forget_the_early_calls(pl_module)
