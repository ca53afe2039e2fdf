"""The LightningModule: loss, metrics, optimizer and LR schedule around any classification network."""

import math
from typing import Any, Literal

import lightning as L
import torch
import torch.nn.functional as F
from jsonargparse import lazy_instance
from lightning.pytorch.utilities import rank_zero_only
from torch import nn
from torchmetrics import MeanMetric
from torchmetrics.classification import MulticlassAccuracy

from lightkeep import LinearWarmupCosineAnnealingLR
from project.nets import MLP

# The default net as the config shows it (`--print_config`); a Classifier built in Python gets an MLP of its own.
DEFAULT_NET = lazy_instance(MLP)


class Classifier(L.LightningModule):
    """Trains ``net`` with cross-entropy, AdamW and a linear-warmup cosine schedule.

    Args:
        net: The network, mapping a batch of inputs to ``(B, num_classes)`` logits.
        num_classes: Number of classes, for the accuracy metric.
        lr: Peak learning rate of AdamW, reached at the end of the warmup.
        weight_decay: AdamW's decoupled weight decay.
        warmup: Length of the linear warmup, in ``schedule_unit``.
        max_schedule: Length of warmup plus cosine decay, in ``schedule_unit``; after it the rate stays at
            ``eta_min``. ``None``: the whole run (``max_epochs``, or ``max_steps`` when that ends it sooner).
        schedule_unit: Unit of ``warmup`` and ``max_schedule``; epochs become the run's real steps per epoch when
            ``interval`` is ``step``.
        interval: Update the rate after every optimizer ``step`` (smooth), or once per ``epoch`` (pl_bolts style).
        warmup_start_lr: Rate of the first warmup step. ``None``: one warmup increment (``lr / warmup``).
        eta_min: Final rate of the cosine decay.
        sample_images: Validation images shown in TensorBoard with their predictions each epoch (0: none).
    """

    def __init__(
        self,
        net: nn.Module = DEFAULT_NET,
        num_classes: int = 10,
        lr: float = 3e-3,
        weight_decay: float = 0.01,
        warmup: int = 2,
        max_schedule: int | None = None,
        schedule_unit: Literal["epoch", "step"] = "epoch",
        interval: Literal["step", "epoch"] = "step",
        warmup_start_lr: float | None = None,
        eta_min: float = 0.0,
        sample_images: int = 16,
    ) -> None:
        super().__init__()
        if not 0 < lr < math.inf:  # nan and inf too (YAML's .nan, .inf, 1e999 are floats)
            raise ValueError(f"lr ({lr}) must be a finite number > 0")
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
        self.save_hyperparameters(ignore=["net", "sample_images"])  # the net is saved as weights
        self.sample_images = sample_images
        self.net = MLP() if net is DEFAULT_NET else net
        # Metric objects, not per-step means, for the epoch values: torchmetrics reduces them over every sample of
        # every rank, which equals the single-process value under DDP (uneven last batches included).
        # validate_args=False / nan_strategy="disable": no input checks on every update, each a host-device sync on a
        # GPU (cross_entropy has already checked the labels; a NaN loss stops training anyway).
        self.metrics = nn.ModuleDict()
        for stage in ("train", "val", "test"):
            self.metrics[f"{stage}_acc"] = MulticlassAccuracy(num_classes, average="micro", validate_args=False)
            self.metrics[f"{stage}_loss"] = MeanMetric(nan_strategy="disable")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def _shared_step(self, batch: tuple[torch.Tensor, torch.Tensor], stage: str) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = batch  # (B, ...), (B,)
        logits = self(x)  # (B, num_classes)
        losses = F.cross_entropy(logits, y, reduction="none")  # (B,)
        loss = losses.mean()
        acc, mean_loss = self.metrics[f"{stage}_acc"], self.metrics[f"{stage}_loss"]
        acc.update(logits, y)
        # per sample, not (batch mean, weight=B): with nan_strategy="disable" torchmetrics 1.9 ignores a weight
        mean_loss.update(losses.detach())
        if stage == "train":
            self.log("train/loss", loss, prog_bar=True)  # this rank's loss at each step: the training curve
        self.log(f"{stage}/acc", acc, on_step=False, on_epoch=True, prog_bar=stage != "train")
        self.log("train/loss_epoch" if stage == "train" else f"{stage}/loss", mean_loss, on_epoch=True,
                 on_step=False)  # fmt: skip
        return loss, logits

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self._shared_step(batch, "train")[0]

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        _, logits = self._shared_step(batch, "val")
        if batch_idx == 0:
            self._log_sample_predictions(*batch, logits)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self._shared_step(batch, "test")

    def predict_step(self, batch: Any, batch_idx: int) -> dict[str, torch.Tensor]:
        x = batch[0] if isinstance(batch, (tuple, list)) else batch
        probs = self(x).softmax(dim=-1)  # (B, num_classes)
        return {"pred": probs.argmax(dim=-1), "prob": probs}

    @rank_zero_only
    def _log_sample_predictions(self, x: torch.Tensor, y: torch.Tensor, logits: torch.Tensor) -> None:
        """A few validation images and their predicted labels in TensorBoard: what only one process should write.
        From this step's logits: under sharding, a forward on rank 0 alone would wait for the other ranks."""
        writer, n = getattr(self.logger, "experiment", None), self.sample_images
        if n == 0 or not hasattr(writer, "add_images"):
            return
        x, y, pred = x[:n].cpu(), y[:n].tolist(), logits[:n].argmax(-1).tolist()
        images = x if x.dim() == 4 else x.reshape(len(x), 1, 1, -1)  # (N, C, H, W) for TensorBoard
        writer.add_images("val/samples", images.float().clamp(0, 1), self.global_step)
        rows = "\n".join(f"| {i} | {t} | {p} |" for i, (t, p) in enumerate(zip(y, pred, strict=True)))
        writer.add_text("val/predictions", "| # | label | predicted |\n|---|---|---|\n" + rows, self.global_step)

    def configure_optimizers(self) -> dict[str, Any]:
        hp = self.hparams
        # fused: one kernel a step, which can skip a step on the device (the NaN guard then needs no read per step)
        optimizer = torch.optim.AdamW(self.parameters(), lr=hp.lr, weight_decay=hp.weight_decay, fused=True)
        scheduler = LinearWarmupCosineAnnealingLR(
            optimizer, warmup_epochs=hp.warmup, max_epochs=hp.max_schedule, warmup_start_lr=hp.warmup_start_lr,
            eta_min=hp.eta_min, unit=hp.schedule_unit,
        )  # fmt: skip
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": hp.interval, "name": "lr"}}
