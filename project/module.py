"""The LightningModule: loss, metrics, optimizer and LR schedule around any classification network."""

from typing import Any, Literal

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torchmetrics import MeanMetric
from torchmetrics.classification import MulticlassAccuracy

from project.schedule import LinearWarmupCosineAnnealingLR

STAGES = ("train", "val", "test")


class Classifier(L.LightningModule):
    """Trains ``net`` with cross-entropy, AdamW and a linear-warmup cosine schedule.

    Args:
        net: The network, mapping a batch of inputs to ``(B, num_classes)`` logits.
        num_classes: Number of classes, for the accuracy metric (linked from the data module).
        lr: Peak learning rate of AdamW, reached at the end of the warmup.
        weight_decay: AdamW's decoupled weight decay.
        warmup: Length of the linear warmup, in ``schedule_unit``.
        max_schedule: Length of warmup plus cosine decay, in ``schedule_unit``; after it the rate stays at
            ``eta_min``. ``None``: the trainer's ``max_epochs`` (or ``max_steps`` when the unit is ``step``).
        schedule_unit: Unit of ``warmup`` and ``max_schedule``. Epochs are converted to steps with the trainer's
            real number of optimizer steps per epoch when ``interval`` is ``step``.
        interval: Update the rate after every optimizer ``step`` (smooth), or once per ``epoch`` (pl_bolts style).
        warmup_start_lr: Rate of the first warmup step. ``None``: one warmup increment (``lr / warmup``), so no
            step ever runs at rate 0.
        eta_min: Final rate of the cosine decay.
    """

    def __init__(
        self,
        net: nn.Module,
        num_classes: int = 10,
        lr: float = 2e-4,
        weight_decay: float = 0.01,
        warmup: int = 15,
        max_schedule: int | None = None,
        schedule_unit: Literal["epoch", "step"] = "epoch",
        interval: Literal["step", "epoch"] = "step",
        warmup_start_lr: float | None = None,
        eta_min: float = 0.0,
    ) -> None:
        super().__init__()
        if lr <= 0:
            raise ValueError(f"lr ({lr}) must be > 0")
        if weight_decay < 0:
            raise ValueError(f"weight_decay ({weight_decay}) must be >= 0")
        if warmup < 0:
            raise ValueError(f"warmup ({warmup}) must be >= 0")
        if max_schedule is not None and warmup > max_schedule:
            raise ValueError(f"warmup ({warmup}) must be <= max_schedule ({max_schedule})")
        if interval == "epoch" and schedule_unit == "step":
            raise ValueError("interval='epoch' steps the schedule once per epoch: give it schedule_unit='epoch'")
        if num_classes < 2:
            raise ValueError(f"num_classes ({num_classes}) must be >= 2")
        self.save_hyperparameters(ignore=["net"])
        self.net = net
        metrics: dict[str, nn.Module] = {}
        for stage in STAGES:
            metrics[f"{stage}_acc"] = MulticlassAccuracy(num_classes, average="micro")
            metrics[f"{stage}_loss"] = MeanMetric()
        self.metrics = nn.ModuleDict(metrics)
        for name in ("train_acc", "train_loss"):
            # in the checkpoint, so an epoch's train metrics survive a mid-epoch resume
            self.metrics[name].persistent(True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def _shared_step(self, batch: tuple[torch.Tensor, torch.Tensor], stage: str) -> torch.Tensor:
        x, y = batch  # (B, ...), (B,)
        logits = self(x)  # (B, num_classes)
        loss = F.cross_entropy(logits, y)
        acc, mean_loss = self.metrics[f"{stage}_acc"], self.metrics[f"{stage}_loss"]
        acc.update(logits, y)
        mean_loss.update(loss.detach(), weight=len(y))
        # Metric objects are reduced by torchmetrics over every sample of every rank at epoch end (exact under
        # DDP); the per-step train loss is this rank's own, which is what the curve needs.
        if stage == "train":
            self.log("train/loss", loss, on_step=True, on_epoch=False, prog_bar=True)
        self.log(f"{stage}/acc", acc, on_step=False, on_epoch=True, prog_bar=stage != "train")
        loss_name = "train/loss_epoch" if stage == "train" else f"{stage}/loss"
        self.log(loss_name, mean_loss, on_step=False, on_epoch=True)
        return loss

    def on_train_epoch_start(self) -> None:
        # A no-op in a straight run (Lightning resets logged metrics at epoch end), but a checkpoint taken after
        # validation, before that reset, would otherwise carry the finished epoch into the next after a resume.
        self.metrics["train_acc"].reset()
        self.metrics["train_loss"].reset()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self._shared_step(batch, "train")

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self._shared_step(batch, "val")

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self._shared_step(batch, "test")

    def predict_step(self, batch: Any, batch_idx: int) -> dict[str, torch.Tensor]:
        x = batch[0] if isinstance(batch, (tuple, list)) else batch
        probs = self(x).softmax(dim=-1)  # (B, num_classes)
        return {"pred": probs.argmax(dim=-1), "prob": probs}

    def configure_optimizers(self) -> dict[str, Any]:
        hp = self.hparams
        optimizer = torch.optim.AdamW(self.parameters(), lr=hp.lr, weight_decay=hp.weight_decay)
        # The horizon is set again in on_train_start, once the steps per epoch are known; the values here only
        # need to be valid. (Reading trainer.estimated_stepping_batches here would load the train data early and
        # drop a resumable loader's state: Lightning issue #20550.)
        scheduler = LinearWarmupCosineAnnealingLR(optimizer, 0, 1, eta_min=hp.eta_min)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": hp.interval, "name": "lr"},
        }

    def on_train_start(self) -> None:
        hp, trainer = self.hparams, self.trainer
        if hp.max_schedule is not None:
            max_schedule = hp.max_schedule
        elif hp.schedule_unit == "epoch":
            max_schedule = trainer.max_epochs
        else:
            max_schedule = trainer.max_steps
        if max_schedule is None or max_schedule < 0:
            raise ValueError(
                f"max_schedule is None and the trainer sets no max_{hp.schedule_unit}s: set model.max_schedule"
            )
        if hp.warmup > max_schedule:
            raise ValueError(f"warmup ({hp.warmup}) must be <= max_schedule ({max_schedule} {hp.schedule_unit}s)")
        per_unit = 1
        if hp.schedule_unit == "epoch" and hp.interval == "step":
            per_unit = self.steps_per_epoch()
        warmup, total = hp.warmup * per_unit, max_schedule * per_unit
        scheduler = trainer.lr_scheduler_configs[0].scheduler
        scheduler.warmup_start_lr = hp.lr / max(warmup, 1) if hp.warmup_start_lr is None else hp.warmup_start_lr
        scheduler.set_horizon(warmup, total)

    def steps_per_epoch(self) -> int:
        """Optimizer steps per epoch on this rank, as Lightning counts them (limits and accumulation included)."""
        batches = self.trainer.num_training_batches
        if batches == float("inf"):
            raise ValueError("the train loader has no length: give warmup and max_schedule in steps")
        return max(1, -(-int(batches) // self.trainer.accumulate_grad_batches))
