"""Preemption (SIGTERM, SIGUSR1) and Ctrl-C: a saved ``last.ckpt`` and a non-zero exit code on every rank."""

import os
import signal
import threading
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.plugins.environments import SLURMEnvironment
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.exceptions import SIGTERMException

from project.engine.checkpoint_io import wait_for_writes
from project.engine.compat import request_stop_at_batch_end

# Exit codes of a run stopped by a signal after saving last.ckpt: 128 + the signal's number, as a shell reports a
# process killed by it, so launchers (torchrun, SLURM, CI, scripts) see a failure and can restart.
PREEMPTED_EXIT_CODE = 128 + signal.SIGTERM  # 143
INTERRUPTED_EXIT_CODE = 128 + signal.SIGINT  # 130, Ctrl-C


class CtrlCAgain(SystemExit):
    """The second Ctrl-C: the run stops where it is, without saving, exit code 130.

    A ``SystemExit``, not a ``KeyboardInterrupt``: Lightning ends a KeyboardInterrupt with ``sys.exit(1)``, and one
    raised outside its handler (during the first Ctrl-C's save) ends in a traceback. Lightning's handler of any
    other exception calls the callbacks' ``on_exception``, tears the run down (the loggers' files closed, a
    checkpoint write under way finished) and raises it again: the exit code is this one's."""

    def __init__(self) -> None:
        super().__init__(INTERRUPTED_EXIT_CODE)


class Preemption(Callback):
    """Turns a preemption signal or Ctrl-C into a saved ``last.ckpt`` and a non-zero exit.

    Lightning already catches SIGTERM and stops every rank at the same batch by raising ``SIGTERMException``, but
    the process then exits 0 (Lightning issue #21623), so a launcher takes a killed run for a finished one.
    Outside SLURM, SIGUSR1 is routed to the same path; under SLURM it stays Lightning's (checkpoint + requeue).

    Ctrl-C (SIGINT) gets the same ending: Lightning's KeyboardInterrupt handling saves nothing, and a
    KeyboardInterrupt lands wherever each rank happens to be, so no checkpoint could be gathered. Here the first
    Ctrl-C only sets a flag; at the next training batch end the ranks agree (one all-reduce of one value per step,
    under DDP only) and Lightning's SIGTERM stop runs on all of them at the same point. A validation that starts
    after that batch runs to its end first: Lightning would stop it after its first batch, where nothing can be
    saved that resumes exactly. A second Ctrl-C, even during that save, stops at once without saving (a checkpoint
    write under way is finished: cut short, it would be lost), also with exit code 130 (``CtrlCAgain``).

    The SIGINT and SIGUSR1 handlers found at ``setup`` (an IPython kernel's, a launcher's) are set back at
    ``teardown`` and after a failure.
    """

    def __init__(self) -> None:
        self._slurm_handler: Any = None
        self._pending_signal: int | None = None
        self._ctrl_c = False  # seen by this process
        self._interrupted = False  # agreed by all ranks
        self._previous: dict[int, Any] = {}  # the handlers found at setup

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        self._previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGUSR1)}
        if not SLURMEnvironment.detect():
            signal.signal(signal.SIGUSR1, lambda *_: os.kill(os.getpid(), signal.SIGTERM))
        if stage == "fit":
            signal.signal(signal.SIGINT, self._on_ctrl_c)

    def _on_ctrl_c(self, signum: int, _: Any) -> None:
        signal.signal(signal.SIGINT, self._on_ctrl_c_again)
        self._ctrl_c = True
        rank_zero_info(
            "\nCtrl-C: stopping after this batch and saving last.ckpt (Ctrl-C again: stop at once, no save)."
        )

    def _on_ctrl_c_again(self, signum: int, _: Any) -> None:
        rank_zero_info(
            f"\nCtrl-C again: stopping at once, without saving (a checkpoint write under way is finished). Exit code "
            f"{INTERRUPTED_EXIT_CODE}."
        )
        raise CtrlCAgain

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._restore()

    def _restore(self) -> None:
        previous, self._previous = self._previous, {}
        if threading.current_thread() is threading.main_thread():
            for signum, handler in previous.items():
                if handler is not None:  # None: set outside Python, nothing to set back
                    signal.signal(signum, handler)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Under SLURM, Lightning's SIGUSR1 handler checkpoints and requeues inside the signal handler; landing
        # while the main thread holds the TensorBoard writer's lock it deadlocked. Defer it to the next batch end.
        handler = signal.getsignal(signal.SIGUSR1)
        if SLURMEnvironment.detect() and callable(handler) and threading.current_thread() is threading.main_thread():
            self._slurm_handler = handler
            signal.signal(signal.SIGUSR1, self._defer)

    def _defer(self, signum: int, _: Any) -> None:
        self._pending_signal = signum

    def on_train_batch_end(self, trainer: L.Trainer, *_: Any) -> None:
        if self._pending_signal is not None and self._slurm_handler is not None:
            signum, self._pending_signal = self._pending_signal, None
            self._slurm_handler(signum, None)
        ctrl_c = self._ctrl_c
        if trainer.world_size > 1:
            ctrl_c = trainer.strategy.reduce_boolean_decision(ctrl_c, all=False)  # any rank's Ctrl-C stops all
        if ctrl_c:
            self._interrupted = True
            # Lightning's SIGTERM flag: every rank raises SIGTERMException at the end of this batch (after the
            # epoch's validation, if this was its last batch), where the loop's progress is complete.
            request_stop_at_batch_end(trainer)

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._interrupted and not trainer.sanity_checking:
            request_stop_at_batch_end(trainer, stop=False)  # else Lightning stops it after its first batch

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._interrupted and not trainer.sanity_checking:
            request_stop_at_batch_end(trainer)  # Lightning stops right after this validation

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        try:
            self._stop(trainer, exception)
        except CtrlCAgain:  # during the save: Lightning goes on to tear the run down and raises `exception`
            exception.code = INTERRUPTED_EXIT_CODE  # type: ignore[attr-defined]  # a SIGTERMException: a SystemExit
        finally:
            self._restore()  # Lightning skips teardown after a failure; after the save: Ctrl-C again is ours

    def _stop(self, trainer: L.Trainer, exception: BaseException) -> None:
        if not isinstance(exception, SIGTERMException):
            return
        path = last_checkpoint_path(trainer)
        code = INTERRUPTED_EXIT_CODE if self._interrupted else PREEMPTED_EXIT_CODE
        what = "Interrupted" if self._interrupted else "Preempted"
        if trainer.validating or trainer.sanity_checking:
            # A checkpoint taken mid-validation resumes past that validation (its metric point and top-k check
            # would be lost); the newest one on disk, what --ckpt_path last takes, resumes exactly. (Ctrl-C waits
            # for the validation to end; a preemption may not have that long.)
            rank_zero_info(
                f"{what} during validation: nothing saved, the checkpoints on disk kept; resume with --ckpt_path "
                f"last (the newest). Exit code {code}."
            )
        elif path is not None:
            # every rank takes part (RNG states are gathered); rank 0 writes
            trainer.save_checkpoint(path, weights_only=False)
            wait_for_writes(trainer)  # on disk before saying so (and before the exit)
            rank_zero_info(f"{what}: saved {path}; resume with --ckpt_path last. Exit code {code}.")
        exception.code = code  # SIGTERMException is a SystemExit: this becomes the exit status


def last_checkpoint_path(trainer: L.Trainer) -> str | None:
    for callback in trainer.checkpoint_callbacks:
        if isinstance(callback, ModelCheckpoint) and callback.save_last and callback.dirpath:
            return os.path.join(callback.dirpath, callback.CHECKPOINT_NAME_LAST + callback.FILE_EXTENSION)
    return None
