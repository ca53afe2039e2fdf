"""What a fit is judged by, said once: ``run.monitor`` and ``run.mode`` (``steadfast.runs.Runs``).

From them the engine builds Lightning's own ``ModelCheckpoint`` (the best ``run.save_top_k``) and, with
``run.patience``, ``EarlyStopping``; ``--ckpt_path best``, ``--run.test_after_fit``, the run summary and a sweep's
objective all read that checkpoint callback. A monitored key the module never logs would otherwise surface after a
whole epoch of training, as Lightning's "could not find the monitored key"; ``CheckMonitored`` stops the run at the
end of the first validation (the sanity check's, when there is one), before any checkpoint callback acts.
"""

from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback, EarlyStopping, ModelCheckpoint
from lightning.pytorch.utilities.model_helpers import is_overridden

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


def run_monitor_callbacks(runs: Any, given: list[Callback], base_monitor: str | None) -> tuple[list[Callback], str]:
    """The callbacks ``runs`` asks for beside ``given`` (the config's ``trainer.callbacks``), and a line to say.

    - ``given`` holds a ``ModelCheckpoint`` with a monitor and ``run.monitor`` is only the base config's (the
      example's ``val/acc``, which a user's own module may not log): the user's checkpoint judges the run, and
      ``run.monitor``'s is not built.
    - A ``ModelCheckpoint`` of ``given`` monitoring what ``run.monitor`` does, as the engine's would: the user's is
      that one (Lightning refuses two callbacks with one state key).
    - Two monitors that disagree are both kept, and named: ``run.monitor``'s is the run's (listed first, it is the
      checkpoint ``--ckpt_path best``, the summary and a sweep read).
    """
    theirs = [c for c in given if isinstance(c, ModelCheckpoint) and c.monitor]
    if runs.monitor is not None and runs.monitor == base_monitor and theirs and runs.monitor not in _monitors(theirs):
        first = theirs[0]
        early = [EarlyStopping(monitor=first.monitor, mode=first.mode, patience=runs.patience)]
        return early if runs.patience is not None else [], (
            f"monitor: {first.monitor!r} ({first.mode}), the ModelCheckpoint of trainer.callbacks; the base "
            f"config's run.monitor {base_monitor!r} is set aside (--run.monitor KEY chooses)"
        )
    built = [c for c in monitor_callbacks(runs) if not any(g.state_key == c.state_key for g in given)]
    others = sorted(_monitors(theirs) - {runs.monitor})
    if runs.monitor is None or not others:
        return built, ""
    return built, (
        f"two monitors: run.monitor {runs.monitor!r} picks the best checkpoint, the summary and a sweep's objective; "
        f"a ModelCheckpoint of trainer.callbacks also keeps files by {', '.join(map(repr, others))}"
    )


class ReadsJudge:
    """A part of the engine that reads the run's best: the CLI sets ``judge`` on it (``judge_of``), and on no
    callback of the user's, whatever attributes theirs have."""

    judge: ModelCheckpoint | None = None


def judge_of(callbacks: list[Callback]) -> ModelCheckpoint | None:
    """The checkpoint that judges the run, among the callbacks the CLI built (``run.monitor``'s first, else the
    config's first with a monitor; none with checkpointing off). The CLI finds it once and hands it to what reads
    the run's best: the summary, test after fit, a sweep's objective and trial, the resume record."""
    return next((c for c in callbacks if isinstance(c, ModelCheckpoint) and c.monitor), None)


def _monitors(callbacks: list[Any]) -> set[str]:
    return {c.monitor for c in callbacks}


class CheckMonitored(Callback):
    """Raises ``ValueError`` (one ``error:`` line) at the end of the first validation if a ``ModelCheckpoint`` or
    ``EarlyStopping`` monitors a key the module did not log, naming the keys it did log and the setting to change.

    Every rank logs the same keys, so every rank raises alike; rank 0 alone prints it (``steadfast.errors``).
    A monitored training metric (a key starting with ``train``) is checked at the first validation after training,
    not at the sanity check's; a module without ``validation_step`` at the end of its first training epoch; a fit whose
    validation is switched off (``limit_val_batches 0``, a debug run) is not checked: Lightning only warns then, as
    a validation metric cannot be there.
    ``from_run``: the callbacks the engine built from ``run.monitor`` (the others came with ``trainer.callbacks``);
    ``watchers``: every ``ModelCheckpoint`` and ``EarlyStopping`` with a monitor of the run (the CLI's final list).
    """

    def __init__(self, from_run: list[Callback], watchers: list[Callback] | None = None) -> None:
        self.from_run = from_run
        self.watchers = list(watchers or [])
        self.checked = False

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._check(trainer)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # A module without validation: what is monitored must be logged in training, by the epoch's end, where its
        # ModelCheckpoint acts (Lightning would only warn, and the run would end with nothing judged)
        if not is_overridden("validation_step", pl_module):
            self._check(trainer)

    def _check(self, trainer: L.Trainer) -> None:
        if self.checked:
            return
        watchers = self.watchers
        if trainer.sanity_checking:
            # no training step has logged yet: a training metric (train_loss, train/acc) is checked at the first
            # validation after training instead, every other key now, before any training
            watchers = [c for c in watchers if not c.monitor.startswith("train")]
        else:
            self.checked = True
        missing = next((c for c in watchers if c.monitor not in trainer.callback_metrics), None)
        if missing is None:
            return
        if missing in self.from_run:
            who = "run.monitor"
            fix = "monitor one of those (--run.monitor KEY --run.mode min|max), or none (--run.monitor null)"
        else:
            who = f"the monitor of a {type(missing).__name__} in trainer.callbacks"
            fix = "change that monitor to one of those"
        when = "the first validation" if trainer.validating else "the first training epoch"
        when = "the sanity check's validation" if trainer.sanity_checking else when
        keys = ", ".join(sorted(trainer.callback_metrics)) or "nothing"
        raise ValueError(
            f"{who} is {missing.monitor!r}, which the module did not log by the end of {when} (it logs: {keys}): "
            f"{fix}, or self.log({missing.monitor!r}, ...) in the module"
        )
