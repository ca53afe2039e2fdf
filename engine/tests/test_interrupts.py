"""A diverging run and a Ctrl-C stop cleanly: a message naming the step, earlier checkpoints intact, no stray ranks."""

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from lightkeep.checkpoint_io import AtomicCheckpointIO
from tests.faults import kill_at
from tests.helpers import DDP2, PYTHONPATH, QUIET, STAND_IN, cli, newest_checkpoint, run_dirs

pytestmark = pytest.mark.slow

# 5 steps per epoch: the best 3 and every-2-epochs checkpoints are written at epoch ends (steps 5, 10, ...).
SMALL = [*QUIET, "--trainer.limit_train_batches", "5", "--trainer.limit_val_batches", "2", "--model.warmup", "1"]


def nan_at(step: int, hashes, rank: int | None = None) -> list[str]:
    args = ["--trainer.callbacks+=tests.faults.NaNInputAt", f"--trainer.callbacks.step={step}"]
    args += [f"--trainer.callbacks.hashes={hashes}"]
    return args + ([f"--trainer.callbacks.rank={rank}"] if rank is not None else [])


def digests(folder) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.glob("*.ckpt"))}


def assert_stopped_at_step_with_checkpoints_intact(proc, cwd, step: int, last_good_step: int) -> None:
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert f"NaN or infinite at step {step} " in proc.stderr and "Fix: lower the learning rate" in proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    (run,) = run_dirs(cwd)
    folder = run / "checkpoints"
    before = json.loads((cwd / "hashes.json").read_text())
    assert before and digests(folder) == before  # nothing written or rewritten after the NaN
    last = torch.load(newest_checkpoint(run), weights_only=True)  # what --ckpt_path last resumes from
    assert last["global_step"] == last_good_step
    assert all(torch.isfinite(v).all() for v in last["state_dict"].values() if v.is_floating_point())


@pytest.mark.long  # CI and make test-all; make test stops a NaN on one DDP rank below, with the same checks
def test_nan_loss_stops_naming_the_step_and_keeps_the_last_good_checkpoint(tmp_path):
    args = [*SMALL, "--trainer.max_epochs", "4", *nan_at(12, tmp_path / "hashes.json")]
    proc = cli("fit", *args, cwd=tmp_path, check=False, timeout=120)
    assert_stopped_at_step_with_checkpoints_intact(proc, tmp_path, step=12, last_good_step=10)


def test_nan_on_one_ddp_rank_stops_every_rank_at_the_same_step(tmp_path):
    # Only rank 1's loss turns NaN: a rank deciding alone would leave the other waiting in its next all-reduce
    # until the timeout fails the test instead of finishing in seconds.
    args = [*SMALL, *DDP2, "--trainer.max_epochs", "4", *nan_at(7, tmp_path / "hashes.json", rank=1)]
    proc = cli("fit", *args, cwd=tmp_path, check=False, timeout=120)
    assert_stopped_at_step_with_checkpoints_intact(proc, tmp_path, step=7, last_good_step=5)


class CtrlCAgainDuringSave(AtomicCheckpointIO):
    """The template's writer, which sends its process SIGINT (Ctrl-C again) as it starts writing the checkpoint of
    global step ``step``, the first Ctrl-C's save, and takes a second more to write it: the main thread is waiting
    for that save when the signal lands. ``--trainer.plugins tests.test_interrupts.CtrlCAgainDuringSave``."""

    def __init__(self, step: int) -> None:
        super().__init__()
        self.step = step

    def _write(self, checkpoint, f) -> None:
        if checkpoint["global_step"] == self.step:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1.0)
        super()._write(checkpoint, f)


@pytest.mark.parametrize("when", ["during training", "during the first one's save"])
def test_a_second_ctrl_c_stops_at_once_with_exit_code_130_in_one_line(tmp_path, when):
    # The first Ctrl-C comes before step 7's batch: the run stops after it and saves last.ckpt of step 8. The second
    # comes in the same batch (a second KillAt), or while that save is being written (its writer sends it).
    if when == "during training":
        again = kill_at(7, sig=signal.SIGINT)
    else:
        again = ["--trainer.plugins", "tests.test_interrupts.CtrlCAgainDuringSave", "--trainer.plugins.step", "8"]
    args = [*SMALL, "--trainer.max_epochs", "4", *kill_at(7, sig=signal.SIGINT), *again]
    proc = cli("fit", *args, cwd=tmp_path, check=False, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 130, out[-3000:]  # not 1 (Lightning's KeyboardInterrupt ending), nor killed by SIGINT
    assert "Traceback" not in out and "Detected KeyboardInterrupt" not in out, out[-3000:]
    assert "Ctrl-C again: stopping at once, without saving" in out and "Interrupted: saved" not in out, out[-3000:]
    (run,) = run_dirs(tmp_path)
    folder = run / "checkpoints"
    assert not list(folder.glob("*.tmp"))
    steps = {p.name: torch.load(p, weights_only=True)["global_step"] for p in folder.glob("*.ckpt")}  # all complete
    if when == "during training":
        assert max(steps.values()) == 5, steps  # nothing saved after the epoch end before the Ctrl-Cs
    else:
        assert steps["last.ckpt"] == 8, steps  # the write under way was finished, not cut short


def live_processes_in_group(pgid: int, wait: float = 10.0) -> list[str]:
    """Command lines of the processes (zombies aside) still in process group ``pgid`` after up to ``wait`` s."""
    deadline = time.monotonic() + wait
    while True:
        alive = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()  # state, ppid, pgrp, ...
                if int(fields[2]) == pgid and fields[0] != "Z":
                    alive.append((stat.parent / "cmdline").read_text().replace("\0", " "))
            except (OSError, IndexError, ValueError):
                continue  # exited meanwhile
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.2)


@pytest.mark.long  # CI and make test-all; Ctrl-C again, under DDP
def test_ctrl_c_under_ddp_saves_last_and_leaves_no_process_behind(tmp_path):
    # Ctrl-C in a terminal sends SIGINT to the whole foreground process group: both ranks get it.
    args = [*SMALL, *DDP2, "--trainer.max_epochs", "40"]
    env = {**os.environ, "PYTHONPATH": PYTHONPATH, "PYTHONWARNINGS": "ignore"}
    cmd = [sys.executable, "-m", "project", "fit", *STAND_IN, *args]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, start_new_session=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)  # fmt: skip
    try:
        # Training is under way past epoch 1, whatever the load: its every-2-epochs checkpoint is on disk.
        deadline = time.monotonic() + 120
        while not list((tmp_path / "runs").rglob("epoch001.ckpt")) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert list((tmp_path / "runs").rglob("epoch001.ckpt")), "epoch 1 did not end within 120 s"
        os.killpg(proc.pid, signal.SIGINT)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, out[-3000:]
    assert "Interrupted" in out and "Traceback" not in out, out[-3000:]
    assert live_processes_in_group(proc.pid) == []  # no rank outlived the launcher
    (run,) = run_dirs(tmp_path)
    saved = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["global_step"]
    assert 10 <= saved < 200
    # The run continues from there to the end, in the same folder.
    cli("fit", *args, "--ckpt_path", "last", cwd=tmp_path, timeout=240)
    assert run_dirs(tmp_path) == [run]
    assert torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 200
