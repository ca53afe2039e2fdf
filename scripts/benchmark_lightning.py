"""Side (b) of scripts/benchmark.py: the Lightning a user would write without the template.

    python scripts/benchmark_lightning.py RESULT.json SPEC_JSON    # started by benchmark.py, in a fresh interpreter

A plain LightningModule (the same MLP, AdamW, the same warmup-cosine schedule stepped per step, ``self.log`` of the
step loss and the epoch metrics), a plain ``TensorBoardLogger``, a ``ModelCheckpoint`` every 2 epochs as the blog
saves, ``LearningRateMonitor`` as the other two sides log the rate, Lightning's TQDM progress bar, and the blog's
loaders from ``benchmark_hand.digits_loaders`` (same batches, same order). Nothing of ``lightkeep`` runs here but
the schedule. ``benchmark_timer.BenchmarkTimer`` times it, over the same span as the template's.
"""

import json
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from benchmark_hand import digits_loaders  # scripts/benchmark_hand.py, on the path benchmark.py gives us
from benchmark_timer import BenchmarkTimer
from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint, TQDMProgressBar
from lightning.pytorch.loggers import TensorBoardLogger
from torch import nn

from lightkeep.schedule import LinearWarmupCosineAnnealingLR
from project.nets import MLP


class PlainClassifier(L.LightningModule):
    """Cross-entropy, AdamW and a linear-warmup cosine schedule over ``warmup`` and ``epochs`` epochs."""

    def __init__(self, net: nn.Module, lr: float, weight_decay: float, warmup: int, eta_min: float) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["net"])
        self.net = net

    def _shared_step(self, batch: Any, stage: str) -> torch.Tensor:
        x, y = batch  # (B, 1, 8, 8), (B,)
        logits = self.net(x)  # (B, 10)
        loss = F.cross_entropy(logits, y)
        acc = (logits.argmax(-1) == y).float().mean()
        if stage == "train":
            self.log("train/loss", loss, prog_bar=True)
            self.log("train/acc", acc, on_step=False, on_epoch=True, batch_size=len(y))
        else:
            self.log("val/loss", loss, batch_size=len(y))
            self.log("val/acc", acc, prog_bar=True, batch_size=len(y))
        return loss

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self._shared_step(batch, "train")

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self._shared_step(batch, "val")

    def configure_optimizers(self) -> dict[str, Any]:
        hp = self.hparams
        optimizer = torch.optim.AdamW(self.parameters(), lr=hp.lr, weight_decay=hp.weight_decay, fused=True)  # as (c)
        total = self.trainer.estimated_stepping_batches
        warmup = hp.warmup * total // self.trainer.max_epochs
        scheduler = LinearWarmupCosineAnnealingLR(optimizer, warmup, total, hp.lr / max(warmup, 1), hp.eta_min)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step", "name": "lr"}}


def main(out: Path, spec: dict[str, Any]) -> None:
    L.seed_everything(spec["seed"])
    net = MLP(hidden_sizes=spec["hidden_sizes"], dropout=spec["dropout"])
    model = PlainClassifier(net, spec["lr"], spec["weight_decay"], spec["warmup"], spec["eta_min"])
    train_loader, val_loader = digits_loaders(spec)
    trainer = L.Trainer(
        devices=1,
        max_epochs=spec["epochs"],
        deterministic=spec["deterministic"],
        log_every_n_steps=1,
        logger=TensorBoardLogger("runs"),
        callbacks=[
            ModelCheckpoint(every_n_epochs=2, save_top_k=-1),
            LearningRateMonitor(logging_interval="step"),
            # Lightning's default without rich, redrawn every batch. With rich installed (the loggers extra has it)
            # Lightning picks RichProgressBar instead; the tqdm bar is what the other two sides draw.
            TQDMProgressBar(),
            BenchmarkTimer(str(out)),
        ],
    )
    trainer.fit(model, train_loader, val_loader)


if __name__ == "__main__":
    main(Path(sys.argv[1]), json.loads(sys.argv[2]))
