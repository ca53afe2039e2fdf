"""The run's config file, saved once per invocation without ever overwriting the one a run began with."""

import os

import lightning as L
from lightning.pytorch.cli import SaveConfigCallback


class SaveConfigOnce(SaveConfigCallback):
    """Saves the run's config as ``config.yaml``; a resumed run adds ``config.1.yaml``, ``config.2.yaml``, ...

    Lightning's callback refuses to start when ``config.yaml`` exists, which a resumed run always meets;
    overwriting it would lose how the run began. Only rank 0 looks at the folder; the choice is broadcast.
    """

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self.already_saved or not self.save_to_log_dir:
            return super().setup(trainer, pl_module, stage)
        log_dir = trainer.log_dir
        name = "config.yaml"
        if trainer.is_global_zero and log_dir is not None:
            n = 0
            while os.path.exists(os.path.join(log_dir, name)):
                n += 1
                name = f"config.{n}.yaml"
        self.config_filename = trainer.strategy.broadcast(name)
        super().setup(trainer, pl_module, stage)
