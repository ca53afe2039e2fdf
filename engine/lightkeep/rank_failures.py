"""A dead rank in one line: which rank failed and how, the checkpoint to resume from, and the command that does (the
line, and what it replaces: docs/checkpoints.md, 'A dead rank, in one line').

Under Lightning's ``ddp`` launcher rank 0 is the process the user started and every other rank is its child: the
survivors see that a peer is gone (a watcher thread, or ``on_exception``) from its exit status. Under torchrun, SLURM
or any other launcher the ranks are no one's children and may run on other machines: a rank that sees a peer vanish
(gloo's error out of a collective) names the rank whose beats stopped (``lightkeep.liveness``), and a rank whose
peer's process on the same machine is gone names it at once. A rank whose own code raised keeps its traceback (the
cause) and leaves its exception's first line in the store for the reporter. A hung rank is reported through
``report`` too (``lightkeep.hang_watchdog``). The first verdict any rank claims is the one every node says, each in
one line by its lowest rank that still runs; every process of that node ends, and each rank exits with code 1.
``PROJECT_FAILURE_REPORT=FILE`` also writes the line to FILE (``scripts/train_resilient.sh`` repeats it when it
restarts, ``lightkeep.torchrun`` says nothing more when a rank has said it).

Lightning's launcher has a watcher of its own, ``_ChildProcessObserver``: every 5 s it polls the ranks, and when one
failed it SIGKILLs all of them and rank 0 with them, at once, without a word. Rank 0 sees a death within 0.2 s, but
printing the line takes a moment too (finding the intact checkpoint): in 1 of 23 kills of rank 1 during a save
Lightning's poll fell in that moment and the run ended with exit code 137 and only Lightning's message. Here its kill
first waits for this report (``compat.child_observer_waits``), which ends the process itself; when this reports
nothing, Lightning's kill follows ``HOLD_S`` later. A stop every rank makes on purpose (a preemption: exit code 143)
is no failure, but a rank that exits first looks like one to that poll: under load it SIGKILLed rank 0 while it was
still finishing the same stop (exit -9 for 143, 1 long-tier run in ~20). Once this process stops on purpose too,
the kill waits for it to end by itself (``STOP_HOLD_S`` at most).
"""

import contextlib
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import lightning as L
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.environments import LightningEnvironment, SLURMEnvironment, TorchElasticEnvironment
from lightning.pytorch.utilities.exceptions import SIGTERMException

from lightkeep.compat import child_observer_waits, launched_children
from lightkeep.compat_torch import PEER_GONE
from lightkeep.config import SWITCHABLE, entry
from lightkeep.console import first_line
from lightkeep.heartbeat import process_state
from lightkeep.liveness import FROZEN_S, WHAT, Beat, Liveness, Place
from lightkeep.run_checkpoints import find_last_checkpoint
from lightkeep.signals import INTERRUPTED_EXIT_CODE, PREEMPTED_EXIT_CODE

REPORT_ENV = "PROJECT_FAILURE_REPORT"
RESUME_ENV = "PROJECT_RESUME"  # the command that resumes the job, as scripts/torchrun.sh and slurm.sbatch set it
# Stops every rank makes on purpose (Ctrl-C, preemption, the NaN guard's SystemExit): no rank failed.
DELIBERATE = (KeyboardInterrupt, SystemExit, SIGTERMException)
STOP_CODES = (PREEMPTED_EXIT_CODE, INTERRUPTED_EXIT_CODE)
WAIT_S = 5.0  # how long a survivor waits to learn which rank died and how
DEAD_S = 3.0  # after a collective lost its peer: a rank of another machine whose beats stopped this long is gone
HOLD_S = WAIT_S + 5.0  # how long Lightning's observer waits for this report before it kills every rank
STOP_HOLD_S = 60.0  # how long it waits for this process to end a stop every rank makes (its teardown, its loggers)


def is_peer_gone(error: BaseException) -> bool:
    """The error a collective raises when another rank's process is gone (gloo), not an error of this rank."""
    text = str(error)
    return isinstance(error, RuntimeError) and any(s in text for s in PEER_GONE)


def resume_command(argv: list[str]) -> str:
    """The command that resumes this job: the one its launch script says (``PROJECT_RESUME``, which
    ``scripts/torchrun.sh`` and ``slurm.sbatch`` set), else ``python -m lightkeep fit ARGS --ckpt_path last`` from
    this process's arguments, without its ``--ckpt_path`` and without the ``--model null`` / ``--data null`` the engine
    put before a class (``start_from_class_defaults``): the command the user typed, after ``srun`` or
    ``torchrun ...`` (its own flags, as given) when one of them started this process."""
    if os.environ.get(RESUME_ENV):
        return os.environ[RESUME_ENV]
    args, skip = [], False
    for i, arg in enumerate(argv[1:], start=1):
        if skip:
            skip = False
        elif arg == "--ckpt_path" or (arg in SWITCHABLE and argv[i + 1 : i + 2] == ["null"]):
            skip = True
        elif not arg.startswith("--ckpt_path="):
            args.append(arg)
    if args and args[0] in ("validate", "test", "predict"):
        args[0] = "fit"
    if TorchElasticEnvironment.detect():
        return "torchrun ... " + shlex.join([*entry().launch, *args, "--ckpt_path", "last"])
    command = shlex.join(["python", *entry().launch, *args, "--ckpt_path", "last"])
    return f"srun {command}" if SLURMEnvironment.detect() else command


def launched_by_lightning(trainer: L.Trainer) -> bool:
    """A multi-process run whose ranks Lightning's ``ddp`` launcher started (not torchrun/SLURM): the other ranks of
    this machine are its local rank 0's children."""
    return trainer.world_size > 1 and type(trainer.strategy.cluster_environment) is LightningEnvironment


class RankFailures(Callback):
    """Turns the death of one rank of a DDP run into the one-line report described above.

    Args:
        liveness: Every rank's beat (``lightkeep.liveness``): who is gone, the verdict every node says, the ranks'
            own errors. Without it (``None``), only Lightning's launcher's children are watched.
    """

    def __init__(self, liveness: Liveness | None = None) -> None:
        self.liveness = liveness
        self.rank, self.parent, self.active, self.lightning = 0, 0, False, False
        self.family = Path()
        self.children: list = []
        self._watcher: threading.Thread | None = None
        self._done = self._own_error = False
        self._lock = threading.Lock()  # one report per process: the watcher's, on_exception's, a hang's, a verdict's
        self._settled = threading.Event()  # set once this process reports nothing: Lightning's observer may kill
        self._stopping = threading.Event()  # set once this process stops on purpose, as every rank does
        self._undo_observer = lambda: None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        root = Path(trainer.default_root_dir)
        self.rank, self.parent, self.children = trainer.global_rank, os.getppid(), launched_children(trainer)
        self.lightning, self.family = launched_by_lightning(trainer), root.parent
        self.active, self._done, self._own_error = trainer.world_size > 1, False, False
        if not self.active:
            return
        if self.liveness is not None and self._tick not in self.liveness.watchers:
            self.liveness.watchers.append(self._tick)
        if self.children:
            self._settled.clear()
            self._stopping.clear()
            self._undo_observer = child_observer_waits(trainer, self._hold)
        if self.lightning and self._watcher is None:
            # Not only the next collective's error: rank 0 may be far from one (and Lightning's own observer
            # SIGKILLs it, silently, within 5 s of a child's death), and NCCL reports a dead peer only at its timeout.
            # So rank 0 watches its children, and the others watch rank 0, their parent.
            self._watcher = threading.Thread(target=self._watch, daemon=True, name="rank-failures")
            self._watcher.start()

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._end()  # before DestroyProcessGroup's barrier (this callback comes first): rank 0 may exit next

    def _end(self, stopping: bool = False) -> None:
        """Nothing to report: the watcher stops, and Lightning's observer is as it was; ``stopping``: this process
        stops on purpose, as every rank does, and the observer keeps waiting for it to end (``_hold``)."""
        self._done = True
        self._settled.set()
        if stopping:
            self._stopping.set()
        else:
            self._undo_observer()
            self._undo_observer = lambda: None
        watcher, self._watcher = self._watcher, None
        if watcher is not None and watcher is not threading.current_thread():
            watcher.join()

    def _watch(self) -> None:
        while not self._done:
            for i, proc in enumerate(self.children):
                code = proc.poll()
                # a signal, or an exception this rank left a note for; not a deliberate exit (NaN stop, preemption)
                if code and code not in STOP_CODES and not self._own_error and (code < 0 or self._note(i + 1)):
                    self.report(i + 1, self._how(i + 1, code))
            if self.rank != 0 and os.getppid() != self.parent and not self._done and not self._own_error:
                self.report(0, self._how(0))
            time.sleep(0.2)

    def _tick(self, beats: dict[int, Beat | None], now: float) -> None:
        """After each read of the beats, on the liveness thread: another rank's verdict ends this process too; under
        another launcher than Lightning's (whose ranks are watched by ``_watch``), so does a peer of this machine
        whose process is gone (NCCL would report it only at its timeout)."""
        liveness = self.liveness
        if liveness is None or self._done:
            return
        if liveness.verdict is not None:
            self.report(*liveness.verdict)
        if not self.lightning and liveness.looping:
            gone = self._gone(beats, now, here_only=True)
            if gone:
                self.report(*gone[0])

    def _hold(self, codes: list[int | None]) -> None:
        """Called by Lightning's observer once a rank exited with ``codes`` (non-zero), before it kills every rank."""
        if any(code not in (0, None, *STOP_CODES) for code in codes) or not self._stopping.wait(HOLD_S):
            self._settled.wait(HOLD_S)  # a failure, or a rank stopping alone: after this process's report
        else:
            time.sleep(STOP_HOLD_S)  # every rank stops on purpose, this process too: it exits by itself meanwhile

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        if not self.active or isinstance(exception, DELIBERATE):
            self._end(stopping=True)  # every rank stops here on purpose; a rank exiting first is no failure
            if self.liveness is not None:
                self.liveness.end()  # nothing to report: its heartbeat goes (Lightning skips teardown after this)
            return
        if not is_peer_gone(exception):
            self._own_error = True
            if self.liveness is not None:  # this rank's own error: its traceback follows, the reporter names it
                self.liveness.note(first_line(exception))
            # _settled stays clear: this process ends itself after its own message. When every rank raised, a
            # child exits first, and Lightning's observer, let go here, SIGKILLed rank 0 mid-message (exit -9, 1
            # CI run in ~20); held, it waits HOLD_S, by when this process is gone.
            return
        if not self.lightning:
            self._name_the_gone()
            return
        deadline = time.monotonic() + WAIT_S
        if self.rank == 0:
            while time.monotonic() < deadline and not any(p.poll() for p in self.children):
                time.sleep(0.05)
            failed = [(i + 1, p.returncode) for i, p in enumerate(self.children) if p.returncode]
            if not failed:
                self._settled.set()
                return  # no child is gone: not a dead peer after all; the traceback stays
            dead, code = failed[0]
            self.report(dead, self._how(dead, code))
        else:
            # rank 0 is the parent: when it is gone this process is re-parented
            while time.monotonic() < deadline and os.getppid() == self.parent and not self._note(0):
                time.sleep(0.05)
            if os.getppid() == self.parent and not self._note(0):
                return  # rank 0 lives: it reports (another rank died)
            while time.monotonic() < deadline and os.getppid() == self.parent:
                time.sleep(0.05)  # rank 0 raised; let its traceback come first
            self.report(0, self._how(0))

    def _name_the_gone(self) -> None:
        """A collective lost its peer under another launcher than Lightning's: reports the rank that is gone (the
        verdict another rank claimed, else a rank whose process or beats stopped) once it is known, within
        ``WAIT_S``; when none is, the traceback stays."""
        liveness = self.liveness
        if liveness is None or not liveness.active:
            return
        deadline = time.monotonic() + WAIT_S
        while True:
            beats = liveness.read()  # its thread has stopped (an exception): read here
            if liveness.verdict is not None:
                self.report(*liveness.verdict)
            gone = self._gone(beats, time.monotonic())
            if gone:
                self.report(*gone[0])
            if time.monotonic() > deadline:
                return
            time.sleep(0.2)

    def _gone(self, beats: dict[int, Beat | None], now: float, here_only: bool = False) -> list[tuple[int, str]]:
        """``(rank, how)`` of each other rank that is gone: a process of this machine that ended, or (not
        ``here_only``: once a collective has lost a peer) a rank of another machine whose beats stopped ``DEAD_S``."""
        liveness = self.liveness
        if liveness is None or not liveness.places:
            return []
        host = liveness.places[self.rank].host
        gone = []
        for place in liveness.places:
            beat = beats.get(place.rank)
            if place.rank == self.rank:
                continue
            if place.host == host and process_state(place.pid) == "gone":
                cause = "its process ended: killed, out of memory, or exited"
            elif place.host != host and not here_only and (beat is None or now - beat.alive > DEAD_S):
                cause = "its connection closed: its process ended, or its machine is gone"
            else:
                continue
            note = self._note(place.rank)
            doing = f" while {WHAT[beat.what]} at global step {beat.step}" if beat is not None else ""
            gone.append((place.rank, f"raised {note}" if note else f"died{doing} ({cause})"))
        return gone

    def _note(self, rank: int) -> str | None:
        return self.liveness.note_of(rank) if self.liveness is not None else None

    def _how(self, rank: int, code: int | None = None) -> str:
        # code None: rank 0, not this process's child (its exit status is its shell's to see)
        if code is not None and code < 0:
            hint = " (kill -9, or out of memory)" if -code == signal.SIGKILL else ""
            return f"was killed by {signal.Signals(-code).name}{hint}"
        note = self._note(rank)
        if note:
            return f"raised {note}"
        return "was killed by a signal (kill -9, or out of memory)" if code is None else f"exited with code {code}"

    def _speaks(self, culprit: int, beats: dict[int, Beat | None]) -> bool:
        """Whether this rank says the line for its node: the node's lowest local rank whose process still runs (the
        culprit too, when only its main thread is stuck)."""
        places = self.liveness.places if self.liveness is not None else []
        if not places:  # no liveness: rank 0 speaks, or the rank after a rank 0 that is the one gone
            return self.rank == (1 if culprit == 0 else 0)
        now, mine = time.monotonic(), places[self.rank]
        for place in sorted(self._node(places), key=lambda p: p.local):
            if place.rank == self.rank:
                return True
            beat = beats.get(place.rank)
            fresh = beat is not None and now - beat.alive < FROZEN_S
            if fresh and process_state(place.pid) == "running" and mine.host == place.host:
                return False
        return True

    def _node(self, places: list[Place]) -> list[Place]:
        """The ranks of this node (on this machine)."""
        mine = places[self.rank]
        return [place for place in places if place.node == mine.node and place.host == mine.host]

    def report(self, rank: int, how: str) -> None:
        """Ends the run for ``rank`` ("rank 1 ``how``; ..."): the first verdict claimed stands (``rank`` and ``how``
        are this rank's); the node's speaker prints the line, then every process of this node ends, the ranks this
        one started and this one. Thread-safe; never returns."""
        if not self._lock.acquire(blocking=False):
            time.sleep(60)  # the other thread is reporting and ends the process
        liveness = self.liveness
        if liveness is not None and liveness.active:
            rank, how = liveness.claim(rank, how)
        beats = dict(liveness.beats) if liveness is not None else {}
        for proc in self.children:  # the other ranks, still waiting in a collective (or stopped: SIGKILL ends it)
            if proc.poll() is None:
                proc.kill()
        if self._speaks(rank, beats):
            self._say(rank, how)
            node = self._node(liveness.places) if liveness is not None and liveness.places else []
            if liveness is not None:
                liveness.remove_heartbeats()
            for place in node:  # after the line: the shell returns when rank 0 ends, and this may be its child
                if place.rank != self.rank and place.pid not in {proc.pid for proc in self.children}:
                    with contextlib.suppress(OSError):
                        os.kill(place.pid, signal.SIGKILL)
        else:
            time.sleep(WAIT_S)  # the node's speaker says the line and ends this process
        for proc in self.children:  # reaped: no process of the run is left, not even a zombie
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
        # At once: unwinding would print the gloo traceback of this rank, and a child still in a collective could
        # wait; exit code 1 like any failed run.
        os._exit(1)

    def _say(self, rank: int, how: str) -> None:
        places = self.liveness.places if self.liveness is not None else []
        where = ""
        if len({place.node for place in places}) > 1 and rank < len(places):
            where = f" (node {places[rank].node}, host {places[rank].host})"
        found = find_last_checkpoint(self.family)
        saved = "No checkpoint was written yet."
        if found is not None:
            saved = f"Newest complete checkpoint, intact: {found[0]} (step {found[1]})."
        resume = resume_command(sys.argv)
        restarts, done = os.environ.get("TORCHELASTIC_MAX_RESTARTS"), os.environ.get("TORCHELASTIC_RESTART_COUNT")
        if restarts and done and int(restarts) > int(done):  # torchrun --max-restarts: it starts the ranks again
            again = f"restart {int(done) + 1} of {restarts}"
            resume = f"torchrun restarts it ({again}) once every node is back; else {resume}"
        line = f"error: rank {rank}{where} {how}; the other ranks stopped. {saved} Resume: {resume}"
        sys.stdout.flush()
        print(line, file=sys.stderr, flush=True)
        if os.environ.get(REPORT_ENV):  # for a restarting script: what happened, without the command it runs itself
            Path(os.environ[REPORT_ENV]).write_text(f"rank {rank}{where} {how}; {saved[0].lower()}{saved[1:-1]}\n")
