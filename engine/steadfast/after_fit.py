"""``--run.test_after_fit true``: a finished ``fit`` tests its best checkpoint in the same process and run."""

from typing import Any

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.trainer.states import TrainerStatus
from lightning.pytorch.utilities import rank_zero_info


def test_best(trainer: L.Trainer, model: L.LightningModule, datamodule: Any, judge: ModelCheckpoint | None) -> None:
    """Runs ``trainer.test`` on the best checkpoint of the ``fit`` that just finished, on every rank.

    The same Trainer, so ``test/*`` goes to the same loggers, run folder and version, at the run's last step. The
    best is the first ``ModelCheckpoint`` with a ``monitor``'s, as ``RunSummary`` reports it. Without one
    (``enable_checkpointing false``, ``fast_dev_run``, no monitor, never validated) the weights the fit ended
    with are tested, and the line says so. A stopped fit (preemption, Ctrl-C, NaN) raises out of ``fit`` before
    this is reached, so it is never tested.
    """
    if trainer.state.status != TrainerStatus.FINISHED:
        rank_zero_info(f"Test after fit: skipped, fit ended {trainer.state.status.value}.")
        return
    monitored = judge
    ckpt_path = None
    if trainer.fast_dev_run:
        why = "fast_dev_run keeps no checkpoint: the weights fit ended with"
    elif monitored is None:
        why = "no ModelCheckpoint with a monitor: the weights fit ended with"
    elif not monitored.best_model_path:
        why = f"no checkpoint by {monitored.monitor} was saved: the weights fit ended with"
    else:
        ckpt_path = monitored.best_model_path
        why = f"best {monitored.monitor} {float(monitored.best_model_score):.4f}: {ckpt_path}"
    # Every rank has the same best: ModelCheckpoint ranks the synced monitor values alike on all of them. (No
    # broadcast: fit's teardown has closed the process group; test opens a new one.)
    rank_zero_info(f"Test after fit: {why}")
    trainer.test(model, datamodule=datamodule, ckpt_path=ckpt_path)
