"""Faults and probes that tests inject into real runs (`--trainer.callbacks+=tests.faults.KillAt`), not product code."""

import errno
import io
import math
import os
import signal
from pathlib import Path
from typing import Any, BinaryIO

import lightning as L
import torch

from lightkeep.checkpoint_io import AtomicCheckpointIO, wait_for_writes
from lightkeep.last_checkpoint import LastCheckpoint
from lightkeep.sharded.strategy import ShardedStrategy


class KillAt(L.Callback):
    """Kills the process when optimizer step ``step`` is about to run, as a crash or a ``kill -9`` would.

    Args:
        step: Global step at which to die (before the batch runs; checkpoints of earlier steps are on disk).
        sig: Signal to send to itself (9 = SIGKILL: no handler, no cleanup, unflushed logs lost).
        rank: Only this global rank dies (None: every rank).
        once_marker: If given, die only when this file does not exist yet, and create it: a restarted run
            (torchrun --max-restarts) then goes through.
        settle: First wait until the background checkpoint writes are on disk, so that the newest checkpoint is
            the one the test expects whatever the machine's load.
        after: Batches of that step let through first (with gradient accumulation: die in the middle of a step).
    """

    def __init__(
        self, step: int, sig: int = 9, rank: int | None = None, once_marker: str | None = None, settle: bool = False,
        after: int = 0,
    ) -> None:  # fmt: skip
        self.step, self.sig, self.rank, self.once_marker, self.settle = step, sig, rank, once_marker, settle
        self.after = after

    def on_train_batch_start(self, trainer: L.Trainer, *_: object) -> None:
        if trainer.global_step != self.step or self.rank not in (None, trainer.global_rank):
            return
        if self.after > 0:
            self.after -= 1
            return
        if self.once_marker is not None:
            if Path(self.once_marker).exists():
                return
            Path(self.once_marker).touch()
        if self.settle:
            wait_for_writes(trainer)
        os.kill(os.getpid(), signal.Signals(self.sig))


def kill_at(step: int, sig: int = 9, settle: bool = False, **more: object) -> list[str]:
    """The command-line arguments that add :class:`KillAt` to a run (``more``: its other arguments, e.g. ``rank``)."""
    args = {"step": step, "sig": sig, "settle": str(settle).lower(), **more}
    return ["--trainer.callbacks+=tests.faults.KillAt", *(f"--trainer.callbacks.{k}={v}" for k, v in args.items())]


class LastDueAt(L.Callback):
    """Makes the engine's ``last.ckpt`` timer due at the first batch of the optimizer step after ``step``, as its
    interval running out there would (with gradient accumulation: in the middle of that step)."""

    def __init__(self, step: int) -> None:
        self.step, self.done = step, False

    def on_train_batch_start(self, trainer: L.Trainer, *_: object) -> None:
        if trainer.global_step == self.step and not self.done:
            self.done = True
            for callback in trainer.callbacks:
                if isinstance(callback, LastCheckpoint):
                    callback._since = -math.inf


class SignalInValidation(L.Callback):
    """Sends ``sig`` to this process during the second validation batch of epoch ``epoch`` (not the sanity check)."""

    def __init__(self, epoch: int, sig: int = 15) -> None:
        self.epoch, self.sig = epoch, sig

    def on_validation_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx, *_):
        if not trainer.sanity_checking and trainer.current_epoch == self.epoch and batch_idx == 1:
            os.kill(os.getpid(), signal.Signals(self.sig))


class CountEvalSamples(L.Callback):
    """Test probe: each rank writes how many validation/test samples it evaluated to ``out_dir/rank{R}.txt``.

    Read from the module's loss metric (its summed weights), before the module resets it at epoch end.
    """

    def __init__(self, out_dir: str) -> None:
        self.out_dir, self.count = Path(out_dir), 0

    def _add(self, pl_module: L.LightningModule, stage: str) -> None:
        self.count += int(pl_module.metrics[f"{stage}_loss"].weight)

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.sanity_checking:
            self._add(pl_module, "val")

    def on_test_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._add(pl_module, "test")

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        (self.out_dir / f"rank{trainer.global_rank}.txt").write_text(str(self.count))


class NaNInputAt(L.Callback):
    """Puts a NaN in the input batch of optimizer step ``step`` (on ``rank`` only; None: every rank), so the loss,
    then the gradients, turn NaN, as a diverging run's would. Before doing so it writes the sha256 of every file
    in the run's checkpoints folder to ``hashes`` (JSON), for the test to prove they were not touched afterwards.
    """

    def __init__(self, step: int, hashes: str, rank: int | None = None) -> None:
        self.step, self.hashes, self.rank = step, hashes, rank

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, *_: object) -> None:
        if trainer.global_step != self.step:
            return
        if trainer.is_global_zero:
            import hashlib
            import json

            wait_for_writes(trainer)  # the files as they stand after this step's saves, not half-way through one
            folder = Path(trainer.checkpoint_callback.dirpath)
            digests = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.glob("*.ckpt"))}
            Path(self.hashes).write_text(json.dumps(digests))
        if self.rank in (None, trainer.global_rank):
            batch[0][0, 0] = float("nan")


class DiskFullOnSave(AtomicCheckpointIO):
    """The template's checkpoint writer, whose ``save``-th save runs out of disk space half-way through the file.

    It writes the first half of the checkpoint's bytes to the open ``.tmp`` file and raises ``ENOSPC`` as
    ``write`` does on a full disk. Select it with ``--trainer.plugins tests.faults.DiskFullOnSave``.

    Args:
        save: Which save fails, counting from 1 in this process.
    """

    def __init__(self, save: int = 1) -> None:
        super().__init__()
        self.save, self.saves = save, 0

    def _write(self, checkpoint: dict, f: BinaryIO) -> None:
        self.saves += 1
        if self.saves != self.save:
            return super()._write(checkpoint, f)
        buffer = io.BytesIO()
        torch.save(checkpoint, buffer)
        f.write(buffer.getvalue()[: buffer.tell() // 2])
        f.flush()
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


class Probe(L.Callback):
    """Records what each flag changes: batches per epoch, validation runs, sanity batches, gradient norms."""

    def __init__(self) -> None:
        self.batches: dict[int, list[int]] = {}  # epoch -> hash of each training batch
        self.val_runs = self.sanity_batches = 0
        self.grad_norms: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.batches.setdefault(trainer.current_epoch, []).append(hash(batch[1].numpy().tobytes()))

    def on_validation_batch_end(self, trainer, *_):
        self.sanity_batches += trainer.sanity_checking

    def on_validation_epoch_end(self, trainer, pl_module):
        self.val_runs += not trainer.sanity_checking

    def on_before_zero_grad(self, trainer, pl_module, optimizer):  # after the step: the clipped gradients
        grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
        if grads:
            self.grad_norms.append(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])).item())


class CrashAt(L.Callback):
    """Raises ``RuntimeError("injected crash")`` when optimizer step ``step`` is about to run: a crash inside a
    single-process run that the test catches, with the checkpoints of earlier steps on disk; under DDP, on global
    rank ``rank`` only (None: every rank), as a bug on one rank would."""

    def __init__(self, step: int, rank: int | None = None) -> None:
        self.step, self.rank = step, rank

    def on_train_batch_start(self, trainer: L.Trainer, *_: object) -> None:
        if trainer.global_step == self.step and self.rank in (None, trainer.global_rank):
            raise RuntimeError("injected crash")


class CrashUnlessRequeued(CrashAt):
    """``CrashAt`` in a SLURM job's first start only (no ``SLURM_RESTART_COUNT``): the job's command crashes, and the
    same command, requeued, trains on."""

    def on_train_batch_start(self, trainer: L.Trainer, *_: object) -> None:
        if not os.environ.get("SLURM_RESTART_COUNT"):
            super().on_train_batch_start(trainer)


class KillBeforePublish(ShardedStrategy):
    """The sharded strategy, whose save at global step ``step`` is SIGKILLed on every rank after all shards are
    written, before the folder gets its name: the worst moment for an atomic save.

    Select it with ``--trainer.strategy.class_path tests.faults.KillBeforePublish --trainer.strategy.init_args.step N``.
    """

    def __init__(self, step: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.step = step

    def _publish(self, tmp: Path, path: Path) -> None:
        if self.lightning_module.trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)
        super()._publish(tmp, path)


class SaveFullWeights(L.Callback):
    """Test oracle: rank 0 saves the net's full weights, gathered by FSDP itself (not read from a checkpoint), to
    ``path`` when training starts (``when="start"``: right after a resume restored them) or ends."""

    def __init__(self, path: str, when: str = "end") -> None:
        self.path, self.when = path, when

    def _save(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = get_model_state_dict(pl_module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if trainer.is_global_zero:
            torch.save({k: v for k, v in full.items() if k.startswith("net.")}, self.path)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.when == "start":
            self._save(trainer, pl_module)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.when == "end":
            self._save(trainer, pl_module)


class MemoryProbe(L.Callback):
    """Measurement: each rank writes ``out_dir/rank{R}.json`` at the end of training: the bytes of parameters and
    optimizer state it holds (its shards under sharding), its peak resident memory, its peak CUDA memory, and the
    training steps per second after the first (warm-up) step."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = Path(out_dir)
        self.started: float | None = None
        self.steps = 0

    def on_train_batch_end(self, trainer: L.Trainer, *_: object) -> None:
        import time

        if self.started is None:
            self.started = time.perf_counter()
        else:
            self.steps += 1
        self.elapsed = time.perf_counter() - self.started

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        import json
        import resource

        def local(t: torch.Tensor) -> torch.Tensor:
            return t.to_local() if hasattr(t, "to_local") else t  # a DTensor's shard on this rank

        params = sum(local(p).numel() * p.element_size() for p in pl_module.parameters())
        optim = sum(
            local(v).numel() * v.element_size()
            for opt in trainer.optimizers
            for state in opt.state.values()
            for v in state.values()
            if isinstance(v, torch.Tensor)
        )
        cuda = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0
        record = {
            "rank": trainer.global_rank,
            "strategy": type(trainer.strategy).__name__,
            "param_mb": params / 2**20,
            "optimizer_mb": optim / 2**20,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "peak_cuda_mb": cuda / 2**20,
            "steps_per_s": self.steps / self.elapsed if self.steps else 0.0,
        }
        self.out_dir.mkdir(parents=True, exist_ok=True)
        (self.out_dir / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


class SlowWriter(AtomicCheckpointIO):
    """The template's checkpoint writer, each of whose writes first sleeps ``delay`` seconds (a slow disk), so that
    a test can act while a background write is in flight.

    Args:
        delay: Seconds each write waits before writing.
    """

    def __init__(self, delay: float = 1.0) -> None:
        super().__init__()
        self.delay = delay

    def _write(self, checkpoint: dict, f: BinaryIO) -> None:
        import time

        time.sleep(self.delay)
        super()._write(checkpoint, f)


class KillDuringWrite(AtomicCheckpointIO):
    """The template's checkpoint writer, which SIGKILLs its process half-way through writing file ``name`` at global
    step ``step``: a crash during a background write, the loop having gone on.

    Args:
        step: Global step of the save to die in.
        name: File name of that save (e.g. ``last.ckpt``).
    """

    def __init__(self, step: int, name: str = "last.ckpt") -> None:
        super().__init__()
        self.step, self.name = step, name

    def _write(self, checkpoint: dict, f: BinaryIO) -> None:
        if checkpoint["global_step"] != self.step or Path(f.name).name != f"{self.name}.tmp":
            return super()._write(checkpoint, f)
        buffer = io.BytesIO()
        torch.save(checkpoint, buffer)
        f.write(buffer.getvalue()[: buffer.tell() // 2])
        f.flush()
        os.fsync(f.fileno())
        os.kill(os.getpid(), signal.SIGKILL)


class KillGroupAt(L.Callback):
    """SIGKILLs this process's whole process group (a sweep and its trial, when the test started the sweep in a
    session of its own) when optimizer step ``step`` of the run whose folder contains ``run_part`` is about to run:
    a machine that dies mid-trial. Once: it creates ``once_marker`` and never fires while it exists."""

    def __init__(self, step: int, run_part: str, once_marker: str) -> None:
        self.step, self.run_part, self.once_marker = step, run_part, once_marker

    def on_train_batch_start(self, trainer: L.Trainer, *_: object) -> None:
        if trainer.global_step != self.step or self.run_part not in str(trainer.default_root_dir):
            return
        if Path(self.once_marker).exists():
            return
        Path(self.once_marker).touch()
        wait_for_writes(trainer)  # the machine dies after the epoch-end checkpoint is on disk, not while it is written
        os.killpg(os.getpgid(0), signal.SIGKILL)


class StepsPerRank(L.Callback):
    """Probe: each rank writes ``{"global_step", "epoch"}`` where its ``fit`` ended to ``out_dir/rank{R}.json``."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = Path(out_dir)

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        import json

        self.out_dir.mkdir(parents=True, exist_ok=True)
        record = {"global_step": trainer.global_step, "epoch": trainer.current_epoch}
        (self.out_dir / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


class StopAt(L.Callback):
    """Stops ``fit`` cleanly after optimizer step ``step``, mid-epoch, as ``max_time`` or an early stop does:
    ``trainer.should_stop``. The end of fit then saves last.ckpt there.

    Args:
        step: The optimizer step after which to stop.
        after: Batch ends at that step let through first (with gradient accumulation: stop in the next step).
    """

    def __init__(self, step: int, after: int = 0) -> None:
        self.step, self.after = step, after

    def on_train_batch_end(self, trainer: L.Trainer, *_: object) -> None:
        if trainer.global_step == self.step:
            trainer.should_stop = self.after <= 0
            self.after -= 1
