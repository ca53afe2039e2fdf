"""A hung rank in one line: when no rank of a multi-process run has made progress for ``run.hang_timeout`` seconds,
the run ends as it does for a dead rank (``lightkeep.rank_failures``), every process of the node that reports ended
(a stopped one too: SIGKILL ends it). The timeout, the message, what counts as progress and when the watch starts
and ends: docs/checkpoints.md, 'A hung rank, in one line'.

Progress is what ``lightkeep.liveness`` publishes: in training a batch's start, its backward and its end. After each
read of every rank's beat (once a second, on every rank) this names a rank whose beats stopped (its whole process
does not run, or its machine does not answer), else the rank that stopped furthest back: in training every rank
runs the same batches, so that is the rank whose last beat is the earliest point of the loop (its batch, then before
the batch, its backward, after it), not merely the earliest in time: a busy machine can delay the stuck rank's last
beat past a peer's that already waits in the next backward. Elsewhere (validation shares may differ between ranks)
it is the rank whose progress stopped first. Every rank judges alike; the first verdict claimed in the store is the
one every node says. A rank whose own thread did not run for a while (the whole run stopped by Ctrl-Z, then
continued) counts again from then.
"""

import time
from collections.abc import Callable

import lightning as L
from lightning.pytorch.callbacks import Callback

from lightkeep.liveness import FROZEN_S, TICK_S, TRAINING, WHAT, Beat, Liveness

__all__ = ["FROZEN_S", "Beat", "HangWatchdog", "stalled"]
STOPPED = "its process stopped running: SIGSTOP, a debugger, or a call that holds Python's lock"
# a rank of another node: its machine may be the one that stopped answering
STOPPED_AWAY = (
    "its process stopped running or its machine does not answer: SIGSTOP, a debugger, a call that holds Python's "
    "lock, a lost machine or network"
)


def stalled(beats: dict[int, Beat | None], now: float, since: float, timeout: float) -> tuple[int, float, set]:
    """When no rank has progressed for ``timeout`` s (counted from ``since`` at the earliest): the rank to name, its
    seconds without progress and the ranks whose process does not run; else ``(-1, 0, set())``."""
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


def _arming(what: int) -> Callable[..., None]:
    """A batch's end: the watch starts at the first one (not the sanity check's batches, in fit)."""

    def hook(self: "HangWatchdog", trainer: L.Trainer, *_: object) -> None:
        if not self.armed and (what == TRAINING or trainer.state.fn != "fit"):
            self._since, self.armed = time.monotonic(), True

    return hook


class HangWatchdog(Callback):
    """Ends a multi-process run whose ranks all stopped progressing, in the one line described above.

    Args:
        timeout: Seconds without progress on any rank; ``None``: never (``run.hang_timeout``).
        liveness: Every rank's beat (``lightkeep.liveness``), whose thread calls this after each read.
        report: Prints the line for a rank and ends the run (``RankFailures.report``): ``report(rank, how)``.
    """

    def __init__(self, timeout: float | None, liveness: Liveness, report: Callable[[int, str], None]) -> None:
        self.timeout, self.liveness, self.report = timeout, liveness, report
        self.armed = False
        self._since = self._ticked = 0.0

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self.timeout is None:
            return
        self.armed = False
        self._since = self._ticked = time.monotonic()
        if self._check not in self.liveness.watchers:
            self.liveness.watchers.append(self._check)

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.armed = False

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self.armed = False  # a preemption's save takes as long as it takes

    on_train_batch_end = _arming(TRAINING)
    on_validation_batch_end = on_test_batch_end = on_predict_batch_end = _arming(-1)

    # The loop's end: what follows (the last write, the process group's end) takes as long as it takes
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.armed = False

    on_test_end = on_predict_end = on_train_end

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.state.fn == "validate":  # not a validation within fit
            self.armed = False

    def _check(self, beats: dict[int, Beat | None], now: float) -> None:
        """After each read of the beats, on the liveness thread: reports a hang when there is one."""
        if now - self._ticked > FROZEN_S + TICK_S:
            self._since = now  # this process did not run either (Ctrl-Z, a suspend): count from now
        self._ticked = now
        if not self.armed or self.timeout is None or not self.liveness.looping:
            return
        culprit, quiet, frozen = stalled(beats, now, self._since, self.timeout)
        if culprit < 0:
            return
        beat = beats[culprit]
        step, what = (beat.step, WHAT[beat.what]) if beat is not None and beat.progress > 0 else (0, WHAT[0])
        here = self.liveness.places[self.liveness.rank].node
        away = beat is not None and beat.node != here
        cause = (STOPPED_AWAY if away else STOPPED) if culprit in frozen else "its main thread is stuck"
        how = f"made no progress for {quiet:.0f} s while {what} at global step {step} ({cause}; run.hang_timeout "
        how += f"{self.timeout:g} s)"
        self.report(beat.rank if beat is not None else culprit, how)
