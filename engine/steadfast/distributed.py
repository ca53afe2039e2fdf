"""Process-group hygiene for multi-process runs."""

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback


class DestroyProcessGroup(Callback):
    """Destroys the default process group when a stage ends.

    A gloo process group left alive at interpreter exit can abort the process ("terminate called without an
    active exception", exit -6) after a successful run; torchrun then takes the finished run for a crash and
    restarts it. A later stage in the same process initialises a new group.
    """

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            trainer.strategy.barrier("destroy_process_group")
            torch.distributed.destroy_process_group()
