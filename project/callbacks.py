"""Callbacks the template adds to Lightning's own."""

import os
import random
import signal
import sys
import threading
from typing import Any

import lightning as L
import numpy as np
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint, TQDMProgressBar
from lightning.pytorch.cli import SaveConfigCallback
from lightning.pytorch.plugins.environments import SLURMEnvironment
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.exceptions import SIGTERMException


class SaveConfigOnce(SaveConfigCallback):
    """Saves the run's config as ``config.yaml``; a resumed run adds ``config.1.yaml``, ``config.2.yaml``, ...

    Lightning's callback refuses to start when ``config.yaml`` exists, which a resumed run always meets;
    overwriting it would lose how the run began. Only rank 0 looks at the folder; the choice is broadcast.
    """

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self.already_saved or not self.save_to_log_dir:
            return super().setup(trainer, pl_module, stage)
        log_dir = trainer.log_dir
        name = "config.yaml"
        if trainer.is_global_zero and log_dir is not None:
            n = 0
            while os.path.exists(os.path.join(log_dir, name)):
                n += 1
                name = f"config.{n}.yaml"
        self.config_filename = trainer.strategy.broadcast(name)
        super().setup(trainer, pl_module, stage)


class ExactResume(Callback):
    """Puts in each checkpoint what Lightning leaves out and a bit-exact resume needs.

    - Every rank's torch, CUDA, numpy and Python RNG states, restored on resume.
    - The loggers' buffers are flushed (at each checkpoint and each epoch start), so no point logged before the
      checkpoint is lost if the process is killed right after it (the resumed run's ``purge_step`` drops those
      logged after it).

    Lightning checkpoints hold no RNG state, so dropout masks (and anything else drawn from the global
    generators) differ after a resume. ``state_dict`` runs on every rank while a checkpoint is assembled, so the
    states are gathered there; rank 0 writes them all. They are set again in ``on_train_start``: after model
    init, the sanity check and the data setup (which all draw or may draw), right before the first batch.
    """

    def __init__(self) -> None:
        self._trainer: L.Trainer | None = None
        self._to_restore: list[dict[str, torch.Tensor]] | None = None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._trainer = trainer

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        _flush_loggers(trainer)

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # The epoch-end values (train/acc, ...) are logged after the epoch-end checkpoint, and a resume from that
        # checkpoint does not log them again: out before the next epoch can be killed.
        _flush_loggers(trainer)

    def state_dict(self) -> dict[str, Any]:
        mine = _rng_tensors()
        trainer = self._trainer
        if trainer is None or trainer.world_size == 1:
            return {"ranks": [mine]}
        device = trainer.strategy.root_device  # NCCL gathers only device tensors
        gathered = {k: trainer.strategy.all_gather(v.to(device)).cpu() for k, v in mine.items()}
        # clone: a view would be saved with (and set_rng_state would read from) the start of the whole storage
        return {"ranks": [{k: v[r].clone() for k, v in gathered.items()} for r in range(trainer.world_size)]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._to_restore = state_dict["ranks"]

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        ranks, self._to_restore = self._to_restore, None
        if ranks is None:
            return
        if len(ranks) != trainer.world_size:
            rank_zero_warn(
                f"The checkpoint holds RNG states of {len(ranks)} ranks, this run has {trainer.world_size}: "
                "random draws (dropout, augmentation) will differ from the original run from here on."
            )
            return
        _set_rng_tensors(ranks[trainer.global_rank])


def _flush_loggers(trainer: L.Trainer) -> None:
    for logger in trainer.loggers:
        if hasattr(logger, "flush"):  # ThrottledTensorBoardLogger: the values it holds back
            logger.flush()
        else:
            logger.save()
            if hasattr(logger.experiment, "flush"):
                logger.experiment.flush()


def _rng_tensors() -> dict[str, torch.Tensor]:
    """The global RNG states as tensors (a ``weights_only`` checkpoint may hold nothing else safely)."""
    version, py_state, gauss = random.getstate()
    _, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    states = {
        "torch": torch.get_rng_state(),
        "python": torch.tensor([version, *py_state], dtype=torch.int64),
        "python_gauss": torch.tensor([gauss is not None, gauss or 0.0], dtype=torch.float64),
        "numpy": torch.tensor(np_keys.astype(np.int64)),
        "numpy_rest": torch.tensor([np_pos, np_has_gauss, np_gauss], dtype=torch.float64),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state()
    return states


def _set_rng_tensors(states: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(states["torch"].cpu().clone())
    python = states["python"].tolist()
    has_gauss, gauss = states["python_gauss"].tolist()
    random.setstate((python[0], tuple(python[1:]), gauss if has_gauss else None))
    pos, np_has_gauss, np_gauss = states["numpy_rest"].tolist()
    np.random.set_state(("MT19937", states["numpy"].numpy().astype(np.uint32), int(pos), int(np_has_gauss), np_gauss))
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state(states["cuda"].cpu().clone())


# Exit codes of a run stopped by a signal after saving last.ckpt: 128 + the signal's number, as a shell reports a
# process killed by it, so launchers (torchrun, SLURM, CI, scripts) see a failure and can restart.
PREEMPTED_EXIT_CODE = 128 + signal.SIGTERM  # 143
INTERRUPTED_EXIT_CODE = 128 + signal.SIGINT  # 130, Ctrl-C


class Preemption(Callback):
    """Turns a preemption signal or Ctrl-C into a saved ``last.ckpt`` and a non-zero exit.

    Lightning already catches SIGTERM and stops every rank at the same batch by raising ``SIGTERMException``, but
    the process then exits 0 (Lightning issue #21623), so a launcher takes a killed run for a finished one.
    Outside SLURM, SIGUSR1 is routed to the same path; under SLURM it stays Lightning's (checkpoint + requeue).

    Ctrl-C (SIGINT) gets the same ending: Lightning's KeyboardInterrupt handling saves nothing, and a
    KeyboardInterrupt lands wherever each rank happens to be, so no checkpoint could be gathered. Here the first
    Ctrl-C only sets a flag; at the next training batch end the ranks agree (one all-reduce of one value per step,
    under DDP only) and Lightning's SIGTERM stop runs on all of them at the same point, after any validation in
    progress. A second Ctrl-C aborts at once, without saving.
    """

    def __init__(self) -> None:
        self._slurm_handler: Any = None
        self._pending_signal: int | None = None
        self._ctrl_c = False  # seen by this process
        self._interrupted = False  # agreed by all ranks

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        if not SLURMEnvironment.detect():
            signal.signal(signal.SIGUSR1, lambda *_: os.kill(os.getpid(), signal.SIGTERM))
        if stage == "fit":
            signal.signal(signal.SIGINT, self._on_ctrl_c)

    def _on_ctrl_c(self, signum: int, _: Any) -> None:
        signal.signal(signal.SIGINT, signal.default_int_handler)  # the second Ctrl-C: KeyboardInterrupt, no save
        self._ctrl_c = True
        rank_zero_info("\nCtrl-C: stopping after this batch and saving last.ckpt (Ctrl-C again: abort, no save).")

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage == "fit" and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, signal.default_int_handler)

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
            trainer._signal_connector.received_sigterm = True

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        if not isinstance(exception, SIGTERMException):
            return
        path = _last_checkpoint_path(trainer)
        code = INTERRUPTED_EXIT_CODE if self._interrupted else PREEMPTED_EXIT_CODE
        what = "Interrupted" if self._interrupted else "Preempted"
        if trainer.validating or trainer.sanity_checking:
            # A checkpoint taken mid-validation resumes past that validation (its metric point and top-k check
            # would be lost); the last one on disk, at most N steps old, resumes exactly.
            rank_zero_info(f"{what} during validation: kept the last checkpoint. Exit code {code}.")
        elif path is not None:
            trainer.save_checkpoint(path)  # every rank takes part (RNG states are gathered); rank 0 writes
            rank_zero_info(f"{what}: saved {path}; resume with --ckpt_path last. Exit code {code}.")
        exception.code = code  # SIGTERMException is a SystemExit: this becomes the exit status


class StopOnNonFinite(Callback):
    """Stops training at the first step whose gradients are NaN or infinite, before they reach the weights.

    A NaN loss on any rank makes the averaged gradients NaN on every rank, so each rank reaches the same decision
    at the same step without another collective (a rank stopping alone would leave the others waiting forever).
    Stopping before ``optimizer.step`` keeps the weights finite, and no checkpoint is written after the failure:
    ``last.ckpt`` and the others stay the last good ones. With a gradient scaler (``precision: 16-mixed``)
    non-finite gradients are expected now and then and the scaler skips those steps itself, so this stands aside.
    """

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        if getattr(trainer.precision_plugin, "scaler", None) is not None:
            return
        # One sum per gradient, not a norm: a NaN or inf anywhere makes the total non-finite, at ~20 us a step.
        sums = [p.grad.detach().sum(dtype=torch.float32) for p in pl_module.parameters() if p.grad is not None]
        if not sums or torch.isfinite(torch.stack(sums).sum()):
            return
        last = _last_checkpoint_path(trainer)
        kept = (
            f"The checkpoints on disk are from earlier steps (latest: {last}). "
            if last and os.path.exists(last)
            else ""
        )
        batch = trainer.fit_loop.epoch_loop.batch_progress.current.ready - 1
        message = (
            f"error: the gradients became NaN or infinite at step {trainer.global_step} (epoch "
            f"{trainer.current_epoch}, batch {batch}); training stopped before updating the weights. {kept}Fix: "
            "lower --model.lr or raise --model.warmup, check the data for NaN/inf, then resume with --ckpt_path last "
            "or start again."
        )
        if trainer.is_global_zero:
            print(message, file=sys.stderr, flush=True)
        raise SystemExit(1)  # no traceback; Lightning still runs its on_exception hooks and teardown


class DestroyProcessGroup(Callback):
    """Destroys the default process group when a stage ends.

    A gloo process group left alive at interpreter exit can abort the process ("terminate called without an
    active exception", exit -6) after a successful run; torchrun then takes the finished run for a crash and
    restarts it. A later stage in the same process initialises a new group.
    """

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            trainer.strategy.barrier("destroy_process_group")
            torch.distributed.destroy_process_group()


def _last_checkpoint_path(trainer: L.Trainer) -> str | None:
    for callback in trainer.checkpoint_callbacks:
        if isinstance(callback, ModelCheckpoint) and callback.save_last and callback.dirpath:
            return os.path.join(callback.dirpath, callback.CHECKPOINT_NAME_LAST + callback.FILE_EXTENSION)
    return None


class LossProgressBar(TQDMProgressBar):
    """Lightning's tqdm bar, with the last step's training loss shown beside the logged metrics.

    The module writes the per-step loss straight to the loggers (see ``Classifier._log_step_loss``), so it is not
    among the metrics Lightning's bar collects; the bar reads it from ``training_step``'s output, on the host only
    when it redraws. Redrawing after every batch costs ~0.1 ms of Python, a few percent of a small model's step:
    ``refresh_rate`` (Lightning's own argument) sets how many batches pass between redraws; a loop's last batch is
    always drawn.
    """

    def __init__(self, refresh_rate: int = 10, leave: bool = False) -> None:
        super().__init__(refresh_rate=refresh_rate, leave=leave)
        self._loss: torch.Tensor | None = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # type: ignore[no-untyped-def]
        self._loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    def get_metrics(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, int | str | float]:
        metrics = super().get_metrics(trainer, pl_module)
        if trainer.state.fn == "fit" and isinstance(self._loss, torch.Tensor):  # the last step's, during validation too
            metrics["train/loss"] = f"{self._loss.item():.3g}"
        return metrics
