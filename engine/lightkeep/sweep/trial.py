"""Inside one sweep trial (an ordinary ``fit`` run started by ``lightkeep.sweep.study``): report the monitored metric to
the Optuna study after each validation, stop every rank at the same epoch when the pruner says so, and record the
trial in the run folder (``trial.json``) and its run folder and best checkpoint in the study."""

import json
import os
from pathlib import Path

import lightning as L
import optuna
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.model_helpers import is_overridden

from lightkeep.judge import ReadsJudge

TRIAL_RECORD = "trial.json"


def open_storage(url: str) -> optuna.storages.BaseStorage:
    """``sqlite:///...``, ``postgresql://...`` (any SQLAlchemy URL), or a ``.journal`` file (Optuna's journal
    storage, for a disk that SQLite's locks do not work on, e.g. NFS)."""
    if url.endswith(".journal"):
        from optuna.storages.journal import JournalFileBackend, JournalStorage

        return JournalStorage(JournalFileBackend(url))
    # SQLite waits up to a minute for another worker's write instead of failing at once with "database is locked"
    engine_kwargs = {"connect_args": {"timeout": 60}} if url.startswith("sqlite") else None
    return optuna.storages.RDBStorage(url, engine_kwargs=engine_kwargs)


def trial_id(storage: optuna.storages.BaseStorage, study_name: str, number: int) -> int:
    return storage.get_trial_id_from_study_id_trial_number(storage.get_study_id_from_name(study_name), number)


class ReportToStudy(ReadsJudge, L.Callback):
    """Reports ``monitor`` after each validation (after each training epoch, for a module without
    ``validation_step``) as the trial's intermediate value at the epoch, and prunes.

    Rank 0 alone talks to the study and decides; the decision is broadcast, so every rank sets ``should_stop`` at
    the same validation and the run ends at the same step everywhere (a pruned run keeps its checkpoints). A pruned
    trial is marked in the study (user attribute ``pruned_at_epoch``), so the sweep records it as pruned even if it
    is killed before it hears back; a resumed run of a pruned trial stops at once.

    Args:
        storage: The study's storage URL (see ``open_storage``).
        study: Study name.
        trial: Trial number.
        monitor: The metric the sweep optimises, as logged.
        pruner: Optuna pruner; ``None``: never prune.
    """

    def __init__(
        self, storage: str, study: str, trial: int, monitor: str, pruner: optuna.pruners.BasePruner | None = None
    ) -> None:
        self.storage, self.study, self.number, self.monitor, self.pruner = storage, study, trial, monitor, pruner
        self.judge: ModelCheckpoint | None = None  # the run's (the CLI hands it over): its best file is the trial's
        self._trial: optuna.Trial | None = None

    def _open(self) -> optuna.Trial:
        if self._trial is None:
            storage = open_storage(self.storage)
            # A random sampler: this process suggests nothing; sampling is the sweep's business.
            study = optuna.load_study(
                study_name=self.study, storage=storage, pruner=self.pruner, sampler=optuna.samplers.RandomSampler()
            )
            self._id = trial_id(storage, self.study, self.number)
            self._storage, self._trial = storage, optuna.trial.Trial(study, self._id)
        return self._trial

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        stop = False
        if trainer.is_global_zero:
            trial = self._open()
            run_dir = Path(trainer.default_root_dir)  # the engine's run folder (lightkeep.runs)
            trial.set_user_attr("run_dir", str(run_dir))
            record = {"study": self.study, "trial": self.number, "params": trial.params, "storage": self.storage}
            tmp = run_dir / f"{TRIAL_RECORD}.tmp"
            tmp.write_text(json.dumps(record, indent=2) + "\n")
            os.replace(tmp, run_dir / TRIAL_RECORD)
            stop = "pruned_at_epoch" in trial.user_attrs  # pruned, then killed before the sweep heard of it
        if trainer.strategy.broadcast(stop, src=0):
            trainer.should_stop = True

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.sanity_checking:
            self._report(trainer)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not is_overridden("validation_step", pl_module):  # a module without validation: its training metrics
            self._report(trainer)

    def _report(self, trainer: L.Trainer) -> None:
        if self.monitor not in trainer.callback_metrics:  # on every rank (they log alike): none waits for rank 0
            logged = ", ".join(sorted(trainer.callback_metrics)) or "nothing"
            raise ValueError(f"the sweep's monitor {self.monitor!r} is not logged (logged: {logged}); fix monitor")
        prune = False
        if trainer.is_global_zero:
            trial, epoch = self._open(), trainer.current_epoch
            # once per epoch: the killed run of a resumed trial may have reported this one (the same value)
            if epoch not in self._storage.get_trial(self._id).intermediate_values:
                trial.report(float(trainer.callback_metrics[self.monitor]), step=epoch)
            prune = self.pruner is not None and trial.should_prune()
            if prune:
                trial.set_user_attr("pruned_at_epoch", epoch)
        if trainer.strategy.broadcast(prune, src=0):
            trainer.should_stop = True  # every rank, at this validation: Lightning stops after this epoch

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.is_global_zero and self.judge is not None and self.judge.best_model_path:
            self._open().set_user_attr("checkpoint", self.judge.best_model_path)
