"""Under DDP the signal handling and the NaN guard cost no wait per step: a SIGTERM or Ctrl-C on any one rank still
stops every rank at the same batch within ``STOP_WITHIN`` batches, saves ``last.ckpt`` and exits 143 (130), and the
resume is exact; the host waits for the device (or for the other ranks) at most once per 50 steps, where Lightning
logs."""

import atexit
import json
import math
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lightkeep.compat import launched_children
from lightkeep.signals import AGREE_EVERY, STOP_WITHIN
from tests.faults import kill_at
from tests.helpers import DDP2, QUIET, cli, run_dirs

pytestmark = pytest.mark.slow

aten = torch.ops.aten
READS = {aten._local_scalar_dense.default, aten.is_nonzero.default, aten.equal.default, aten.nonzero.default}
# Reads of host memory on a GPU too: copies the engine staged without waiting steps before (pinned memory there), the
# samplers' draws, the optimizer's step counters. Every other read, and every collective the host waits for, drains.
STAGED = ("lightkeep/guards.py:_read_staged", "lightkeep/agreement.py:sums", "compat_logging.py:_staged_bar")
HOST_SIDE = ("/torch/utils/data/", "/torch/optim/")
# The engine's parts that agree across the ranks without waiting (lightkeep.agreement): the stop on a signal,
# the timed last.ckpt
AGREEING = ("lightkeep/signals.py", "lightkeep/last_checkpoint.py")


class CountWaits(L.Callback):
    """Records, per optimizer step of training (validation and epoch ends left out), each host read of a tensor and
    each collective on the loop thread, with the code that made it, in ``out/rank{R}.json``: a ``TorchDispatchMode``
    sees every op, collectives included; a collective is blocking when ``torch.distributed``'s function was called
    without ``async_op`` (DDP's own gradient all-reduces start in C++, without that frame)."""

    def __init__(self, out: str) -> None:
        self.out, self.step, self.events = Path(out), -1, []
        self.counting = False

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        probe = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
                out = func(*args, **(kwargs or {}))
                counted = (
                    probe.counting and pl_module.training and threading.current_thread() is threading.main_thread()
                )
                if counted and (func in READS or func.namespace == "c10d"):
                    probe.events.append((probe.step, *_kind_and_where(func)))
                return out

        self.first, self.mode = trainer.global_step, Mode()
        self.mode.__enter__()

    def on_train_batch_start(self, trainer: L.Trainer, *_: Any) -> None:
        self.step, self.counting = trainer.global_step, True

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.counting = False  # the epoch's end (its metrics, the checkpoint decisions), once an epoch

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.mode.__exit__(None, None, None)
        self.out.mkdir(parents=True, exist_ok=True)
        steps = trainer.global_step - self.first
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps({"steps": steps, "events": self.events}))


def _kind_and_where(func: Any) -> tuple[str, str, bool, str | None]:
    """``(kind, where, host_side, part)``: kind ``read`` / ``blocking`` / ``async``; where: the innermost frame
    outside torch, ``path:function``; host_side: a frame of the samplers or the optimizers (host tensors on a GPU
    too); part: the innermost of ``AGREEING`` on the stack, if any."""
    frames, frame, blocking = [], sys._getframe(2), False
    while frame is not None:
        name = f"{frame.f_code.co_filename.replace(os.sep, '/')}:{frame.f_code.co_name}"
        if "distributed_c10d" in name and "async_op" in frame.f_locals:
            blocking = blocking or not frame.f_locals["async_op"]
        frames.append(name)
        frame = frame.f_back
    where = next((f for f in frames if "/torch/" not in f), "?")
    kind = "read" if func.namespace != "c10d" else "blocking" if blocking else "async"
    part = next((a for f in frames for a in AGREEING if a in f), None)
    return kind, where, any(h in f for f in frames for h in HOST_SIDE), part


def waits_by_step(events: list) -> tuple[set[int], dict[str, set[int]]]:
    """The steps at which the host waited (a read of a device value, a blocking collective), and per staged read
    (``STAGED``) the steps at which it ran."""
    drains: set[int] = set()
    staged: dict[str, set[int]] = {s: set() for s in STAGED}
    for step, kind, where, host_side, _ in events:
        hit = next((s for s in STAGED if where.endswith(s) or s in where), None) if kind == "read" else None
        if hit is not None:
            staged[hit].add(step)
        elif kind == "blocking" or (kind == "read" and not host_side):
            drains.add(step)
    return drains, staged


def test_under_ddp_the_host_waits_once_per_50_steps_with_signals_the_timed_last_ckpt_and_the_nan_guard_on(tmp_path):
    # 10 epochs of 10 batches a rank: 100 optimizer steps; Lightning logs (and reads the logged values) at 49 and 99
    args = [*QUIET, *DDP2, "--trainer.max_epochs", "10", "--trainer.limit_train_batches", "10"]
    args += ["--trainer.limit_val_batches", "2", "--trainer.log_every_n_steps", "50"]
    args += ["--trainer.callbacks+=tests.test_signal_syncs.CountWaits", f"--trainer.callbacks.out={tmp_path / 'w'}"]
    cli("fit", *args, cwd=tmp_path, timeout=300)
    for rank in (0, 1):
        counted = json.loads((tmp_path / "w" / f"rank{rank}.json").read_text())
        steps, events = counted["steps"], counted["events"]
        assert steps == 100, steps
        drains, staged = waits_by_step(events)
        per_step = sorted({(kind, where) for step, kind, where, *_ in events if step in drains and kind != "async"})
        assert len(drains) <= math.ceil(steps / 50), f"rank {rank} waited at steps {sorted(drains)}: {per_step}"
        # the NaN guard is on and reads its flag (a host copy) where Lightning's logging waits anyway: one wait
        guard = staged["lightkeep/guards.py:_read_staged"]
        assert guard and guard <= drains, f"rank {rank}: the guard read at {sorted(guard)}, the host waited at {drains}"
        # the signal handling and last.ckpt's timer are on: the ranks agree without waiting, every AGREE_EVERY
        # batches, each part on its own
        for part in AGREEING:
            agreed = [step for step, kind, _, _, by in events if kind == "async" and by == part]
            assert len(agreed) >= steps // AGREE_EVERY - 1, f"rank {rank}: {len(agreed)} agreements of {part} started"


class RankExitCodes(L.Callback):
    """Test probe: rank 0 writes, as it exits, the exit status of each rank it launched to ``out`` (JSON list), as
    the operating system reports it (``Popen.wait``)."""

    def __init__(self, out: str) -> None:
        self.out = Path(out)

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        children = launched_children(trainer)
        if children:
            atexit.register(lambda: self.out.write_text(json.dumps([p.wait(timeout=120) for p in children])))


def final_weights(run: Path) -> tuple[int, dict[str, torch.Tensor]]:
    last = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)
    return last["global_step"], last["state_dict"]


# 3 epochs of 25 batches a rank (75 steps; AGREE_EVERY 10: agreements start after batches 10, 20, ..., 70)
DDP = [*QUIET, *DDP2, "--data.batch_size", "16", "--trainer.max_epochs", "3", "--trainer.limit_train_batches", "25"]
DDP += ["--trainer.limit_val_batches", "2", "--model.warmup", "1"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    cwd = tmp_path_factory.mktemp("uninterrupted")
    cli("fit", *DDP, cwd=cwd)
    return cwd


@pytest.mark.parametrize(
    ("sig", "step", "stop"),
    [
        # the agreement started after batch 20 is read at epoch 0's end (25), acted on after batch 26
        pytest.param(signal.SIGTERM, 13, 26, id="sigterm-read-at-the-epoch-end"),
        # Ctrl-C (kill -INT) on rank 1: the agreement started after batch 10 is read after batch 20, mid-epoch
        pytest.param(signal.SIGINT, 3, 20, id="ctrl-c-mid-epoch", marks=pytest.mark.long),
        # read after batch 50, epoch 1's last: its validation runs first
        pytest.param(signal.SIGTERM, 33, 50, id="sigterm-at-an-epochs-last-batch", marks=pytest.mark.long),
    ],
)
def test_a_signal_on_rank_1_only_stops_every_rank_within_the_bound_and_resumes_exactly(uninterrupted, tmp_path, sig,
                                                                                       step, stop):  # fmt: skip
    probe = ["--trainer.callbacks+=tests.test_signal_syncs.RankExitCodes", f"--trainer.callbacks.out={tmp_path}/rc"]
    fault = kill_at(step, sig=sig, rank=1)  # as optimizer step `step` begins, on rank 1 only
    proc = cli("fit", *DDP, *fault, *probe, cwd=tmp_path, check=False, timeout=300)
    out = proc.stdout + proc.stderr
    code = 128 + sig  # 143, or 130 for a Ctrl-C
    assert proc.returncode == code, out[-3000:]  # rank 0, which did not get the signal
    assert json.loads((tmp_path / "rc").read_text()) == [code], out[-3000:]  # rank 1, as the system reports it
    saved_line = "Interrupted: saved" if sig == signal.SIGINT else "Preempted: saved"
    assert saved_line in out and "Traceback" not in out, out[-3000:]
    (run,) = run_dirs(tmp_path)
    saved, _ = final_weights(run)
    assert step < saved <= step + STOP_WITHIN, f"signal at step {step}, last.ckpt of step {saved}"
    assert saved == stop  # the path this case takes
    cli("fit", *DDP, "--ckpt_path", "last", cwd=tmp_path)
    assert run_dirs(tmp_path) == [run]
    (ref_run,) = run_dirs(uninterrupted)
    (ref_step, ref), (got_step, got) = final_weights(ref_run), final_weights(run)
    assert got_step == ref_step == 75
    assert ref.keys() == got.keys()
    assert all(torch.equal(got[k], v) for k, v in ref.items()), [
        k for k, v in ref.items() if not torch.equal(got[k], v)
    ]
