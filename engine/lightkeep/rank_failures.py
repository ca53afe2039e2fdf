"""A dead rank in one line: which rank failed and how, the checkpoint to resume from, and the command that does (the
line, and what it replaces: docs/checkpoints.md, 'A dead rank, in one line').

Under Lightning's ``ddp`` launcher rank 0 is the process the user started and every other rank is its child. The
survivors see that a peer is gone (a watcher thread, or ``on_exception``) and rank 0 (each other rank when rank 0
died) prints the line and exits with code 1 at once. A rank whose own code raised keeps its traceback (the cause) and
leaves its exception's first line in ``<run>/.failures/`` for the reporter. ``PROJECT_FAILURE_REPORT=FILE`` also
writes the line to FILE (``scripts/train_resilient.sh`` repeats it when it restarts). A hung rank is reported through
``report`` too (``lightkeep.hang_watchdog``). Under torchrun or SLURM the launcher reports failed ranks itself and
this stays out of the way.

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
from collections.abc import Iterable
from pathlib import Path

import lightning as L
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.environments import LightningEnvironment
from lightning.pytorch.utilities.exceptions import SIGTERMException

from lightkeep.compat import child_observer_waits, launched_children
from lightkeep.compat_torch import PEER_GONE
from lightkeep.config import SWITCHABLE, entry
from lightkeep.console import first_line
from lightkeep.run_checkpoints import find_last_checkpoint
from lightkeep.signals import INTERRUPTED_EXIT_CODE, PREEMPTED_EXIT_CODE

REPORT_ENV = "PROJECT_FAILURE_REPORT"
NOTES = ".failures"  # in the run folder: "<rank>.txt" holds the first line of that rank's own exception
# Stops every rank makes on purpose (Ctrl-C, preemption, the NaN guard's SystemExit): no rank failed.
DELIBERATE = (KeyboardInterrupt, SystemExit, SIGTERMException)
STOP_CODES = (PREEMPTED_EXIT_CODE, INTERRUPTED_EXIT_CODE)
WAIT_S = 5.0  # how long a survivor waits to learn which rank died and how
HOLD_S = WAIT_S + 5.0  # how long Lightning's observer waits for this report before it kills every rank
STOP_HOLD_S = 60.0  # how long it waits for this process to end a stop every rank makes (its teardown, its loggers)


def is_peer_gone(error: BaseException) -> bool:
    """The error a collective raises when another rank's process is gone (gloo), not an error of this rank."""
    text = str(error)
    return isinstance(error, RuntimeError) and any(s in text for s in PEER_GONE)


def resume_command(argv: list[str]) -> str:
    """``python -m lightkeep fit ARGS --ckpt_path last`` from this process's arguments, without its ``--ckpt_path``
    and without the ``--model null`` / ``--data null`` the engine put before a class (``start_from_class_defaults``):
    the command the user typed."""
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
    return shlex.join(["python", *entry().launch, *args, "--ckpt_path", "last"])


def launched_by_lightning(trainer: L.Trainer) -> bool:
    """A multi-process run whose ranks Lightning's ``ddp`` launcher started (not torchrun/SLURM): the other ranks of
    this machine are its local rank 0's children."""
    return trainer.world_size > 1 and type(trainer.strategy.cluster_environment) is LightningEnvironment


class RankFailures(Callback):
    """Turns the death of one rank of a Lightning-launched DDP run into the one-line report described above."""

    def __init__(self) -> None:
        self.rank, self.parent, self.active = 0, 0, False
        self.notes: Path | None = None
        self.family = Path()
        self.children: list = []
        self._watcher: threading.Thread | None = None
        self._done = self._own_error = False
        self._lock = threading.Lock()  # one report per process: the watcher's, on_exception's or a hang's
        self._settled = threading.Event()  # set once this process reports nothing: Lightning's observer may kill
        self._stopping = threading.Event()  # set once this process stops on purpose, as every rank does
        self._undo_observer = lambda: None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        root = Path(trainer.default_root_dir)
        self.rank, self.parent, self.children = trainer.global_rank, os.getppid(), launched_children(trainer)
        self.active, self.notes, self.family = launched_by_lightning(trainer), root / NOTES, root.parent
        if not self.active:
            return
        if self.rank == 0 and self.notes.is_dir():
            for old in self.notes.glob("*.txt"):  # an earlier failure of this run folder
                old.unlink(missing_ok=True)
        if self.children:
            self._settled.clear()
            self._stopping.clear()
            self._undo_observer = child_observer_waits(trainer, self._hold)
        if self._watcher is None:
            self._done = False
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

    def _hold(self, codes: list[int | None]) -> None:
        """Called by Lightning's observer once a rank exited with ``codes`` (non-zero), before it kills every rank."""
        if any(code not in (0, None, *STOP_CODES) for code in codes) or not self._stopping.wait(HOLD_S):
            self._settled.wait(HOLD_S)  # a failure, or a rank stopping alone: after this process's report
        else:
            time.sleep(STOP_HOLD_S)  # every rank stops on purpose, this process too: it exits by itself meanwhile

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        if not self.active or isinstance(exception, DELIBERATE):
            self._end(stopping=True)  # every rank stops here on purpose; a rank exiting first is no failure
            return
        if not is_peer_gone(exception):
            self._own_error = True
            if self.notes is not None:  # this rank's own error: its traceback follows, the reporter names it
                self.notes.mkdir(parents=True, exist_ok=True)
                (self.notes / f"{self.rank}.txt").write_text(first_line(exception))
            # _settled stays clear: this process ends itself after its own message. When every rank raised, a
            # child exits first, and Lightning's observer, let go here, SIGKILLed rank 0 mid-message (exit -9, 1
            # CI run in ~20); held, it waits HOLD_S, by when this process is gone.
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

    def _note(self, rank: int) -> str | None:
        path = self.notes / f"{rank}.txt" if self.notes is not None else None
        return path.read_text().strip() if path is not None and path.is_file() else None

    def _how(self, rank: int, code: int | None = None) -> str:
        # code None: rank 0, not this process's child (its exit status is its shell's to see)
        if code is not None and code < 0:
            hint = " (kill -9, or out of memory)" if -code == signal.SIGKILL else ""
            return f"was killed by {signal.Signals(-code).name}{hint}"
        note = self._note(rank)
        if note:
            return f"raised {note}"
        return "was killed by a signal (kill -9, or out of memory)" if code is None else f"exited with code {code}"

    def report(self, rank: int, how: str, others: Iterable[int] = ()) -> None:
        """Prints the line for ``rank`` ("rank 1 ``how``; ...") and ends the run: this process, the ranks it started
        and the processes ``others`` (other ranks, when this one did not start them). Thread-safe; never returns."""
        if not self._lock.acquire(blocking=False):
            time.sleep(60)  # the other thread is reporting and ends the process
        for proc in self.children:  # the other ranks, still waiting in a collective (or stopped: SIGKILL ends it)
            if proc.poll() is None:
                proc.kill()
        found = find_last_checkpoint(self.family)
        saved = "No checkpoint was written yet."
        if found is not None:
            saved = f"Newest complete checkpoint, intact: {found[0]} (step {found[1]})."
        line = f"error: rank {rank} {how}; the other ranks stopped. {saved} Resume: {resume_command(sys.argv)}"
        sys.stdout.flush()
        print(line, file=sys.stderr, flush=True)
        if os.environ.get(REPORT_ENV):  # for a restarting script: what happened, without the command it runs itself
            Path(os.environ[REPORT_ENV]).write_text(f"rank {rank} {how}; {saved[0].lower()}{saved[1:-1]}\n")
        own = {proc.pid for proc in self.children}
        for pid in others:  # after the line: the shell returns when rank 0 ends, and this may be its child
            if pid not in own and pid != os.getpid():
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
        for proc in self.children:  # reaped: no process of the run is left, not even a zombie
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
        # At once: unwinding would print the gloo traceback of this rank, and a child still in a collective could
        # wait; exit code 1 like any failed run.
        os._exit(1)
