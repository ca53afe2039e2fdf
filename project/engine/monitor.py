"""What a fit is judged by, said once: ``run.monitor`` and ``run.mode`` (``project.engine.runs.Runs``).

From them the engine builds Lightning's own ``ModelCheckpoint`` (the best ``run.save_top_k``) and, with
``run.patience``, ``EarlyStopping``; ``--ckpt_path best``, ``--run.test_after_fit``, the run summary and a sweep's
objective all read that checkpoint callback. A monitored key the module never logs would otherwise surface after a
whole epoch of training, as Lightning's "could not find the monitored key"; ``CheckMonitored`` stops the run at the
end of the first validation (the sanity check's, when there is one), before any checkpoint callback acts.
"""

from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback, EarlyStopping, ModelCheckpoint

BEST_FILENAME = "best-epoch{epoch:03d}-step{step}"


def monitor_callbacks(runs: Any) -> list[Callback]:
    """The ``ModelCheckpoint`` and ``EarlyStopping`` that ``runs`` (a ``Runs``) asks for."""
    if runs.monitor is None:
        return []
    callbacks: list[Callback] = [
        ModelCheckpoint(
            monitor=runs.monitor,
            mode=runs.mode,
            save_top_k=runs.save_top_k,
            filename=BEST_FILENAME,
            auto_insert_metric_name=False,
        )
    ]
    if runs.patience is not None:
        callbacks.append(EarlyStopping(monitor=runs.monitor, mode=runs.mode, patience=runs.patience))
    return callbacks


class CheckMonitored(Callback):
    """Raises ``ValueError`` (one ``error:`` line) at the end of the first validation if a ``ModelCheckpoint`` or
    ``EarlyStopping`` monitors a key the module did not log, naming the keys it did log and the setting to change.

    Every rank logs the same keys, so every rank raises alike; rank 0 alone prints it (``project.engine.errors``).
    A fit without validation (``limit_val_batches 0``) is not checked: Lightning only warns then, as a validation
    metric cannot be there.
    ``from_run``: the callbacks the engine built from ``run.monitor`` (the others came with ``trainer.callbacks``).
    """

    def __init__(self, from_run: list[Callback]) -> None:
        self.from_run = from_run
        self.checked = False

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._check(trainer)

    def _check(self, trainer: L.Trainer) -> None:
        if self.checked:
            return
        self.checked = True
        watchers = [c for c in trainer.callbacks if isinstance(c, ModelCheckpoint | EarlyStopping) and c.monitor]
        missing = next((c for c in watchers if c.monitor not in trainer.callback_metrics), None)
        if missing is None:
            return
        if missing in self.from_run:
            who = "run.monitor"
            fix = "monitor one of those (--run.monitor KEY --run.mode min|max), or none (--run.monitor null)"
        else:
            who = f"the monitor of a {type(missing).__name__} in trainer.callbacks"
            fix = "change that monitor to one of those"
        when = "the sanity check's validation" if trainer.sanity_checking else "the first validation"
        keys = ", ".join(sorted(trainer.callback_metrics)) or "nothing"
        raise ValueError(
            f"{who} is {missing.monitor!r}, which the module did not log by the end of {when} (it logs: {keys}): "
            f"{fix}, or self.log({missing.monitor!r}, ...) in the module"
        )
