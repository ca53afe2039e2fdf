"""What a bit-exact resume needs beyond Lightning's checkpoint: every rank's RNG states, a fixed number of compute
threads, logs flushed at saves."""

import random
from typing import Any

import lightning as L
import numpy as np
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn


class ExactResume(Callback):
    """Puts in each checkpoint what Lightning leaves out and a bit-exact resume needs.

    - Every rank's torch, CUDA, numpy and Python RNG states, restored on resume.
    - The number of CPU compute threads, fixed for the run and checked on resume. A CPU matmul splits its sums
      over the threads it runs on, so the same step on 1 and on 2 threads differs in the last bits (here: the
      last layer's weight gradient, from the first step on). Until ``torch.set_num_threads`` is called, MKL may
      also run a call on fewer threads than asked (MKL_DYNAMIC; ``MKL_VERBOSE=1`` prints ``Dyn:1``); setting the
      count PyTorch already uses turns that off (``Dyn:0``) and changes nothing else.
    - The loggers' buffers are flushed (at each checkpoint, and once Lightning has logged that step), so no point
      logged before the checkpoint is lost if the process is killed after it (the resumed run's ``purge_step``
      drops those logged after it).

    Lightning checkpoints hold no RNG state, so dropout masks (and anything else drawn from the global
    generators) differ after a resume. ``state_dict`` runs on every rank while a checkpoint is assembled, so the
    states are gathered there; rank 0 writes them all. They are set again in ``on_train_start``: after model
    init, the sanity check and the data setup (which all draw or may draw), right before the first batch.
    """

    def __init__(self) -> None:
        self._trainer: L.Trainer | None = None
        self._to_restore: list[dict[str, torch.Tensor]] | None = None
        self._flush_before_next_batch = False
        self._epoch_started: int | None = None
        self._threads_saved: int | None = None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._trainer = trainer
        # The count stays as it is; MKL stops choosing its own (mkl_set_dynamic(false), which PyTorch cannot undo).
        torch.set_num_threads(torch.get_num_threads())

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        _flush_loggers(trainer)
        self._flush_before_next_batch = True
        _reopen_an_epoch_stopped_mid_way(checkpoint)

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._epoch_started = trainer.current_epoch

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if batch_idx == 0 and self._epoch_started != trainer.current_epoch:
            # Resumed from a checkpoint taken at the previous epoch's last batch end, Lightning 2.6 starts this
            # epoch without calling on_train_epoch_start: the module's epoch-start work (e.g. resetting train
            # metrics) would be skipped and the resumed run would differ from the uninterrupted one.
            pl_module.on_train_epoch_start()
            self._epoch_started = trainer.current_epoch
        # Lightning hands a step's values (and an epoch's, train/acc ...) to the loggers after the batch-end and
        # epoch-end hooks where checkpoints are saved, and a resume from that checkpoint does not log them again:
        # out before the next batch can be killed.
        if self._flush_before_next_batch:
            _flush_loggers(trainer)
            self._flush_before_next_batch = False

    def state_dict(self) -> dict[str, Any]:
        mine = _rng_tensors()
        trainer = self._trainer
        threads = torch.get_num_threads()
        if trainer is None or trainer.world_size == 1:
            return {"ranks": [mine], "threads": threads}
        device = trainer.strategy.root_device  # NCCL gathers only device tensors
        gathered = {k: trainer.strategy.all_gather(v.to(device)).cpu() for k, v in mine.items()}
        # clone: a view would be saved with (and set_rng_state would read from) the start of the whole storage
        ranks = [{k: v[r].clone() for k, v in gathered.items()} for r in range(trainer.world_size)]
        return {"ranks": ranks, "threads": threads}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._to_restore = state_dict["ranks"]
        self._threads_saved = state_dict.get("threads")  # absent from checkpoints written before it was saved

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        saved, self._threads_saved = self._threads_saved, None
        if saved is not None and saved != torch.get_num_threads() and trainer.strategy.root_device.type == "cpu":
            rank_zero_warn(
                f"The checkpoint was written by a run computing on {saved} CPU thread(s), this one uses "
                f"{torch.get_num_threads()}: CPU results will differ from the original run's in the last bits. "
                f"For a bit-exact resume, run with OMP_NUM_THREADS={saved} on a machine with that many cores."
            )
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


def _reopen_an_epoch_stopped_mid_way(checkpoint: dict) -> None:
    """A fit stopped mid-epoch (``max_time``, ``max_steps``, an early stop) counts that epoch as done before its
    end-of-fit save, so ``--ckpt_path last`` would start the next epoch (its data order, its epoch number) at the
    batch where this one stopped. The checkpoint is written as a save during that epoch would be: the epoch
    started and not yet processed."""
    fit = checkpoint.get("loops", {}).get("fit_loop", {})
    batches, epochs = fit.get("epoch_loop.batch_progress"), fit.get("epoch_progress")
    if not batches or not epochs:
        return
    mid_epoch = not batches["is_last_batch"] and batches["current"]["completed"] > 0
    counted = epochs["current"]["completed"] == epochs["current"]["ready"] > 0
    if mid_epoch and counted:
        for counts in (epochs["current"], epochs["total"]):
            counts["processed"] -= 1
            counts["completed"] -= 1
        checkpoint["epoch"] = epochs["current"]["completed"]


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
