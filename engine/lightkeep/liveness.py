"""Every rank's progress, seen from every rank on any machine: the one signal behind a hung rank's and a dead rank's
one line (``hang_watchdog``, ``rank_failures``), under Lightning's launcher, torchrun (static and c10d rendezvous)
and SLURM alike.

Each rank keeps a beat: the time its thread last ran, the time of its last progress, the global step, what it was
doing and where in the training loop (and the first line of its own exception, once it raised). Its hooks store it
in its heartbeat (``lightkeep.heartbeat``: no system call, no device sync), where the ranks of its machine (and
temporary folder) read it as it is; its thread marks it alive 5 times a second. When some rank runs on another
machine (or has another temporary folder), the thread also sends the beat to the TCP store the process group was set
up with (the server at the cluster environment's main address and port that every launcher starts: in rank 0's
process under Lightning's launcher and SLURM, in node 0's agent under torchrun's rendezvous) within ``TICK_S`` of
its progress (a send that waits for no answer), and once a second reads there, in one request, the beats of those
ranks. No two machines need a common clock: a reader times another machine's beat by when it saw it change, so a
rank whose beats stop changing has stopped running (a stopped or dead process, a lost machine), and the step it
names is the one that rank had at most ``TICK_S`` before it stopped. The store also carries the first verdict a rank
reaches, so that every node says the same line. On one machine the store is not used at all.

The store is reached through a client of this module's own. A store that does not answer within ``STORE_S`` (the
process holding it stopped) is not asked again, and one that fails (gone) is asked again after ``RETRY_S`` (torch
logs each failed request on stderr, with its C++ frames); this rank keeps what it saw last, and the other
machines' beats go stale.
"""

import contextlib
import json
import os
import socket
import struct
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn

from lightkeep.compat_loops import batches_begun
from lightkeep.distributed import every_rank
from lightkeep.heartbeat import PREFIX, Heartbeat, read_cell, read_note, remove_heartbeats_of_ended_runs

WHAT = ("starting", "training", "validating", "saving a checkpoint", "testing", "predicting")
TRAINING, VALIDATING, SAVING, TESTING, PREDICTING = range(1, 6)
TICK_S = 0.2  # how often a rank's thread marks its beat alive
STORE_TICK_S = 1.0  # how often it publishes its beat to the store and reads the other machines'
FROZEN_S = 5.0  # a rank whose beat has not been marked alive for this long does not run (stopped, dead, unreachable)
STORE_S = 3.0  # the store client's timeout for one request
RETRY_S = 10.0  # after a request failed, how long the store is left alone
# One beat in the store: times published, seconds since the last progress (the publisher's clock), step, what, point.
WIRE = struct.Struct("<qdqqq")


@dataclass(frozen=True)
class Beat:
    """A rank's beat as this rank sees it: ``alive`` when it last ran and ``progress`` when it last made progress,
    both in this process's ``time.monotonic()``; where it runs (``pid`` on ``host``, its ``node``)."""

    alive: float
    progress: float
    step: int
    what: int
    point: int
    pid: int
    rank: int
    node: int = 0
    host: str = ""


@dataclass(frozen=True)
class Place:
    rank: int
    node: int
    local: int
    host: str
    pid: int


class _Failed:
    """A store request that raised: a store that is gone, a network error."""


def _attempt(do: Callable[[Any], Any], store: Any) -> Any:
    try:
        return do(store)
    except (RuntimeError, ValueError, OSError):  # DistStoreError, DistNetworkError
        return _Failed()


def _progress(what: int, phase: int = -1) -> Callable[..., None]:
    """A hook that stores progress in this rank's heartbeat; ``phase``: a training batch's start, backward or end."""

    def hook(self: "Liveness", trainer: L.Trainer, *_: object) -> None:
        if self.heart is not None:
            self.heart.beat(trainer.global_step, what, 3 * batches_begun(trainer) + phase if phase >= 0 else -1)

    return hook


class Liveness(Callback):
    """This rank's beat, kept and published, and every rank's, read while a multi-process run runs.

    ``watchers`` are called on the background thread after each read (once a second) with ``(beats, now)``;
    ``verdict`` is the first verdict any rank claimed (``claim``), once this rank has read it. Nothing runs with one
    process.
    """

    def __init__(self) -> None:
        self.places: list[Place] = []  # every rank's, by global rank
        self.rank = 0
        self.heart: Heartbeat | None = None
        self.beats: dict[int, Beat | None] = {}
        self.verdict: tuple[int, str] | None = None
        self.watchers: list[Callable[[dict[int, Beat | None], float], None]] = []
        self._looping = False
        self._trainer: L.Trainer | None = None
        self._store: Any = None
        self._prefix = ""
        self._files: dict[int, Path] = {}  # the heartbeats of the ranks of this machine and temporary folder
        self._published = 0
        self._seen: dict[int, tuple[int, float, float]] = {}  # rank: (times it published, when seen, its progress)
        self._remote: dict[int, Beat] = {}  # each rank's beat as the store shows it
        self._present: set[str] = set()  # the beats' keys known to be in the store
        self._failed_at = -RETRY_S
        self._stuck = False  # the store did not answer a request: it is not asked again
        self._sent = 0.0  # the time of the progress this rank last published
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def active(self) -> bool:
        return self.heart is not None

    @property
    def looping(self) -> bool:
        """A loop runs, and this rank is not handling an exception (Lightning marks the run interrupted before any
        ``on_exception``: a preemption's save, a rank's own error): what the watchers judge."""
        return self._looping and self._trainer is not None and not self._trainer.interrupted

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self.heart is not None or trainer.world_size < 2 or not (dist.is_available() and dist.is_initialized()):
            return
        # rank 0's token names this stage's beats: a torchrun agent's store outlives the workers it restarts
        folder = tempfile.gettempdir()
        here = (uuid.uuid4().hex[:12], os.getpid(), trainer.node_rank, trainer.local_rank, socket.gethostname(), folder)
        every = every_rank(here)
        token = every[0][0]
        self.places = [Place(rank, node, local, host, pid) for rank, (_, pid, node, local, host, _) in enumerate(every)]
        self.rank, self._prefix, self._trainer = trainer.global_rank, f"lightkeep/{token}", trainer
        near = [rank for rank, (*_, host, tmp) in enumerate(every) if (host, tmp) == (here[4], folder)]
        self._files = {rank: Path(folder) / f"{PREFIX}-{every[rank][1]}-{token}-{rank}" for rank in near}
        if trainer.local_rank == 0:
            remove_heartbeats_of_ended_runs()
        environment = trainer.strategy.cluster_environment
        try:
            self.heart = Heartbeat(self._files[self.rank], self.rank)
            if len(near) < len(self.places):  # another machine (or temporary folder): through the store
                self._store = dist.TCPStore(environment.main_address, environment.main_port, is_master=False,
                                            timeout=timedelta(seconds=STORE_S), wait_for_workers=False)  # fmt: skip
        except (RuntimeError, ValueError, OSError) as error:  # the run goes on, unwatched
            rank_zero_warn(f"run.hang_timeout: no rank's progress is watched ({error})")
            self.end()
            return
        self.beats, self.verdict = {place.rank: None for place in self.places}, None
        self._seen, self._remote, self._present, self._failed_at, self._published = {}, {}, set(), -RETRY_S, 0
        self._stuck, self._sent = False, 0.0
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, daemon=True, name="liveness")
        self._thread.start()

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.end()

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._looping = False  # the thread stops; the store stays open for rank_failures' report after this
        self._end_thread()

    def end(self) -> None:
        self._looping = False
        self._end_thread()
        if self.heart is not None:
            self.heart.close()
        self.heart = self._store = self._trainer = None

    def remove_heartbeats(self) -> None:
        """This machine's ranks' heartbeats, before this rank ends them all (at once: nothing else would)."""
        for path in self._files.values():
            path.unlink(missing_ok=True)

    def _end_thread(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        self._thread = None

    # Progress: a few hooks of every loop, each a store into the heartbeat
    on_train_batch_start = _progress(TRAINING, phase=0)
    on_before_backward = _progress(TRAINING, phase=1)
    on_train_batch_end = _progress(TRAINING, phase=2)
    on_validation_batch_start = on_validation_batch_end = _progress(VALIDATING)
    on_test_batch_start = on_test_batch_end = _progress(TESTING)
    on_predict_batch_start = on_predict_batch_end = _progress(PREDICTING)
    on_save_checkpoint = _progress(SAVING)

    # The loop: its start and end. What follows (the last write, the process group's end, a rank that exits first
    # with the store in its process) is not watched.
    def _loop_starts(self, trainer: L.Trainer, *_: object) -> None:
        self._looping = self.heart is not None

    def _loop_ends(self, trainer: L.Trainer, *_: object) -> None:
        self._looping = False
        self._end_thread()

    on_train_start = on_test_start = on_predict_start = _loop_starts
    on_train_end = on_test_end = on_predict_end = _loop_ends

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.state.fn == "validate":  # not a validation within fit
            self._loop_starts(trainer)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.state.fn == "validate":
            self._loop_ends(trainer)

    # The store
    def _key(self, what: str) -> str:
        return f"{self._prefix}/{what}"

    def _request(self, do: Callable[[Any], Any]) -> Any:
        """``do(store)``, or ``None`` when there is no store, it failed lately, or it fails or does not answer now.

        On a thread of its own: a request to a store whose process is stopped waits for ever, whatever the client's
        timeout (torch 2.13). Such a store is not asked again, and the request's thread stays behind, blocked."""
        store = self._store
        if store is None or self._stuck or time.monotonic() - self._failed_at < RETRY_S:
            return None
        answer: list[Any] = []
        asked = threading.Thread(target=lambda: answer.append(_attempt(do, store)), daemon=True, name="liveness-store")
        asked.start()
        asked.join(STORE_S)
        if not answer:
            self._stuck = True
            return None
        if isinstance(answer[0], _Failed):
            self._failed_at = time.monotonic()
            return None
        return answer[0]

    def claim(self, rank: int, how: str) -> tuple[int, str]:
        """The run's verdict: this one, unless a rank of another machine claimed one first (that one then)."""
        mine = json.dumps([rank, how])
        held = self._request(lambda store: store.compare_set(self._key("verdict"), "", mine))
        if held:
            with contextlib.suppress(ValueError, TypeError):
                rank, how = json.loads(held)
        return rank, how

    def note(self, text: str) -> None:
        """The first line of this rank's own exception, for the rank that reports it (in its heartbeat, and in the
        store for other machines: a send that waits for no answer)."""
        if self.heart is not None:
            self.heart.note(text)
        store = self._store
        if store is not None and not self._stuck:
            _attempt(lambda s: s.set(self._key(f"note/{self.rank}"), text), store)

    def note_of(self, rank: int) -> str | None:
        if rank in self._files:
            return read_note(self._files[rank])
        key = self._key(f"note/{rank}")
        held = self._request(lambda store: store.get(key) if store.check([key]) else b"")
        return held.decode() if held else None

    def read(self, publish: bool = True) -> dict[int, Beat | None]:
        """Every rank's beat as of now: this machine's from their heartbeats, the others' as last read from the
        store (``publish``: this rank's beat goes to the store, and the others' and the verdict are read)."""
        now, heart = time.monotonic(), self.heart
        if heart is None:
            return dict(self.beats)
        if publish and self._store is not None:
            self._exchange(heart, now)
        for place in self.places:
            path = self._files.get(place.rank)
            cell = heart.cell() if place.rank == self.rank else read_cell(path) if path is not None else None
            if cell is not None:  # else: another machine's, or another temporary folder's, as the store showed it
                self.beats[place.rank] = Beat(*cell[:5], place.pid, place.rank, place.node, place.host)
            elif place.rank in self._remote:
                self.beats[place.rank] = self._remote[place.rank]
        return dict(self.beats)

    def _own(self, heart: Heartbeat, now: float) -> bytes:
        _, progress, step, what, point, _, _ = heart.cell()
        self._published += 1
        return WIRE.pack(self._published, now - progress, step, what, point)

    def _publish(self, heart: Heartbeat) -> None:
        """This rank's beat to the store, when it progressed since it last went there: a send that waits for no
        answer, so that another machine learns the step within ``TICK_S``."""
        progress = heart.cell()[1]
        store = self._store
        if progress == self._sent or store is None or self._stuck or time.monotonic() - self._failed_at < RETRY_S:
            return
        self._sent = progress
        if isinstance(_attempt(lambda s: s.set(self._key(f"beat/{self.rank}"), self._own(heart, time.monotonic())),
                               store), _Failed):  # fmt: skip
            self._failed_at = time.monotonic()

    def _exchange(self, heart: Heartbeat, now: float) -> None:
        own = self._own(heart, now)
        keys = [self._key(f"beat/{place.rank}") for place in self.places]
        verdict = self._key("verdict")

        def exchange(store: Any) -> tuple[list[bytes], bytes | None]:
            store.set(keys[self.rank], own)
            # a key asked for before its rank wrote it would hold the request up to the timeout
            self._present |= {key for key in keys if key not in self._present and store.check([key])}
            present = [key for key in keys if key in self._present]
            values = dict(zip(present, store.multi_get(present), strict=True))
            return [values.get(key, b"") for key in keys], store.get(verdict) if store.check([verdict]) else None

        got = self._request(exchange)
        if got is None:
            return
        values, held = got
        for place, value in zip(self.places, values, strict=True):
            if len(value) == WIRE.size and place.rank != self.rank:
                self._see(place, WIRE.unpack(value), now)
        if held and self.verdict is None:
            with contextlib.suppress(ValueError, TypeError):
                rank, how = json.loads(held)
                self.verdict = (int(rank), str(how))

    def _see(self, place: Place, value: tuple[int, float, int, int, int], now: float) -> None:
        published, quiet, step, what, point = value
        seen = self._seen.get(place.rank)
        if seen is None or seen[0] != published:  # it published since: it ran then
            seen = (published, now, now - quiet)
            self._seen[place.rank] = seen
        self._remote[place.rank] = Beat(seen[1], seen[2], step, what, point, place.pid, place.rank, place.node,
                                        place.host)  # fmt: skip

    def _run(self) -> None:
        ticks, every = 0, round(STORE_TICK_S / TICK_S)
        while True:
            heart = self.heart
            if heart is None or self._stop.is_set():
                return
            heart.alive()
            self._publish(heart)
            if ticks % every == 0:
                beats = self.read()
                if self._stop.is_set():
                    return
                for watch in self.watchers:
                    watch(beats, time.monotonic())
            ticks += 1
            self._stop.wait(TICK_S)
