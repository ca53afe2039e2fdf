"""The run folder at run time: every rank takes rank 0's folder, checkpoints land in it, logger ids are recorded."""

import contextlib
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from lightning.pytorch.loggers.logger import DummyLogger
from lightning.pytorch.utilities import rank_zero_only

from lightkeep.compat import launched_children
from lightkeep.compat_logging import continue_evaluation_logging_steps, evaluation_logging_steps
from lightkeep.compat_loops import logging_step
from lightkeep.distributed import every_rank
from lightkeep.loggers import StepGate
from lightkeep.run_checkpoints import EVALUATION_LOGGING_STEPS, NEXT_LOGGING_STEP, ResumeError
from lightkeep.run_loggers import write_record
from lightkeep.runs import RunPlan, torchrun_agent


class RunFolder(Callback):
    """Puts what a run writes into the folder the CLI planned (``lightkeep.runs``).

    - Each ``ModelCheckpoint`` without a ``dirpath`` writes to ``<run>/checkpoints`` (rank 0's folder, broadcast:
      under torchrun each rank planned alone and may have seen another newest version).
    - ``run.json`` records the MLflow/W&B run ids at the start of ``fit``, for a resume to continue those runs.
    - During ``fit``, loggers that cannot drop points (all but TensorBoard and CSV, which drop what a killed run
      logged after its checkpoint) receive values only at checkpoints, and a resumed run drops the steps its
      interrupted run logged (``StepGate``).
    """

    def __init__(self, plan: RunPlan) -> None:
        self.plan = plan
        self.dir: Path = plan.dir
        self._gates: list[StepGate] = []
        self._checkpoint_step = 0  # values of steps before it may reach loggers that cannot drop points
        self._release_at_next_batch = False
        self._batch_start: tuple[int, int] | None = None  # (logging step, global step) as the batch began
        self.trained = False  # a training batch of this invocation ended: a failure after it keeps the folder
        self._evaluation_steps: dict[int, int] | None = None  # a checkpoint's, for the resumed fit's validation

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.dir = Path(trainer.strategy.broadcast(str(self.plan.dir)))
        # Each rank resolved --ckpt_path (last, hpc, a SLURM requeue's) from what its file system showed it
        found = set(every_rank(str(self.plan.resumed_from)))
        if len(found) > 1:
            raise ResumeError(
                f"The ranks found different checkpoints to start from ({', '.join(sorted(found))}): their file systems "
                "do not show the same files yet. Give one with --ckpt_path FILE."
            )
        for callback in trainer.checkpoint_callbacks:
            if isinstance(callback, ModelCheckpoint) and callback.dirpath is None:
                callback.dirpath = str(self.dir / "checkpoints")
        if stage == "fit" and trainer.is_global_zero:
            resumed_at = self.plan.log_step if self.plan.continues else 0
            self._gates = [
                StepGate(
                    logger, resumed_at, hold=not isinstance(logger, (TensorBoardLogger, CSVLogger)), trainer=trainer
                )
                for logger in trainer.loggers
                if not isinstance(logger, DummyLogger)
            ]

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        job = dict(self.plan.job)
        if "torchrun_run_id" in job:  # every node's agent, which a restart of the workers finds its run by
            job["torchrun_agents"] = sorted(set(every_rank(torchrun_agent())))
        if trainer.is_global_zero and not trainer.fast_dev_run:  # which writes nothing, as Lightning documents
            write_record(self.dir, trainer.loggers, job)

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        # Which logged steps the checkpoint covers: the resumed run logs from the next one on. Loggers get
        # Lightning's logging step, which counts batches, not optimizer steps (two optimizers: half global_step).
        checkpoint[NEXT_LOGGING_STEP] = self._checkpoint_step = self._next_logging_step(trainer, pl_module)
        if trainer.state.fn == "fit":
            checkpoint[EVALUATION_LOGGING_STEPS] = evaluation_logging_steps(trainer)
        self._release()
        self._release_at_next_batch = True

    def _next_logging_step(self, trainer: L.Trainer, pl_module: L.LightningModule) -> int:
        """The logging step of the batch after this checkpoint. Saved inside a batch (its end, or the validation
        after it), Lightning has yet to count that batch: one more if it stepped. Saved after its epoch ended,
        it has counted it."""
        now = logging_step(trainer)
        if self._batch_start is None or now != self._batch_start[0]:
            return now
        stepped = not pl_module.automatic_optimization or trainer.global_step > self._batch_start[1]
        return now + stepped

    def on_load_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        self._evaluation_steps = checkpoint.get(EVALUATION_LOGGING_STEPS) if trainer.state.fn == "fit" else None
        if trainer.ckpt_path is not None:
            _respell_saved_folders(trainer, checkpoint)

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # A validation_step value logged with on_step=True goes to the loggers at Lightning's count of this process's
        # validation batches: a resumed fit continues the count, rather than log at the steps of the first ones
        if self._evaluation_steps and not trainer.sanity_checking:
            continue_evaluation_logging_steps(trainer, self._evaluation_steps)
            self._evaluation_steps = None

    def on_train_batch_start(self, trainer: L.Trainer, *_: Any) -> None:
        self._batch_start = (logging_step(trainer), trainer.global_step)
        if self._release_at_next_batch:  # the checkpoint step's own values, which Lightning logged after saving it
            self._release()
            self._release_at_next_batch = False

    def on_train_batch_end(self, *_: Any) -> None:
        self.trained = True

    def _release(self) -> None:
        for gate in self._gates:
            gate.release(before=self._checkpoint_step)

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        # Lightning calls this only when the stage finished: the last values go out (RunSummary's among them).
        self._detach(before=None)

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        # What was logged after the last checkpoint is dropped: the resumed run logs those steps again.
        self._detach(before=self._checkpoint_step)

    def _detach(self, before: int | None) -> None:
        for gate in self._gates:
            gate.release(before)
            gate.detach()
        self._gates = []


# Files of a run folder that a start rewrites in place (keep_csv_history, the loggers' hparams, write_record): a
# continued run that fails before it trains puts their bytes back. Checkpoints are never among them.
REWRITTEN_AT_START = ("metrics.csv", "hparams.yaml", "run.json")


@dataclass
class FolderBefore:
    """A continued run's folder as this invocation found it: what a failed start must leave as it was.

    A resume that fails at its start (``--trainer.max_epochs`` below the checkpoint's epoch, a damaged checkpoint)
    would otherwise leave ``config.N.yaml`` and an event file carrying ``purge_step`` in the earlier run, and
    TensorBoard would then hide that run's points after the checkpoint's step.
    """

    folder: Path
    paths: set[Path]
    kept: dict[Path, bytes]

    @classmethod
    def take(cls, folder: Path) -> "FolderBefore":
        paths = set(folder.rglob("*")) if folder.is_dir() else set()
        kept = {folder / name: (folder / name).read_bytes() for name in REWRITTEN_AT_START if (folder / name).is_file()}
        return cls(folder, paths, kept)

    def put_back(self) -> None:
        """Removes what was added (checkpoints excepted: a checkpoint is never deleted) and restores the bytes of
        ``REWRITTEN_AT_START``."""
        checkpoints = self.folder / "checkpoints"
        added = [p for p in self.folder.rglob("*") if p not in self.paths and checkpoints not in (p, *p.parents)]
        for path in sorted(added, key=lambda p: len(p.parts), reverse=True):  # files before their folders
            with contextlib.suppress(OSError):
                path.rmdir() if path.is_dir() and not path.is_symlink() else path.unlink()
        for path, data in self.kept.items():
            if not path.is_file() or path.read_bytes() != data:
                path.write_bytes(data)


# What a run folder holds before the run has produced anything: the config, the loggers' opening files, the
# rank-failure notes. A folder with nothing else is no run worth keeping.
OPENING_FILES = ("config.yaml", "hparams.yaml", "run.json", ".failures", "checkpoints")


def remove_if_empty(plan: RunPlan | None) -> None:
    """After a run that wrote nothing at all (``fast_dev_run``, which Lightning documents as writing nothing): the
    folder claimed for it goes, with the folders above it that its planning made (rank 0)."""
    if plan is None or plan.continues or rank_zero_only.rank != 0 or not plan.dir.is_dir() or any(plan.dir.iterdir()):
        return
    for folder in (plan.dir, plan.dir.parent, *reversed(plan.made)):
        with contextlib.suppress(OSError):
            folder.rmdir()


def clean_up_failed_start(
    plan: RunPlan | None, run_folder: RunFolder | None, trainer: L.Trainer | None, before: FolderBefore | None
) -> None:
    """After a run that failed or was stopped before it trained a batch (rank 0, once the run has unwound: every
    rank is gone and the loggers are closed): a continued run's folder is put back as it was (``FolderBefore``), a
    new run's folder removed if it holds nothing but its opening files."""
    if plan is None or rank_zero_only.rank != 0 or not plan.dir.is_dir():
        return
    if run_folder is not None and run_folder.trained:
        return  # its logs and checkpoints are worth keeping
    for proc in launched_children(trainer) if trainer is not None else []:  # rank 0 started the others
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)  # the other ranks leave their notes before the folder goes
    if plan.continues:
        if before is not None:
            before.put_back()
        return
    checkpoints = plan.dir / "checkpoints"
    if checkpoints.is_dir() and any(checkpoints.iterdir()):
        return
    if all(p.name in OPENING_FILES or p.name.startswith("events.out.tfevents.") for p in plan.dir.iterdir()):
        shutil.rmtree(plan.dir, ignore_errors=True)
        # the run family, when this was its only run; run.root too, when this run made it
        for folder in (plan.dir.parent, *reversed(plan.made)):
            with contextlib.suppress(OSError):
                folder.rmdir()


def _respell_saved_folders(trainer: L.Trainer, checkpoint: dict) -> None:
    """Lightning restores a ``ModelCheckpoint``'s best files, scores and last file only where the checkpoint's
    ``dirpath`` is its own, compared as strings, and silently here (the warning is left out for evaluations, whose
    folder is a new one: ``lightkeep.console``). A fit that continues its run's folder under another name (``runs``
    relative from another working directory, an absolute ``--run.root``, a symlink) started its top-k afresh: it kept
    files it would have deleted and called a worse file the best. Where the checkpoint resumed from lies in the
    callback's folder, the saved paths are written in this run's spelling before Lightning compares them."""
    here = Path(trainer.ckpt_path).resolve().parent
    states = checkpoint.get("callbacks") or {}
    for callback in trainer.checkpoint_callbacks:
        state = states.get(callback.state_key) if isinstance(callback, ModelCheckpoint) else None
        was, now = (state or {}).get("dirpath"), callback.dirpath
        if not (was and now) or was == now or "://" in str(now) or Path(now).resolve() != here:
            continue
        state["dirpath"] = now
        state["best_k_models"] = {_respelled(k, was, now): v for k, v in (state.get("best_k_models") or {}).items()}
        for key in ("best_model_path", "kth_best_model_path", "last_model_path"):
            if key in state:
                state[key] = _respelled(state[key], was, now)


def _respelled(path: Any, was: str, now: str) -> Any:
    """``path`` of a file in folder ``was`` as one in ``now``; any other path as it is."""
    inside = isinstance(path, str) and Path(path).parent == Path(was)
    return str(Path(now) / Path(path).name) if inside else path
