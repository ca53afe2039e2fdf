"""A hung rank in one line: when no rank of a DDP run has made progress for ``run.hang_timeout`` seconds, the run ends
as it does for a dead rank (``lightkeep.rank_failures``), every rank's process ended (a stopped one too: SIGKILL ends
it). The timeout, the message, the heartbeat each rank keeps, what counts as progress and when the watch starts and
ends: docs/checkpoints.md, 'A hung rank, in one line'.

In training, progress is a batch's start, its backward and its end. Each rank's watchdog thread stores the time it
last ran in its heartbeat 5 times a second; rank 0 reads every heartbeat once a second and names a rank whose
watchdog stopped too (its whole process does not run), else the rank that stopped furthest back: in training every
rank runs the same batches, so that is the rank whose last beat is the earliest point of the loop (its batch, then
before the batch, its backward, after it), not merely the earliest in time: a busy machine can delay the stuck rank's
last beat past a peer's that already waits in the next backward. Elsewhere (validation shares may differ between
ranks) it is the rank whose progress stopped first. Rank 0's own watchdog reports rank 0 when its main thread is the
one stuck; the lowest of the other ranks reports when rank 0's whole process is stopped. A watchdog that finds it did
not run itself for a while (the whole run stopped by Ctrl-Z, then continued) counts again from then.
"""

import contextlib
import mmap
import os
import re
import struct
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import lightning as L
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn

from lightkeep.compat_loops import batches_begun
from lightkeep.rank_failures import launched_by_lightning

WHAT = ("starting", "training", "validating", "saving a checkpoint", "testing", "predicting")
TRAINING, VALIDATING, SAVING, TESTING, PREDICTING = range(1, 6)
# One heartbeat: the time its watchdog last ran, the time of its last progress (time.monotonic(): one clock for
# every process of a machine), the global step and what it was doing then, where in the training loop it was
# (3 x training batches begun + 0, 1, 2 for a batch's start, backward, end; -1 outside training), its process and
# its global rank.
CELL = struct.Struct("<ddqqqqq")
ALIVE, BEAT = struct.Struct("<d"), struct.Struct("<dqqq")  # at offsets 0 and 8
FROZEN_S = 5.0  # a watchdog that has not run for this long: its process does not run
TICK_S, CHECK_S = 0.2, 1.0
PREFIX = "project-heartbeat"
STOPPED = "its process stopped running: SIGSTOP, a debugger, or a call that holds Python's lock"


@dataclass(frozen=True)
class Beat:
    alive: float
    progress: float
    step: int
    what: int
    point: int
    pid: int
    rank: int


def read_beat(path: Path) -> Beat | None:
    try:
        data = path.read_bytes()
    except OSError:
        return None
    return Beat(*CELL.unpack(data)) if len(data) == CELL.size else None


def remove_heartbeats_of_ended_runs() -> None:
    """The heartbeats a run whose rank 0 was killed left in the temporary folder."""
    for path in Path(tempfile.gettempdir()).glob(f"{PREFIX}-*"):
        match = re.fullmatch(rf"{PREFIX}-(\d+)-\d+(?:\.\d+\.tmp)?", path.name)
        if match and not _running(int(match[1])):
            with contextlib.suppress(OSError):
                path.unlink()


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's
    return True


class Heartbeat:
    """This rank's heartbeat, mapped into memory: ``beat`` and ``alive`` store into it, the others read the file."""

    def __init__(self, path: Path, rank: int) -> None:
        self.path = path
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        with open(tmp, "w+b") as f:  # whole before it has its name: a reader sees all of it or none
            f.write(CELL.pack(time.monotonic(), 0.0, 0, 0, -1, os.getpid(), rank))
            f.flush()
            self._cell = mmap.mmap(f.fileno(), CELL.size)
        os.replace(tmp, path)

    def beat(self, step: int, what: int, point: int = -1) -> None:
        BEAT.pack_into(self._cell, 8, time.monotonic(), step, what, point)

    def alive(self) -> None:
        ALIVE.pack_into(self._cell, 0, time.monotonic())

    def close(self) -> None:
        self.path.unlink(missing_ok=True)
        self._cell.close()


def stalled(beats: dict[int, Beat | None], now: float, since: float, timeout: float) -> tuple[int, float, set]:
    """When no rank has progressed for ``timeout`` s (counted from ``since`` at the earliest): the local rank to name,
    its seconds without progress and the local ranks whose process does not run; else ``(-1, 0, set())``."""
    frozen_after = min(FROZEN_S, timeout / 2)
    live = {i: b for i, b in beats.items() if b is not None and b.alive >= since}  # else: not this run's, or stopped
    last = {i: max(b.progress, since) if i in live else since for i, b in beats.items()}
    if now - max(last.values()) < timeout:
        return -1, 0.0, set()
    frozen = {i for i in beats if i not in live or now - live[i].alive > frozen_after}
    if frozen:
        culprit = min(frozen)
    elif all(b.point >= 0 and b.progress >= since for b in live.values()):  # every rank in training
        culprit = min(live, key=lambda i: (live[i].point, last[i], i))  # the one furthest back in the loop
    else:
        culprit = min(last, key=lambda i: (last[i], i))
    return culprit, now - last[culprit], frozen


def _progress(what: int, phase: int = -1, ended: bool = False) -> Callable[..., None]:
    """A hook that stores progress in this rank's heartbeat; ``phase``: a training batch's start, backward or end."""

    def hook(self: "HangWatchdog", trainer: L.Trainer, *_: object) -> None:
        if self.heart is None:
            return
        self.heart.beat(trainer.global_step, what, 3 * batches_begun(trainer) + phase if phase >= 0 else -1)
        if ended and not self.armed and (what == TRAINING or trainer.state.fn != "fit"):
            self._since, self.armed = time.monotonic(), True  # not the sanity check's batches, in fit

    return hook


class HangWatchdog(Callback):
    """Ends a Lightning-launched DDP run whose ranks all stopped progressing, in the one line described above.

    Args:
        timeout: Seconds without progress on any rank; ``None``: never (``run.hang_timeout``).
        report: Prints the line for a rank and ends the run (``RankFailures.report``): ``report(rank, how, pids)``
            with ``pids`` the other ranks' processes.
    """

    def __init__(self, timeout: float | None, report: Callable[[int, str, list[int]], None]) -> None:
        self.timeout, self.report = timeout, report
        self.heart: Heartbeat | None = None
        self.paths: list[Path] = []
        self.local = 0
        self.armed = False
        self._since = self._ticked = self._checked = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self.timeout is None or not launched_by_lightning(trainer) or self._thread is not None:
            return
        self.local = trainer.local_rank
        launcher = os.getpid() if self.local == 0 else os.getppid()  # the launcher is the other ranks' parent
        if self.local == 0:
            remove_heartbeats_of_ended_runs()
        # each local rank's heartbeat, named after the process that launched them
        self.paths = [Path(tempfile.gettempdir()) / f"{PREFIX}-{launcher}-{i}" for i in range(trainer.num_devices)]
        try:
            self.heart = Heartbeat(self.paths[self.local], trainer.global_rank)
        except OSError as error:  # the run goes on, unwatched, as it would without a timeout
            rank_zero_warn(f"run.hang_timeout: no heartbeat in {self.paths[0].parent} ({error}); hangs are not watched")
            return
        self.armed = False
        self._since = self._ticked = self._checked = time.monotonic()
        self._stop.clear()
        self._thread = threading.Thread(target=self._watch, daemon=True, name="hang-watchdog")
        self._thread.start()

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._end()

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._end()  # Lightning skips teardown after a failure; a preemption's save takes as long as it takes

    def _end(self) -> None:
        self.armed = False
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        self._thread = None
        if self.heart is not None:
            self.heart.close()
            self.heart = None

    # Progress: a few hooks of every loop, each a store into the heartbeat
    on_train_batch_start = _progress(TRAINING, phase=0)
    on_before_backward = _progress(TRAINING, phase=1)
    on_train_batch_end = _progress(TRAINING, phase=2, ended=True)
    on_validation_batch_start, on_validation_batch_end = _progress(VALIDATING), _progress(VALIDATING, ended=True)
    on_test_batch_start, on_test_batch_end = _progress(TESTING), _progress(TESTING, ended=True)
    on_predict_batch_start, on_predict_batch_end = _progress(PREDICTING), _progress(PREDICTING, ended=True)
    on_save_checkpoint = _progress(SAVING)

    # The loop's end: what follows (the last write, the process group's end) takes as long as it takes
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.armed = False

    on_test_end = on_predict_end = on_train_end

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.state.fn == "validate":  # not a validation within fit
            self.armed = False

    def _watch(self) -> None:
        while not self._stop.wait(TICK_S):
            stall = self._tick()
            if stall is not None and not self._stop.is_set():
                for path in self.paths:  # the report ends every rank's process: nothing would remove them
                    path.unlink(missing_ok=True)
                self.report(*stall)

    def _tick(self) -> tuple[int, str, list[int]] | None:
        """``report``'s arguments when this rank is to report a hang, else ``None``."""
        now = time.monotonic()
        if now - self._ticked > FROZEN_S:
            self._since = now  # this process did not run either (Ctrl-Z, a suspend): count from now
        self._ticked = now
        heart = self.heart
        if heart is None:
            return None
        heart.alive()
        if not self.armed or self.timeout is None or now - self._checked < CHECK_S:
            return None
        self._checked = now
        beats = {i: read_beat(path) for i, path in enumerate(self.paths)}
        culprit, quiet, frozen = stalled(beats, now, self._since, self.timeout)
        # rank 0 reports; the lowest other rank whose process runs reports only a rank 0 that does not run itself
        if culprit < 0 or (self.local != 0 and not (culprit == 0 and frozen >= set(range(self.local)))):
            return None
        beat = beats[culprit]
        step, what = (beat.step, WHAT[beat.what]) if beat is not None and beat.progress > 0 else (0, WHAT[0])
        cause = STOPPED if culprit in frozen else "its main thread is stuck"
        how = f"made no progress for {quiet:.0f} s while {what} at global step {step} ({cause}; run.hang_timeout "
        how += f"{self.timeout:g} s)"
        pids = [b.pid for i, b in beats.items() if b is not None and i != self.local]
        return beat.rank if beat is not None else culprit, how, pids
