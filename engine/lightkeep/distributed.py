"""Process-group hygiene for multi-process runs."""

import atexit
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.exceptions import SIGTERMException


class DestroyProcessGroup(Callback):
    """Destroys the default process group when a stage ends, or at the exit of a process that a preemption or Ctrl-C
    stopped.

    A gloo process group left alive at interpreter exit can abort the process ("terminate called without an
    active exception", exit -6 instead of the run's own code): its worker threads still hold work whose tensors are
    freed while the interpreter is torn down (https://github.com/pytorch/pytorch/pull/179291). torchrun then takes a
    finished run for a crash and restarts it; a scheduler that requeues on a preemption's 143 sees 134. A later stage
    in the same process initialises a new group.
    """

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        atexit.unregister(_destroy)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            trainer.strategy.barrier("destroy_process_group")
            torch.distributed.destroy_process_group()

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        # A stop every rank agreed on (a preemption or Ctrl-C: SIGTERMException, lightkeep.signals) skips teardown
        # too, and the callbacks after this one still need the group (the save gathers every rank's RNG states): it
        # goes at the process's exit, while the interpreter is whole (atexit handlers run first). Not after another
        # error: destroying a group waits for its collectives in flight, which a dead peer never finishes (that
        # exit is lightkeep.rank_failures'). No barrier: the ranks' exits need not meet.
        if not isinstance(exception, SIGTERMException):
            return
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            atexit.unregister(_destroy)  # once, however many stages failed
            atexit.register(_destroy)


def every_rank(value: Any) -> list[Any]:
    """``value`` as each rank has it, in rank order (``[value]`` in one process). Call it on every rank."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return [value]
    every: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(every, value)
    return every


def _destroy() -> None:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
