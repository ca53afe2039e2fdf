"""Preemption (SIGTERM, SIGUSR1) and Ctrl-C: a saved ``last.ckpt`` and a non-zero exit code on every rank (what each
signal does: docs/checkpoints.md, 'Preemption' and 'Ctrl-C').

One process stops at the end of the batch the signal came in. Under DDP the ranks agree on the stop through
``lightkeep.agreement``: every rank stops within ``STOP_WITHIN`` (2 x ``AGREE_EVERY``) training batches of a signal
on any rank (optimizer steps, without gradient accumulation), the batch it came in counted, and ``last.ckpt`` is
saved there. A stop in the middle of a gradient accumulation waits for the batch that steps (docs/checkpoints.md,
'Gradient accumulation').
"""

import os
import signal
import threading
from collections.abc import Callable
from typing import Any

import lightning as L
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.plugins.environments import SLURMEnvironment
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.exceptions import SIGTERMException

from lightkeep.agreement import AGREE_EVERY, Agreement
from lightkeep.checkpoint_io import wait_for_writes
from lightkeep.compat import request_stop_at_batch_end, sigterm_without_a_broadcast_per_batch, stop_requested
from lightkeep.compat_loops import accumulating
from lightkeep.run_scope import handlers_kept

# Exit codes of a run stopped by a signal after saving last.ckpt: 128 + the signal's number, as a shell reports a
# process killed by it, so launchers (torchrun, SLURM, CI, scripts) see a failure and can restart.
PREEMPTED_EXIT_CODE = 128 + signal.SIGTERM  # 143
INTERRUPTED_EXIT_CODE = 128 + signal.SIGINT  # 130, Ctrl-C
# A signal is in the ranks' next agreement (at most AGREE_EVERY - 1 batches later), read AGREE_EVERY batches after that
STOP_WITHIN = 2 * AGREE_EVERY  # training batches from the one a signal comes in to the one every rank stops after


class CtrlCAgain(SystemExit):
    """The second Ctrl-C: the run stops where it is, without saving, exit code 130.

    A ``SystemExit``, not a ``KeyboardInterrupt``: Lightning ends a KeyboardInterrupt with ``sys.exit(1)``, and one
    raised outside its handler (during the first Ctrl-C's save) ends in a traceback. Lightning's handler of any
    other exception calls the callbacks' ``on_exception``, tears the run down (the loggers' files closed, a
    checkpoint write under way finished) and raises it again: the exit code is this one's."""

    def __init__(self) -> None:
        super().__init__(INTERRUPTED_EXIT_CODE)


class Preemption(Callback):
    """Turns a preemption signal or Ctrl-C into a saved ``last.ckpt`` and a non-zero exit (exit codes, and what a
    second Ctrl-C does: docs/checkpoints.md, 'Preemption' and 'Ctrl-C').

    Lightning catches SIGTERM and stops at the end of the batch by raising ``SIGTERMException``, but the process then
    exits 0 (Lightning issue #21623), so a launcher takes a killed run for a finished one. Outside SLURM, SIGUSR1 is
    routed to the same path. Lightning's KeyboardInterrupt handling saves nothing, and a KeyboardInterrupt lands
    wherever each rank happens to be, so no checkpoint could be gathered: here the first Ctrl-C only sets a flag, and
    Lightning's SIGTERM stop runs at a training batch end. A validation that starts after that batch runs to its end
    first: Lightning would stop it after its first batch, where nothing can be saved that resumes exactly.

    Under DDP every rank must stop at the same batch (one stopping alone leaves the others waiting in their next
    collective): Lightning's own per-batch broadcast of rank 0's SIGTERM flag is switched off for the fit
    (``compat.sigterm_without_a_broadcast_per_batch``), a SIGTERM, SIGUSR1 or Ctrl-C on any rank only sets that
    rank's flag, and the ranks agree through an ``Agreement`` (``lightkeep.agreement``), a SIGTERM on any rank
    before a Ctrl-C (exit code 143, else 130). A signal that comes in the last batches of the fit, or during its last
    validation, lets it finish.

    The SIGINT and SIGUSR1 handlers found at ``setup`` (an IPython kernel's, a launcher's) are set back at
    ``teardown`` and after a failure, and Lightning's SIGTERM handling with them.
    """

    def __init__(self) -> None:
        self._slurm_handler: Any = None
        self._pending_signal: int | None = None
        self._ctrl_c = False  # seen by this process
        self._sigterm = False  # seen by this process, under DDP (one process: Lightning's own flag)
        self._interrupted = False  # a Ctrl-C agreed by all ranks
        self._preempted = False  # a SIGTERM agreed by all ranks, under DDP
        self._put_back_handlers: Callable[[], None] = lambda: None  # the handlers found at setup
        self._agreement: Agreement | None = None  # under DDP
        self._batch_ends = 0  # of this fit, the same count on every rank
        self._agreed: list[int] | None = None  # sums read at an epoch's end, acted on at the next batch end
        self._undo_sigterm: Any = lambda: None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        self._put_back_handlers = handlers_kept((signal.SIGINT, signal.SIGUSR1))
        if not SLURMEnvironment.detect():
            signal.signal(signal.SIGUSR1, lambda *_: os.kill(os.getpid(), signal.SIGTERM))
        if stage == "fit":
            signal.signal(signal.SIGINT, self._on_ctrl_c)
            if trainer.world_size > 1 and dist.is_available() and dist.is_initialized():
                self._agreement = Agreement(trainer.strategy.root_device, 2)  # (SIGTERM seen, Ctrl-C seen)
                self._batch_ends, self._agreed = 0, None
                # before Lightning registers its SIGTERM handler, which happens after the setup hooks
                self._undo_sigterm = sigterm_without_a_broadcast_per_batch(trainer, self._on_sigterm)

    def _on_sigterm(self) -> None:
        self._sigterm = True

    def _on_ctrl_c(self, signum: int, _: Any) -> None:
        signal.signal(signal.SIGINT, self._on_ctrl_c_again)
        self._ctrl_c = True
        when = "after this batch" if self._agreement is None else f"within {STOP_WITHIN} batches"
        rank_zero_info(f"\nCtrl-C: stopping {when} and saving last.ckpt (Ctrl-C again: stop at once, no save).")

    def _on_ctrl_c_again(self, signum: int, _: Any) -> None:
        rank_zero_info(
            f"\nCtrl-C again: stopping at once, without saving (a checkpoint write under way is finished). Exit code "
            f"{INTERRUPTED_EXIT_CODE}."
        )
        raise CtrlCAgain

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._end_agreement(wait=True)
        self._restore()

    def _restore(self) -> None:
        self._undo_sigterm()
        self._undo_sigterm = lambda: None
        put_back, self._put_back_handlers = self._put_back_handlers, lambda: None
        put_back()

    def _end_agreement(self, wait: bool) -> None:
        agreement, self._agreement = self._agreement, None
        if wait and agreement is not None and agreement.pending:
            agreement.sums()  # no collective left under way when the process group goes

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
        if self._agreement is None:  # one process: nothing to agree on; Lightning's handler sets its SIGTERM flag
            sums = [int(self._sigterm or stop_requested(trainer)), int(self._ctrl_c)]
        else:
            sums = self._agree(self._agreement)
        if any(sums) and accumulating(trainer):
            # The gradients of this optimizer step's batches so far are in .grad, which no checkpoint holds: a
            # resume from here would take the step on the rest of them only. Stop after the batch that steps.
            request_stop_at_batch_end(trainer, stop=False)
            self._sigterm = self._sigterm or (self._agreement is None and sums[0] > 0)
            self._agreed = sums  # under DDP: what the next batch end reads (the same batch on every rank)
            return
        if any(sums):
            self._preempted = sums[0] > 0  # a SIGTERM on any rank, before a Ctrl-C
            self._interrupted = not self._preempted
            # Lightning's SIGTERM flag: every rank raises SIGTERMException at the end of this batch (after the
            # epoch's validation, if this was its last batch), where the loop's progress is complete.
            request_stop_at_batch_end(trainer)

    def _agree(self, agreement: Agreement) -> list[int]:
        """The ranks' sums of (SIGTERM seen, Ctrl-C seen) where this batch end reads them, else zeros; every rank
        calls it at every batch end, so each starts and reads at the same batches."""
        self._batch_ends += 1
        sums, self._agreed = self._agreed, None
        if sums is None and self._batch_ends % AGREE_EVERY == 0:
            sums = agreement.sums() if agreement.pending else [0, 0]
            if not any(sums):
                agreement.start([int(self._sigterm), int(self._ctrl_c)])
        return sums or [0, 0]

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._agreement is not None and self._agreement.pending:  # not left under way past the epoch
            sums = self._agreement.sums()
            self._agreed = sums if any(sums) else None

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._agreement is not None and self._agreement.pending:
            self._agreement.sums()  # the fit ended first

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if (self._interrupted or self._preempted) and not trainer.sanity_checking:
            request_stop_at_batch_end(trainer, stop=False)  # else Lightning stops it after its first batch

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if (self._interrupted or self._preempted) and not trainer.sanity_checking:
            request_stop_at_batch_end(trainer)  # Lightning stops right after this validation

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        # An agreement under way is left (a rank that failed may never finish it); a stop the ranks agreed on
        # started none after its read, so the save's collectives come next on every rank.
        self._end_agreement(wait=False)
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
            # would be lost); the newest one on disk, what --ckpt_path last takes, resumes exactly. (Ctrl-C, and
            # under DDP any signal, waits for the validation to end; in one process a preemption may not have that
            # long.)
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
