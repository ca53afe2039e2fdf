"""A hung DDP rank ends the run in one line (``lightkeep.hang_watchdog``), and a dead rank's line is said even
when Lightning's own child-process observer acts first (``lightkeep.rank_failures``). The faults below are
injected into real 2-rank gloo runs by class path (``--trainer.callbacks+=tests.test_hang.FreezeAt``)."""

import os
import re
import shlex
import signal
import sys
import threading
import time
from pathlib import Path

import lightning as L
import pytest
import torch

from lightkeep.checkpoint_io import wait_for_writes
from lightkeep.hang_watchdog import FROZEN_S, Beat, stalled
from lightkeep.runs import Runs
from tests.helpers import DDP2, QUIET, RUN_NAME, STAND_IN, cli, run_dirs

# Epochs of 4 steps, a checkpoint at each end (the best by val/acc): the run is still training when a fault acts.
ENDLESS = ["--trainer.max_epochs", "100000", "--trainer.limit_train_batches", "4", "--trainer.limit_val_batches", "1"]
TIMEOUT = 10
NEWEST = rf"runs/{RUN_NAME}/version_0/checkpoints/\S+\.ckpt"


class FreezeAt(L.Callback):
    """SIGSTOPs global rank ``rank`` when optimizer step ``step`` is about to run, once (``once_marker``), and never
    continues it: a stopped process, as a hung call would leave it. Its pid goes to ``pid_file`` first, and its
    background checkpoint writes finish first (rank 0's): the newest checkpoint is the one the test expects whatever
    the machine's load (a rank 0 stopped mid-write leaves the checkpoint before it, as newest)."""

    def __init__(self, step: int, rank: int, pid_file: str, once_marker: str) -> None:
        self.step, self.rank, self.pid_file, self.once_marker = step, rank, Path(pid_file), Path(once_marker)

    def on_train_batch_start(self, trainer: L.Trainer, *_: object) -> None:
        if trainer.global_step == self.step and trainer.global_rank == self.rank and not self.once_marker.exists():
            self.once_marker.touch()
            wait_for_writes(trainer)
            self.pid_file.write_text(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGSTOP)


class SleepAt(L.Callback):
    """Global rank ``rank``'s main thread sleeps for an hour when optimizer step ``step`` is about to run: stuck, its
    other threads running. It ends the batch before that one ``late`` seconds late (a busy machine), so that its
    last beat comes after the other ranks' last ones, which went on into the next backward and wait there."""

    def __init__(self, step: int, rank: int, late: float = 0.0) -> None:
        self.step, self.rank, self.late = step, rank, late

    def on_train_batch_start(self, trainer: L.Trainer, *_: object) -> None:
        if trainer.global_step == self.step and trainer.global_rank == self.rank:
            time.sleep(3600)

    def on_train_batch_end(self, trainer: L.Trainer, *_: object) -> None:
        if trainer.global_step == self.step and trainer.global_rank == self.rank:
            time.sleep(self.late)  # before the watchdog's beat: the engine's callbacks come after the user's


class DieUnderQuickObserver(L.Callback):
    """Lightning's ``_ChildProcessObserver`` (rank 0's thread) polls every 1 ms instead of every 5 s, so that it
    looks at rank 1's death before rank 0 has said anything. Once it polls that fast (its first 5 s sleep, begun
    before this setup, is over: ``marker``), rank 1 SIGKILLs itself in its next checkpoint save, as in issue 35."""

    def __init__(self, marker: str) -> None:
        self.marker = Path(marker)

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        from lightning.fabric.strategies.launchers.subprocess_script import _ChildProcessObserver

        observers = [t for t in threading.enumerate() if isinstance(t, _ChildProcessObserver)]
        for observer in observers:
            observer._sleep_period = 0.001
        sys.setswitchinterval(1e-4)  # and gets Python's lock at once when it asks (this process only, a test)
        if observers:
            timer = threading.Timer(6.0, self.marker.touch)
            timer.daemon = True
            timer.start()

    def on_save_checkpoint(self, trainer: L.Trainer, *_: object) -> None:
        if trainer.global_rank == 1 and self.marker.exists():
            os.kill(os.getpid(), signal.SIGKILL)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def fault(name: str, **args: object) -> list[str]:
    return [f"--trainer.callbacks+=tests.test_hang.{name}", *(f"--trainer.callbacks.{k}={v}" for k, v in args.items())]


def the_error_line(proc) -> str:
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, f"exit {proc.returncode}, {len(errors)} error lines:\n{proc.stderr[-4000:]}"
    return errors[0]


def hung(rank: int, cause: str, step: int, saved: int, command: str) -> str:
    return (
        rf"error: rank {rank} made no progress for \d+ s while training at global step {step} \({cause}; "
        rf"run\.hang_timeout {TIMEOUT} s\); the other ranks stopped\. Newest complete checkpoint, intact: ({NEWEST}) "
        rf"\(step {saved}\)\. Resume: {re.escape(command)}"
    )


STOPPED = "its process stopped running: SIGSTOP, a debugger, or a call that holds Python's lock"


@pytest.mark.slow
def test_a_stopped_rank_ends_the_run_in_one_line_after_the_hang_timeout_and_the_run_resumes(tmp_path: Path) -> None:
    pid_file, marker = tmp_path / "rank1.pid", tmp_path / "frozen"
    args = [*DDP2, *QUIET, *ENDLESS, "--run.hang_timeout", str(TIMEOUT)]
    args += fault("FreezeAt", step=6, rank=1, pid_file=pid_file, once_marker=marker)  # mid-epoch 1; step 4 saved
    proc = cli("fit", *args, cwd=tmp_path, check=False, timeout=180)
    ended = time.time()
    assert pid_file.is_file(), f"rank 1 never stopped:\n{proc.stderr[-4000:]}"
    took = ended - pid_file.stat().st_mtime
    assert proc.returncode == 1, proc.stderr[-4000:]
    assert TIMEOUT <= took < TIMEOUT + 20, f"the run ended {took:.0f} s after rank 1 stopped"
    command = shlex.join(["python", "-m", "project", "fit", *STAND_IN, *args, "--ckpt_path", "last"])
    line = the_error_line(proc)
    match = re.fullmatch(hung(1, re.escape(STOPPED), 6, 4, command), line)
    assert match, line
    assert torch.load(tmp_path / match[1], weights_only=True)["global_step"] == 4
    pid = int(pid_file.read_text())
    assert not alive(pid), f"the stopped rank 1 (pid {pid}) was left behind"
    # the command it printed continues the run from that checkpoint (the once_marker keeps rank 1 going now)
    resumed = cli(*shlex.split(command)[3:], "--trainer.max_epochs", "2", cwd=tmp_path, timeout=180)
    assert f"continues from step 4 of {match[1]}" in resumed.stdout + resumed.stderr
    (run,) = run_dirs(tmp_path)
    assert torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 8


@pytest.mark.slow
def test_lightnings_observer_no_longer_kills_rank_0_before_it_says_which_rank_died(tmp_path: Path) -> None:
    marker = tmp_path / "observer-polls-fast"
    args = [*DDP2, *QUIET, *ENDLESS, *fault("DieUnderQuickObserver", marker=marker)]
    proc = cli("fit", *args, cwd=tmp_path, check=False, timeout=180)
    assert marker.exists(), f"the observer never polled fast:\n{proc.stderr[-4000:]}"  # the race was forced
    # without the engine's wait: exit code 137 (rank 0 SIGKILLed by Lightning) and no line
    assert proc.returncode == 1, f"exit {proc.returncode}:\n{proc.stderr[-4000:]}"
    line = the_error_line(proc)
    assert line.startswith("error: rank 1 was killed by SIGKILL (kill -9, or out of memory); the other ranks "), line
    assert "Forcefully terminating" not in proc.stderr  # Lightning's kill never came: the report ended the run


@pytest.mark.long  # rank 0 itself: its own watchdog, and the other rank when rank 0 is stopped whole
@pytest.mark.slow
@pytest.mark.parametrize("how", ["stuck", "stopped"])
def test_rank_0_hung_is_named_by_its_own_watchdog_or_when_stopped_by_the_other_rank(tmp_path: Path, how) -> None:
    pid_file, marker = tmp_path / "rank0.pid", tmp_path / "frozen"
    args = [*DDP2, *QUIET, *ENDLESS, "--run.hang_timeout", str(TIMEOUT)]
    if how == "stuck":
        args += fault("SleepAt", step=6, rank=0, late=2)
    else:
        args += fault("FreezeAt", step=6, rank=0, pid_file=pid_file, once_marker=marker)
    started = time.monotonic()
    proc = cli("fit", *args, cwd=tmp_path, check=False, timeout=180)
    took = time.monotonic() - started
    # rank 1 reports a stopped rank 0 and SIGKILLs it: the shell sees rank 0's -9
    assert proc.returncode == (1 if how == "stuck" else -signal.SIGKILL), proc.stderr[-4000:]
    command = shlex.join(["python", "-m", "project", "fit", *STAND_IN, *args, "--ckpt_path", "last"])
    cause = "its main thread is stuck" if how == "stuck" else re.escape(STOPPED)
    line = the_error_line(proc)
    assert re.fullmatch(hung(0, cause, 6, 4, command), line), line
    assert took < 120, f"{took:.0f} s"
    if how == "stopped":
        assert not alive(int(pid_file.read_text()))


# --- which rank a hang names (no processes) --------------------------------------------------------------------


def beat(alive: float, progress: float, step: int = 6, what: int = 2, point: int = -1) -> Beat:
    return Beat(alive=alive, progress=progress, step=step, what=what, point=point, pid=100, rank=0)


def test_no_rank_is_named_while_any_rank_progresses_within_the_timeout():
    beats = {0: beat(99.9, 95.0), 1: beat(99.9, 50.0)}  # rank 1 quiet for 50 s, but rank 0 progressed 5 s ago
    assert stalled(beats, now=100.0, since=0.0, timeout=10) == (-1, 0.0, set())


def test_a_rank_whose_process_does_not_run_is_named_before_the_one_that_stopped_first():
    beats = {0: beat(99.9, 80.0), 1: beat(80.0 - FROZEN_S, 85.0)}  # rank 1 progressed last, but it is stopped
    assert stalled(beats, now=100.0, since=0.0, timeout=10) == (1, 15.0, {1})


def test_of_running_ranks_the_one_whose_progress_stopped_first_is_named():
    beats = {0: beat(99.9, 80.0), 1: beat(99.9, 80.5), 2: beat(99.9, 81.0)}
    assert stalled(beats, now=100.0, since=0.0, timeout=10) == (0, 20.0, set())


def test_in_training_the_rank_furthest_back_in_the_loop_is_named_even_when_its_last_beat_came_later():
    # rank 0 ended batch 6 late (a busy machine) and stuck before batch 7; rank 1 went on into batch 7's backward,
    # where it waits for rank 0: the one to name is rank 0, though rank 1's last beat is the earlier in time
    beats = {0: beat(99.9, 80.5, what=1, point=3 * 6 + 2), 1: beat(99.9, 80.25, what=1, point=3 * 7 + 1)}
    assert stalled(beats, now=100.0, since=0.0, timeout=10) == (0, 19.5, set())
    # outside training (validation shares may differ between ranks) the first to stop is named
    beats = {0: beat(99.9, 80.5, what=2, point=-1), 1: beat(99.9, 80.25, what=1, point=3 * 7 + 1)}
    assert stalled(beats, now=100.0, since=0.0, timeout=10) == (1, 19.75, set())


def test_a_missing_heartbeat_or_one_of_an_earlier_run_counts_as_a_process_that_does_not_run():
    old = beat(alive=40.0, progress=45.0)  # written before this watch began: not this run's
    assert stalled({0: beat(99.9, 60.0), 1: old}, now=100.0, since=50.0, timeout=10) == (1, 50.0, {1})
    assert stalled({0: beat(99.9, 60.0), 1: None}, now=100.0, since=50.0, timeout=10) == (1, 50.0, {1})


def test_time_before_the_watch_began_or_resumed_does_not_count():
    beats = {0: beat(99.9, 10.0), 1: beat(99.9, 10.0)}  # both quiet since 10, but the watch (re)started at 95
    assert stalled(beats, now=100.0, since=95.0, timeout=10)[0] == -1


@pytest.mark.parametrize("value", [0, -5, float("nan")])
def test_hang_timeout_must_be_positive_or_null(value):
    with pytest.raises(ValueError, match=r"run\.hang_timeout .* must be > 0 seconds, or null"):
        Runs(hang_timeout=value)
    assert Runs(hang_timeout=None).hang_timeout is None
