"""The LightningModule: loss, metrics, optimizer and LR schedule around any classification network."""

from typing import Any, Literal

import lightning as L
import torch
import torch.nn.functional as F
from jsonargparse import lazy_instance
from lightning.pytorch.utilities import rank_zero_only
from torch import nn
from torch.distributed.fsdp import fully_shard
from torchmetrics import MeanMetric
from torchmetrics.classification import MulticlassAccuracy

from project.engine.schedule import LinearWarmupCosineAnnealingLR
from project.nets import MLP

STAGES = ("train", "val", "test")
# The default net as the config shows it (`--print_config`, the run's config.yaml); a Classifier built in Python
# with it gets an MLP of its own (one default object would be shared by every such Classifier).
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
            ``eta_min``. ``None``: the trainer's ``max_epochs`` (or ``max_steps`` when the unit is ``step``).
        schedule_unit: Unit of ``warmup`` and ``max_schedule``. Epochs are converted to steps with the trainer's
            real number of optimizer steps per epoch when ``interval`` is ``step``.
        interval: Update the rate after every optimizer ``step`` (smooth), or once per ``epoch`` (pl_bolts style).
        warmup_start_lr: Rate of the first warmup step. ``None``: one warmup increment (``lr / warmup``), so no
            step ever runs at rate 0.
        eta_min: Final rate of the cosine decay.
        validation: ``distributed``: every rank evaluates its share of the validation/test set (no sample
            twice, see ``make_loader``) and torchmetrics reduces over all samples, which equals the
            single-process result. ``rank_zero``: rank 0 evaluates the whole set alone, the blog's way, for
            outputs that cannot be merged; the others wait and receive its numbers, so checkpointing and early
            stopping decide alike on every rank. (With ``rank_zero`` a net with buffers, e.g. BatchNorm, needs
            DDP's ``broadcast_buffers: false``: DDP would otherwise broadcast them in rank 0's forward alone.)
        sample_images: Validation images shown in TensorBoard with their predictions each epoch (0: none).
        compile: Compile the net with ``torch.compile`` (in place, so checkpoints keep the same keys and load into
            an uncompiled net). Pays off on GPUs for nets that run long enough to amortise the compile time.
        float32_matmul_precision: ``torch.set_float32_matmul_precision`` for float32 matmuls: ``high`` lets
            Ampere+ GPUs use TF32 tensor cores (about 8x the float32 throughput, 10-bit mantissa); ``None`` leaves
            PyTorch's setting alone. (With ``precision: bf16-mixed`` the matmuls run in bfloat16 anyway.)
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
        validation: Literal["distributed", "rank_zero"] = "distributed",
        sample_images: int = 16,
        compile: bool = False,
        float32_matmul_precision: Literal["highest", "high", "medium"] | None = None,
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
        # Not saved: the net is saved as weights; how to evaluate is a choice of each run, and LightningCLI would
        # let a checkpoint's saved value override the command line (`validate --model.validation rank_zero`).
        # Same for the speed switches: they change how fast, not what is computed.
        self.save_hyperparameters(ignore=["net", "validation", "sample_images", "compile", "float32_matmul_precision"])
        self.sample_images = sample_images
        self.compile_net = compile
        self.float32_matmul_precision = float32_matmul_precision
        self.net = MLP() if net is DEFAULT_NET else net
        # Read by make_loader: rank 0 gets the whole eval set, the others a placeholder (see _waits).
        self.evaluates_on_rank_zero = validation == "rank_zero"
        metrics: dict[str, nn.Module] = {}
        for stage in STAGES:
            sync = stage == "train" or not self.evaluates_on_rank_zero  # rank 0 alone must not wait for the others
            # validate_args=False: no input checks on every update (cross_entropy has already checked the labels)
            metrics[f"{stage}_acc"] = MulticlassAccuracy(
                num_classes, average="micro", sync_on_compute=sync, validate_args=False
            )
            metrics[f"{stage}_loss"] = MeanMetric(sync_on_compute=sync)
        self.metrics = nn.ModuleDict(metrics)
        self._samples: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        for name in ("train_acc", "train_loss"):
            # in the checkpoint, so an epoch's train metrics survive a mid-epoch resume
            self.metrics[name].persistent(True)

    def setup(self, stage: str) -> None:
        # Here, in every rank's process, not in __init__: the precision is a per-process setting. Compiling is
        # lazy: the graph is traced at the first forward, after Lightning has moved the net to its device.
        if self.float32_matmul_precision is not None:
            torch.set_float32_matmul_precision(self.float32_matmul_precision)
        if self.compile_net:
            self.net.compile()

    def configure_model(self) -> None:
        # Sharded training (configs/fsdp.yaml): each layer's weights, gradients and optimizer state are split over
        # the ranks and gathered only for its own forward and backward (FSDP2). Under DDP or on one device there is
        # no device mesh and nothing to do.
        if self.device_mesh is None:
            return
        mesh = self.device_mesh["data_parallel"]
        for layer in self.net.modules():
            if layer is not self.net and any(True for _ in layer.parameters(recurse=False)):
                fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def _shared_step(self, batch: tuple[torch.Tensor, torch.Tensor], stage: str) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = batch  # (B, ...), (B,)
        logits = self(x)  # (B, num_classes)
        loss = F.cross_entropy(logits, y)
        # Metric objects, not per-step means, for the epoch values: torchmetrics reduces them over every sample of
        # every rank, which equals the single-process value under DDP (uneven last batches included).
        self.metrics[f"{stage}_acc"].update(logits, y)
        self.metrics[f"{stage}_loss"].update(loss.detach(), weight=len(y))
        if stage == "train":
            self.log("train/loss", loss, prog_bar=True)  # this rank's loss at each step: the training curve
        return loss, logits

    def _log_epoch_metrics(self, stage: str) -> None:
        if stage != "train" and self.evaluates_on_rank_zero:
            self._log_rank_zero_result(stage)
            return
        self.log(f"{stage}/acc", self.metrics[f"{stage}_acc"], prog_bar=stage != "train")
        self.log("train/loss_epoch" if stage == "train" else f"{stage}/loss", self.metrics[f"{stage}_loss"])

    def _log_rank_zero_result(self, stage: str) -> None:
        acc, mean_loss = self.metrics[f"{stage}_acc"], self.metrics[f"{stage}_loss"]
        if self.trainer.is_global_zero:
            result = torch.stack([acc.compute(), mean_loss.compute()]).float()
        else:
            result = torch.zeros(2, device=self.device)
        # the others reach this broadcast at once and wait here, running no collective while rank 0 evaluates
        result = self.trainer.strategy.broadcast(result, src=0)
        self.log(f"{stage}/acc", result[0], prog_bar=True)
        self.log(f"{stage}/loss", result[1])
        acc.reset()
        mean_loss.reset()

    def on_train_epoch_end(self) -> None:
        self._log_epoch_metrics("train")

    def on_validation_epoch_end(self) -> None:
        self._log_epoch_metrics("val")
        self._log_sample_predictions()

    def on_test_epoch_end(self) -> None:
        self._log_epoch_metrics("test")

    @rank_zero_only
    def _log_sample_predictions(self) -> None:
        """Rank 0 alone shows a few validation images and their predicted labels in TensorBoard.

        The place for anything that only one process should produce: images, generated samples, tables.
        """
        writer = getattr(self.logger, "experiment", None)
        if self.sample_images == 0 or self._samples is None or not hasattr(writer, "add_images"):
            return
        x, y, pred = self._samples
        images = x if x.dim() == 4 else x.reshape(len(x), 1, 1, -1)  # (N, C, H, W) for TensorBoard
        writer.add_images("val/samples", images.float().clamp(0, 1), self.global_step)
        rows = [f"| {i} | {t} | {p} |" for i, (t, p) in enumerate(zip(y.tolist(), pred.tolist(), strict=True))]
        writer.add_text(
            "val/predictions", "| # | label | predicted |\n|---|---|---|\n" + "\n".join(rows), self.global_step
        )
        self._samples = None

    def on_train_epoch_start(self) -> None:
        # A no-op in a straight run (Lightning resets logged metrics at epoch end), but a checkpoint taken after
        # validation, before that reset, would otherwise carry the finished epoch into the next after a resume.
        self.metrics["train_acc"].reset()
        self.metrics["train_loss"].reset()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self._shared_step(batch, "train")[0]

    def _waits(self) -> bool:
        """Rank-zero mode, other ranks: their loader holds one placeholder sample, only so that Lightning runs
        their epoch-end hooks, where they receive rank 0's result. They compute nothing."""
        return self.evaluates_on_rank_zero and not self.trainer.is_global_zero

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        if self._waits():
            return
        _, logits = self._shared_step(batch, "val")
        if batch_idx == 0 and self.trainer.is_global_zero and self.sample_images:
            # from this step's logits: under sharding, a forward on rank 0 alone would wait for the other ranks
            x, y = batch
            n = self.sample_images
            self._samples = (x[:n].cpu(), y[:n].cpu(), logits[:n].argmax(-1).cpu())

    def test_step(self, batch: Any, batch_idx: int) -> None:
        if not self._waits():
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
        # The schedule's length is known only now (epochs, steps per epoch, limits, accumulation, a short debug run).
        hp = self.hparams
        self.lr_schedulers().fit_to(
            self.trainer, hp.warmup, hp.max_schedule, hp.schedule_unit, hp.interval, hp.lr, hp.warmup_start_lr
        )
