"""Stops a diverging run before NaN or infinite gradients reach the weights or a checkpoint."""

import os
import sys
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from torch.distributed.tensor import DTensor

from lightkeep.compat_loops import logging_step
from lightkeep.compat_torch import skips_steps_on_device
from lightkeep.signals import last_checkpoint_path

READ_EVERY = 50  # optimizer steps between two host reads of the flag, where Lightning does not log per step


class StopOnNonFinite(Callback):
    """Stops training at the first step whose gradients are NaN or infinite, with the weights from before it.

    A NaN loss on any rank makes the averaged gradients NaN on every rank, so each rank reaches the same decision
    at the same step without another collective (a rank stopping alone would leave the others waiting forever);
    the host reads at steps counted alike on every rank, never "when the GPU is done". No checkpoint is written
    after the failure, and under ``precision: 16-mixed`` this stands aside (docs/checkpoints.md, 'Diverging runs').

    The check stays on the device: each step adds one sum per gradient to a sticky flag there (the first bad step's
    number, -1 while all is well). Reading it on the host makes the CPU wait for the GPU, so where the optimizer
    can skip a step on the device (fused ``Adam``/``AdamW``/``SGD``..., those with ``_step_supports_amp_scaling``:
    their kernels take GradScaler's ``found_inf`` and leave weights, moments and step counts as they were), the
    flag is handed to it as ``found_inf`` and read from a host copy made, without waiting, at the read before; every
    later step is a no-op, so the stop comes up to two reads late with the weights of the step before the bad one.
    The reads fall on the batches where Lightning logs (every ``log_every_n_steps``): the host waits for the device
    there anyway, as Lightning reads the logged values at the batch's end, so the guard adds no wait of its own.
    Before any checkpoint is written and at the end of training it is read at once (a save waits for the device
    anyway). Any other optimizer would change the weights at the bad step: for it the flag is read at every step,
    before ``optimizer.step``.

    Args:
        read_every: Optimizer steps between host reads (at steps ``0, read_every, ...``) where the optimizer skips bad
            steps on the device; ``None``: at the batches where Lightning logs, or every 50 steps when it does not.
    """

    def __init__(self, read_every: int | None = None) -> None:
        if read_every is not None and read_every < 1:
            raise ValueError(f"read_every ({read_every}) must be >= 1")
        self.read_every = read_every
        self.read_at = -1  # the logging step of the last read: one read a batch, whatever its optimizer steps
        self.batch_idx = -1  # of the batch in progress
        self.first_bad: torch.Tensor | None = None  # () int64 on the gradients' device: first bad step, or -1
        self.staged: tuple[torch.Tensor, Any] | None = None  # host copy of first_bad, and its CUDA event
        self.where: dict[int, tuple[int, int]] = {}  # step -> (epoch, batch) of the recent steps, for the message

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, idx: int) -> None:
        self.batch_idx = idx

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        if getattr(trainer.precision_plugin, "scaler", None) is not None:
            return
        step = trainer.global_step
        self.where[step] = (trainer.current_epoch, self.batch_idx)
        self.where.pop(step - 3 * self._interval(trainer), None)
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        if not grads:
            return
        # One sum per gradient (a NaN or inf anywhere makes the total non-finite), the cheapest full reduction on a
        # CPU; a norm or isfinite(...).all() costs several times as much. The optimizer's own parameter list, not
        # pl_module.parameters(), which walks every submodule (metrics included): ~170 us a step on the default MLP.
        total = torch.stack([g.detach().sum(dtype=torch.float32) for g in grads]).sum()
        if isinstance(total, DTensor):  # sharded gradients: summed over every rank's shard (one scalar all-reduce),
            total = total.full_tensor()  # so every rank flags the same step
        if self.first_bad is None or self.first_bad.device != total.device:
            self.first_bad = torch.full((), -1, dtype=torch.int64, device=total.device)
        bad_now = ~torch.isfinite(total) & (self.first_bad < 0)
        self.first_bad.copy_(torch.where(bad_now, step, self.first_bad))
        if not skips_steps_on_device(optimizer):
            self._stop_if_bad(trainer, self.first_bad.item())  # this step would change the weights: read now
            return
        found_inf = getattr(optimizer, "found_inf", None)
        if found_inf is None or found_inf.device != total.device:
            optimizer.found_inf = found_inf = torch.zeros((), dtype=torch.float32, device=total.device)
        found_inf.copy_(self.first_bad >= 0)  # the optimizer's kernel skips the step while it is 1
        if self._reads_now(trainer, step):
            self._stop_if_bad(trainer, self._read_staged())
            self._stage()

    def _interval(self, trainer: L.Trainer) -> int:
        return self.read_every or trainer.log_every_n_steps or READ_EVERY

    def _reads_now(self, trainer: L.Trainer, step: int) -> bool:
        """Whether this step reads the staged flag: at steps ``0, read_every, ...``, or by default at the batches
        where Lightning logs, each once (its logger connector's ``should_update_logs``, without a forced stop)."""
        if self.read_every is not None or trainer.log_every_n_steps < 1:
            return step % self._interval(trainer) == 0
        logged = logging_step(trainer)
        if logged == self.read_at or (logged + 1) % trainer.log_every_n_steps:
            return False
        self.read_at = logged
        return True

    def _stage(self) -> None:
        """Starts a copy of the flag into host memory that nothing waits for (pinned memory on a GPU)."""
        assert self.first_bad is not None
        cuda = self.first_bad.is_cuda
        host = torch.empty((), dtype=torch.int64, pin_memory=cuda)
        host.copy_(self.first_bad, non_blocking=cuda)
        event = torch.cuda.Event() if cuda else None
        if event is not None:
            event.record()
        self.staged = (host, event)

    def _read_staged(self) -> int:
        """The flag as the last ``_stage`` copied it: read_every steps old, so its copy is long done."""
        if self.staged is None:
            return -1
        host, event = self.staged
        if event is not None:
            event.synchronize()
        return int(host)  # a host tensor: no device sync

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: Any = None) -> None:
        if self.first_bad is not None:  # raising here writes nothing: the file is written after the hooks
            self._stop_if_bad(trainer, self.first_bad.item())

    on_train_end = on_save_checkpoint  # read at once, as before a save

    def _stop_if_bad(self, trainer: L.Trainer, first_bad: int) -> None:
        if first_bad < 0:
            return
        last = last_checkpoint_path(trainer)
        kept = (
            f"The checkpoints on disk are from earlier steps (latest: {last}). "
            if last and os.path.exists(last)
            else ""
        )
        epoch, batch = self.where.get(first_bad, (trainer.current_epoch, self.batch_idx))
        message = (
            f"error: the gradients became NaN or infinite at step {first_bad} (epoch {epoch}, batch {batch}); "
            f"training stopped before updating the weights. {kept}Fix: lower the learning rate or lengthen its warmup, "
            "check the data for NaN/inf, then resume with --ckpt_path last or start again."
        )
        if trainer.is_global_zero:
            print(message, file=sys.stderr, flush=True)
        raise SystemExit(1)  # no traceback; Lightning still runs its on_exception hooks and teardown
