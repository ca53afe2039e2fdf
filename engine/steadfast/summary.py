"""The line a finished run ends with: best score, best checkpoint, run folder; and the same score in each logger."""

from typing import Any

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import TensorBoardLogger

from steadfast.compat import CLI_HPARAM_KEYS
from steadfast.monitor import ReadsJudge


class RunSummary(ReadsJudge, L.Callback):
    """At the end of ``fit``, rank 0 prints one line, e.g.
    ``Run summary: best <run.monitor> 0.9630 | best checkpoint runs/<name>/version_0/checkpoints/best-....ckpt |
    run folder runs/<name>/version_0``.

    The score and path come from ``judge``, the ``ModelCheckpoint`` that judges the run (``monitor.judge_of``; the
    CLI hands it over), so they are the ones that callback kept (restored with it on resume). Every logger also gets
    the score as ``best/<monitor>`` at the last step: a tag of its own keeps the monitored curve free of an extra
    point, and it is what a run table sorts by (MLflow's and W&B's run lists show a metric's last value; a CSV's
    last row has it). A ``TensorBoardLogger`` gets it with the run's hyperparameters: TensorBoard's HParams view
    lists only runs whose hyperparameters came with a metric, and Lightning's own call passes none under
    ``default_hp_metric: false``. Nothing is printed or logged when ``fit`` is interrupted.
    """

    def __init__(self, judge: ModelCheckpoint | None = None) -> None:
        self.judge = judge
        self.line: str | None = None

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Here rather than in on_fit_end: loggers are still open, and the broadcast (every rank calls it) still
        # has its process group.
        run_dir = trainer.strategy.broadcast(trainer.default_root_dir)  # the run folder (steadfast.runs)
        checkpoint = self.judge
        if checkpoint is None:
            self.line = f"Run summary: no ModelCheckpoint monitors a metric | run folder {run_dir}"
            return
        score = checkpoint.best_model_score
        best = "n/a (never validated)" if score is None else f"{score.item():.4f}"
        self.line = (
            f"Run summary: best {checkpoint.monitor} {best} | best checkpoint {checkpoint.best_model_path or 'none'}"
            f" | run folder {run_dir}"
        )
        if score is None:
            return
        metrics = {f"best/{checkpoint.monitor}": score.item()}
        for logger in trainer.loggers:  # loggers' calls are rank-zero-only
            if isinstance(logger, TensorBoardLogger):  # which logs the metrics too
                logger.log_hyperparams(_run_hparams(trainer, pl_module), metrics, step=trainer.global_step)
            else:
                logger.log_metrics(metrics, step=trainer.global_step)

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # After the progress bar is closed, so the line is the run's last and stands on its own.
        if trainer.is_global_zero and self.line is not None:
            print(self.line, flush=True)


def _run_hparams(trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, Any]:
    """The hyperparameters Lightning logs on its own: the module's and the data module's, minus CLI bookkeeping."""
    hparams = dict(pl_module.hparams_initial)
    if trainer.datamodule is not None:
        hparams.update(trainer.datamodule.hparams_initial)
    return {k: v for k, v in hparams.items() if k not in CLI_HPARAM_KEYS}
