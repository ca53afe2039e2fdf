"""What a run is judged by, and what reads its judgement: one concept, the run's monitor. ``run_monitor_callbacks``
builds (or finds in ``trainer.callbacks``) the monitored ``ModelCheckpoint`` and ``EarlyStopping``; the judging
checkpoint (``judge_of``) is handed to each ``ReadsJudge`` by ``Judging``, again once Lightning has added the module's
own callbacks; ``CheckMonitored`` stops a run whose monitor is never logged; ``best_checkpoint`` ranks the files on
disk for ``--ckpt_path best``; ``RunSummary`` and ``--run.test_after_fit`` (``test_best``) read the same judge.
"""

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback, EarlyStopping, ModelCheckpoint
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.trainer.states import TrainerStatus
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.model_helpers import is_overridden

from lightkeep.checkpoint_files import CheckpointLoadError, load_checkpoint_file
from lightkeep.compat import CLI_HPARAM_KEYS, state_key_arguments
from lightkeep.compat_loops import stopping_mid_epoch
from lightkeep.resume import ExactResume
from lightkeep.sharded.folders import is_sharded_checkpoint, read_meta

BEST_FILENAME = "best-epoch{epoch:03d}-step{step}"


def run_monitor_callbacks(
    runs: Any, given: list[Callback], base_monitor: str | None
) -> tuple[list[Callback], str | None, str]:
    """The callbacks ``runs`` asks for beside ``given`` (the config's ``trainer.callbacks``), the key the run is
    judged by (``None``: none), and a line to say.

    - ``given`` holds a ``ModelCheckpoint`` with a monitor and ``run.monitor`` is only the base config's (the
      example's ``val/acc``, which a user's own module may not log), or none: the user's first such checkpoint
      judges the run, and ``run.monitor``'s is not built.
    - A ``ModelCheckpoint`` of ``given`` monitoring what ``run.monitor`` does, as the engine's would: the user's is
      that one (Lightning refuses two callbacks with one state key).
    - Two monitors that disagree are both kept, and named: the run's (``run.monitor``'s, else the first) picks the
      checkpoint ``--ckpt_path best``, the summary and a sweep read.
    """
    theirs = [c for c in given if isinstance(c, ModelCheckpoint) and c.monitor]
    aside = runs.monitor is not None and runs.monitor == base_monitor and theirs
    if runs.monitor is None or (aside and runs.monitor not in _monitors(theirs)):
        if not theirs:
            return [], None, ""
        first = theirs[0]
        early = [EarlyStopping(monitor=first.monitor, mode=first.mode, patience=runs.patience)]
        others = sorted(_monitors(theirs) - {first.monitor})
        also = f"; another also keeps files by {', '.join(map(repr, others))}" if others else ""
        said = f"monitor: {first.monitor!r} ({first.mode}), the first ModelCheckpoint of trainer.callbacks{also}"
        if runs.monitor is not None:
            said += f"; the base config's run.monitor {base_monitor!r} is set aside"
        if runs.monitor is None and not others:
            said = ""  # the only monitor there is: nothing to choose between
        else:
            said += " (--run.monitor KEY chooses)"
        return early if runs.patience is not None and runs.monitor is not None else [], first.monitor, said
    wanted: list[Callback] = [ModelCheckpoint(monitor=runs.monitor, mode=runs.mode, save_top_k=runs.save_top_k,
                                              filename=BEST_FILENAME, auto_insert_metric_name=False)]  # fmt: skip
    if runs.patience is not None:
        wanted.append(EarlyStopping(monitor=runs.monitor, mode=runs.mode, patience=runs.patience))
    built = [c for c in wanted if not any(g.state_key == c.state_key for g in given)]
    others = sorted(_monitors(theirs) - {runs.monitor})
    if not others:
        return built, runs.monitor, ""
    said = (
        f"two monitors: run.monitor {runs.monitor!r} picks the best checkpoint, the summary and a sweep's "
        f"objective; a ModelCheckpoint of trainer.callbacks also keeps files by {', '.join(map(repr, others))}"
    )
    return built, runs.monitor, said


class ReadsJudge:
    """A part of the engine that reads the run's best: the CLI hands it to ``Judging``, which sets ``judge`` on it
    (``judge_of``), and on no callback of the user's, whatever attributes theirs have."""

    judge: ModelCheckpoint | None = None


def judge_of(callbacks: list[Callback], monitor: str | None) -> ModelCheckpoint | None:
    """The checkpoint that judges the run, among the callbacks the CLI built: the first monitoring ``monitor`` (the
    run's, from ``run_monitor_callbacks``), else the first with a monitor; none with checkpointing off. ``Judging``
    hands it to what reads the run's best: the summary, test after fit, a sweep's objective and trial, the resume
    record."""
    monitored = [c for c in callbacks if isinstance(c, ModelCheckpoint) and c.monitor]
    return next((c for c in monitored if c.monitor == monitor), monitored[0] if monitored else None)


def _monitors(callbacks: list[Any]) -> set[str]:
    return {c.monitor for c in callbacks}


class CheckMonitored(Callback):
    """Raises ``ValueError`` (one ``error:`` line) if a ``ModelCheckpoint`` or ``EarlyStopping`` monitors a key the
    module did not log, naming the keys it did log and the setting to change.

    Every rank logs the same keys, so every rank raises alike; rank 0 alone prints it (``lightkeep.errors``).
    A validation metric is checked at the end of the first validation after the sanity check, where Lightning's own
    callbacks first judge it: a module may skip logging while ``trainer.sanity_checking``. A training metric (a key
    starting with ``train``), and every key of a module without ``validation_step``, once the first training epoch
    has ended in full (at the next epoch's start, or the fit's end): an epoch value logged in ``training_step`` is
    computed after that epoch's validation, and one logged in the module's ``on_train_epoch_end`` after this
    callback's hook of it, where those monitors act (``EarlyStopping``'s ``check_on_train_epoch_end``). A fit whose
    validation is switched off (``limit_val_batches 0``, a debug run) is not checked for validation metrics:
    Lightning only warns then, as one cannot be there.
    ``from_run``: the callbacks the engine built from ``run.monitor`` (the others came with ``trainer.callbacks``);
    ``watchers``: every ``ModelCheckpoint`` and ``EarlyStopping`` with a monitor of the run (``Judging`` sets them).
    """

    def __init__(self, from_run: list[Callback], watchers: list[Callback] | None = None) -> None:
        self.from_run = from_run
        self.watchers = list(watchers or [])
        self.checked = False  # the validation metrics
        self.checked_training = False  # the training metrics (all of a module without validation)
        self.ended_an_epoch = False

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.checked or trainer.sanity_checking or not is_overridden("validation_step", pl_module):
            return
        self.checked = True
        self._check(trainer, [c for c in self.watchers if not c.monitor.startswith("train")], "the first validation")

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # in this process (a resume starts with none logged), in full
        self.ended_an_epoch = self.ended_an_epoch or not stopping_mid_epoch(trainer)

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self.ended_an_epoch or self.checked_training:
            return
        self.checked_training = True
        without_validation = not is_overridden("validation_step", pl_module)
        watchers = [c for c in self.watchers if without_validation or c.monitor.startswith("train")]
        self._check(trainer, watchers, "the first training epoch")

    on_train_end = on_train_epoch_start  # a fit of one epoch: its end

    def _check(self, trainer: L.Trainer, watchers: list[Callback], when: str) -> None:
        missing = next((c for c in watchers if c.monitor not in trainer.callback_metrics), None)
        if missing is None:
            return
        if missing in self.from_run:
            who = "run.monitor"
            fix = "monitor one of those (--run.monitor KEY --run.mode min|max), or none (--run.monitor null)"
        else:
            who = f"the monitor of a {type(missing).__name__} in trainer.callbacks"
            fix = "change that monitor to one of those"
        keys = ", ".join(sorted(trainer.callback_metrics)) or "nothing"
        raise ValueError(
            f"{who} is {missing.monitor!r}, which the module did not log by the end of {when} (it logs: {keys}): "
            f"{fix}, or self.log({missing.monitor!r}, ...) in the module"
        )


class Judging(Callback):
    """Hands the run's judge (``judge_of``) to ``readers`` (each with a ``judge``) and every callback judging by a
    monitor to ``checks``' watchers: when the CLI builds the Trainer (a sweep reads the CLI's before any fit), and
    again at setup, where ``trainer.callbacks`` also holds those of the module's ``configure_callbacks`` (Lightning
    adds them there, in place of the list's callbacks of their type)."""

    def __init__(self, monitor: str | None, readers: list[Any], checks: list[CheckMonitored]) -> None:
        self.monitor, self.readers, self.checks = monitor, readers, checks

    def hand_over(self, callbacks: list[Callback]) -> None:
        judge = judge_of(callbacks, self.monitor)
        for reader in self.readers:
            reader.judge = judge
        for check in self.checks:
            check.watchers = [c for c in callbacks if isinstance(c, ModelCheckpoint | EarlyStopping) and c.monitor]

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.hand_over(trainer.callbacks)


# The best of a run on disk. Lightning adds a top-k file to its ModelCheckpoint's best_k_models (path -> score)
# before saving it, so each such file lists itself, with its own score, in the callback state it carries. The best
# of a run is the file on disk that ranks first by its own record. Hence:
#
# - a file deleted by ``save_top_k`` rotation is not on disk, so it is never picked (the record in a newer file may
#   still name it);
# - a run continued by ``fit --ckpt_path last`` finds the files of every segment, also when the resumed callback
#   started a fresh record (Lightning drops ``best_k_models`` when the checkpoint folder's path changed);
# - a run folder that was moved or copied still works: files are matched by name, not by the path they were saved at.


@dataclass(frozen=True)
class Scored:
    """A top-k checkpoint and the score its ``ModelCheckpoint`` saved it with."""

    path: Path
    monitor: str
    mode: str  # "min" or "max"
    score: float
    mtime: float
    judge: tuple[str, str] | None = None  # the run's (monitor, mode), from the engine's record in the file


def scored_checkpoint(path: Path) -> Scored | None:
    """The monitored score ``path`` was saved with, if a ``ModelCheckpoint`` saved it as one of its top k."""
    try:
        # the structure only; the weights stay on disk (a sharded folder: its meta.pt)
        checkpoint = read_meta(path) if path.is_dir() else load_checkpoint_file(path, mmap=True)
    except CheckpointLoadError:
        return None
    states = checkpoint.get("callbacks") or {}
    # the engine's record names the run's judge and its mode; a file plain Lightning (or engine 1.0.0)
    # wrote has none, and its ModelCheckpoint's mode is only in its state key
    record = states.get(ExactResume.__qualname__)
    judge = record.get("judge") if isinstance(record, dict) else None
    for key, state in states.items():
        if not isinstance(state, dict) or not state.get("monitor") or "best_k_models" not in state:
            continue
        scores = {Path(str(saved)).name: score for saved, score in (state["best_k_models"] or {}).items()}
        if path.name in scores:
            own = judge is not None and judge.get("state_key") == key  # the run's judge: its mode is in the record
            mode = judge["mode"] if own else state_key_arguments(key).get("mode", "min")
            run = (judge["monitor"], judge["mode"]) if judge is not None and "monitor" in judge else None
            return Scored(path, state["monitor"], mode, float(scores[path.name]), path.stat().st_mtime, run)
    return None


def best_checkpoint(run_dir: Path) -> tuple[Scored, int] | None:
    """The best top-k checkpoint in ``run_dir/checkpoints`` and how many were ranked; ``None`` if none was saved by
    a ``ModelCheckpoint`` with a ``monitor``.

    Files are ranked by the run's monitor (and mode) as the newest of them records it (the first ``ModelCheckpoint``
    with a monitor, the one the summary names, when several keep files), should a resumed run have changed it; a
    run without the engine's record (plain Lightning) by the newest file's own. On a tie the older file wins, as in
    Lightning's own choice.
    """
    files = [p for p in (run_dir / "checkpoints").glob("*.ckpt") if p.is_file() or is_sharded_checkpoint(p)]
    scored = [s for p in files if (s := scored_checkpoint(p))]
    if not scored:
        return None
    scored.sort(key=lambda s: s.mtime)
    newest = scored[-1]
    ranked = [s for s in scored if (s.monitor, s.mode) == (newest.judge or (newest.monitor, newest.mode))]
    if not ranked:  # the judge kept no file (all rotated away): the newest file's own monitor, as before
        ranked = [s for s in scored if (s.monitor, s.mode) == (newest.monitor, newest.mode)]
    pick = max if ranked[0].mode == "max" else min
    return pick(ranked, key=lambda s: s.score), len(ranked)


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
        run_dir = trainer.strategy.broadcast(trainer.default_root_dir)  # the run folder (lightkeep.runs)
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
    ckpt_path = None
    if trainer.fast_dev_run:
        why = "fast_dev_run keeps no checkpoint: the weights fit ended with"
    elif judge is None:
        why = "no ModelCheckpoint with a monitor: the weights fit ended with"
    elif not judge.best_model_path:
        why = f"no checkpoint by {judge.monitor} was saved: the weights fit ended with"
    else:
        ckpt_path = judge.best_model_path
        why = f"best {judge.monitor} {float(judge.best_model_score):.4f}: {ckpt_path}"
    # Every rank has the same best: ModelCheckpoint ranks the synced monitor values alike on all of them. (No
    # broadcast: fit's teardown has closed the process group; test opens a new one.)
    rank_zero_info(f"Test after fit: {why}")
    trainer.test(model, datamodule=datamodule, ckpt_path=ckpt_path)
