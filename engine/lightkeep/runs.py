"""Where runs live, whatever logs them: ``<root>/<name>/version_N/`` holds a run's ``config.yaml``, ``checkpoints/``,
``run.json`` and what its loggers write locally.

Lightning leaves the folder to the first logger (without one, every run writes the same ``checkpoints/``) and looks
for ``--ckpt_path last`` only inside a brand-new version, so a plain resume trains from scratch. Here the engine picks
the folder before anything is built, points every logger it knows into it (TensorBoard, CSV, MLflow, W&B) and every
``ModelCheckpoint`` without a ``dirpath`` at its ``checkpoints/``. A ``save_dir`` or ``name`` a project gives its
TensorBoard/CSV logger (set or linked) is ``<root>`` or ``<name>``: the run's folder and the logger's are one. Each
command claims a new version, so none writes into a folder that holds files, but a ``fit`` that continues its run.
``last`` is the newest loadable checkpoint of any version; ``fit`` from it (or from a run's ``last*.ckpt``) continues
that run: the same folder and TensorBoard/CSV version (the points logged after the checkpoint are dropped), the same
MLflow and W&B run (ids kept in ``run.json``). ``fit`` from any other checkpoint branches into a new version and never
writes into the run it came from.
"""

import json
import os
import re
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from jsonargparse import Namespace
from lightning.pytorch.plugins.environments import SLURMEnvironment
from lightning.pytorch.utilities import rank_zero_info, rank_zero_only

from lightkeep.config import entry
from lightkeep.run_checkpoints import (
    IN_A_RUN,
    RUN_CHECKPOINTS,
    ResumeError,
    checkpoints_newest_first,
    find_best_checkpoint,
    find_last_checkpoint,
    is_loadable,
    read_global_step,
    read_positions,
    run_of,
)
from lightkeep.sharded.folders import is_checkpoint_folder

RUN_DIR_ENV = "PROJECT_RUN_DIR"  # the folder rank 0 claimed, for the ranks it starts
RUN_RECORD = "run.json"  # the run's logger ids, for a resume to continue the same MLflow/W&B run


class Runs:
    """Where runs are kept: ``<root>/<name>/version_N/``, one folder per invocation (a resumed ``fit`` continues its
    run's folder). Every logger writes there (MLflow: into its own store, the run named ``<name>/version_N``). And
    what a ``fit`` is judged by: ``monitor`` picks its best checkpoints (a ``ModelCheckpoint`` the engine adds), stops
    it early (``patience``), is a sweep's objective and the run summary's score.

    Args:
        root: Folder that holds every kind of run.
        name: Subfolder for this kind of run; ``None``: named after the data module (``CifarDataModule``: ``cifar``).
        monitor: The metric, as the module logs it with ``self.log``, that ranks the checkpoints. ``None``: no best
            checkpoints, only the engine's ``last.ckpt`` and periodic files (``checkpoints.*``) and those of a
            ``ModelCheckpoint`` in ``trainer.callbacks``.
            A fit whose module does not log it stops at the first validation's end, before training, naming the
            keys it does log.
        mode: Whether a smaller (``min``, a loss) or larger (``max``, an accuracy) ``monitor`` is better.
        save_top_k: Best checkpoints kept (``best-epoch..-step...ckpt``); ``-1``: every validation's.
        patience: Validations without improvement of ``monitor`` after which ``fit`` stops (Lightning's
            ``EarlyStopping``); ``None``: never stops early.
        test_after_fit: When ``fit`` finishes (not when it is stopped), run ``test`` on its best checkpoint in the
            same process, on every rank, logging ``test/*`` into the same run (``lightkeep.judge``).
        hang_timeout: Seconds without progress on any rank of a DDP run (no training, validation, test or predict
            batch, no checkpoint save) after which the run ends in one line naming the rank that stopped, its step,
            the intact checkpoint and the resume command (``lightkeep.hang_watchdog``): 300 by default, well
            under the 30 minutes a collective waits for a peer before it fails. ``None``: never.
        seed_per_sample: In loader workers, random draws in a training ``Dataset.__getitem__`` (augmentation from
            torch's, numpy's or Python's global generator) seeded from ``(seed, epoch, index)``, so that a resume,
            another number of workers or ranks augment each sample alike (``lightkeep.sample_seeds``; ~8 us a
            sample). ``false``: each worker's own stream, as plain PyTorch, and the start line says a resume is
            inexact.
        stream_resume: How a mid-epoch resume continues a train ``IterableDataset`` without ``state_dict`` (one
            with it resumes at its own state): ``fast_forward`` reads again the samples trained on, per loader
            worker and rank, without training on them, and checks the samples after them against the checkpoint's
            fingerprint (a stream whose order is not a function of the seed and epoch stops there in one line);
            ``restart`` starts that epoch's data again (samples trained on are trained on twice)
            (``lightkeep.stream_resume``). A loader that keeps its own position (``StatefulDataLoader``) resumes
            at each rank's, and a first batch other than the one the checkpoint's run fetched next stops the run
            in one line, unless ``as_saved``: it continues from the loader's own state, not exactly
            (``lightkeep.own_positions``).
    """

    def __init__(
        self,
        root: str = "runs",
        name: str | None = None,
        monitor: str | None = None,
        mode: Literal["min", "max"] = "min",
        save_top_k: int = 3,
        patience: int | None = None,
        test_after_fit: bool = False,
        hang_timeout: float | None = 300.0,
        seed_per_sample: bool = True,
        stream_resume: Literal["fast_forward", "restart", "as_saved"] = "fast_forward",
    ) -> None:
        if name is not None and (not name or "/" in name or name in (".", "..")):
            raise ValueError(f"run.name ({name!r}) must be one folder name, without '/'")
        if monitor is not None and not monitor:
            raise ValueError("run.monitor is empty: give the name of a logged metric, or null to monitor none")
        if save_top_k == 0 or save_top_k < -1:
            raise ValueError(f"run.save_top_k ({save_top_k}) must be >= 1, or -1 for all; no best: run.monitor null")
        if patience is not None and patience < 1:
            raise ValueError(f"run.patience ({patience}) must be >= 1, or null for no early stopping")
        if patience is not None and monitor is None:
            raise ValueError(f"run.patience ({patience}) stops on run.monitor, which is null: give --run.monitor KEY")
        if hang_timeout is not None and not hang_timeout > 0:
            raise ValueError(f"run.hang_timeout ({hang_timeout}) must be > 0 seconds, or null to never end a hung run")
        self.root, self.name, self.test_after_fit = root, name, test_after_fit
        self.hang_timeout, self.seed_per_sample, self.stream_resume = hang_timeout, seed_per_sample, stream_resume
        self.monitor, self.mode, self.save_top_k, self.patience = monitor, mode, save_top_k, patience


@dataclass
class RunPlan:
    """What the engine decided before anything was built; every rank of a run ends up with rank 0's decision."""

    dir: Path
    continues: bool = False  # fit continues this run's folder and loggers
    resumed_from: Path | None = None
    global_step: int | None = None
    record: dict[str, Any] = field(default_factory=dict)  # run.json of the continued run
    log_step: int | None = None  # the loggers' step the continued run starts at (read_positions)
    job: dict[str, Any] = field(default_factory=dict)  # run.json's record of the launcher's job (launcher_job)
    made: tuple[Path, ...] = ()  # the folders above dir that planning it created (run.root, the run family)

    @property
    def version(self) -> int:
        return int(self.dir.name.split("_", 1)[1])


def default_name(data_class_path: str | None) -> str:
    """``my_lab.data.CifarDataModule`` -> ``cifar``, ``MNIST1DDataModule`` -> ``mnist1d``, ``ImageNet`` ->
    ``image_net``: a run is filed under what it trains on (``family_dir``: the model's name when the model brings
    its own data, ``LightningTransformer`` -> ``lightning_transformer``)."""
    name = (data_class_path or "").rsplit(".", 1)[-1]
    suffix = next((s for s in ("DataModule", "Datamodule", "Dataset", "Data") if name.endswith(s) and name != s), "")
    name = name.removesuffix(suffix)
    return re.sub(r"(?<=[a-z])(?=[A-Z])", "_", name).lower() or "runs"


# What a config gives a TensorBoard/CSV logger only because it requires one (configs/csv.yaml, the engine's default
# logger, a logger appended with +=), and the loggers' own default name: neither is a project's choice of folder
PLACEHOLDER_SAVE_DIR, DEFAULT_LOGGER_NAME = "runs", "lightning_logs"


def logger_folder(config: Namespace) -> tuple[str | None, str | None]:
    """The ``save_dir`` and ``name`` a project gave its first TensorBoard/CSV logger (in a config, a flag or a link
    applied at parsing), each ``None`` where it left them to the engine. A logger with a ``version`` is one the
    engine pointed at a run (``run_loggers.point_loggers_at``), read back from that run's ``config.yaml``."""
    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

    from lightkeep.loggers import class_named

    trainer = config.get("trainer")
    loggers = trainer.get("logger") if isinstance(trainer, Namespace) else None
    for item in loggers if isinstance(loggers, list) else [loggers]:
        cls = class_named(item.class_path) if isinstance(item, Namespace) and item.get("class_path") else None
        if cls is None or not issubclass(cls, (TensorBoardLogger, CSVLogger)):
            continue
        args = item.get("init_args") or Namespace()
        if args.get("version") is not None:
            return None, None
        save_dir, name = args.get("save_dir"), args.get("name")
        save_dir = str(save_dir) if save_dir and str(save_dir) != PLACEHOLDER_SAVE_DIR else None
        return save_dir, name if name and name != DEFAULT_LOGGER_NAME else None
    return None, None


def runs_root(config: Namespace) -> Path:
    """``run.root``, or where a project's own settings put runs: its logger's ``save_dir`` (``logger_folder``), else
    Lightning's ``trainer.default_root_dir``, as Lightning places logs and checkpoints. A run folder given as
    ``default_root_dir`` (``.../<name>/version_N``) is the engine's own, written into each run's ``config.yaml``: a
    config read back from a run starts its family's next version, not one inside.
    """
    runs = config.get("run") or Namespace(root="runs", name=None)
    trainer = config.get("trainer")
    root_dir = trainer.get("default_root_dir") if isinstance(trainer, Namespace) else None
    if root_dir and re.fullmatch(r"version_\d+", Path(root_dir).name):
        root_dir = None
    for key, given in (("trainer.logger's save_dir", logger_folder(config)[0]), ("trainer.default_root_dir", root_dir)):
        if not given:
            continue
        if runs.root != "runs" and Path(runs.root) != Path(given):
            raise ValueError(f"run.root {runs.root} and {key} {given} both say where runs go: give one of them")
        return Path(given)
    return Path(runs.root)


def family_dir(config: Namespace, fixed: dict[str, str] | None = None) -> Path:
    """``fixed``: the class paths of the ``data``/``model`` a LightningCLI was given as its fixed classes, which its
    config does not name. The family is ``run.name``, or the name a project gave its logger, or the data's."""
    runs = config.get("run") or Namespace(root="runs", name=None)
    root = runs_root(config)
    logger_name = logger_folder(config)[1]
    if runs.name and logger_name and runs.name != logger_name:
        raise ValueError(
            f"run.name {runs.name} and trainer.logger's name {logger_name} both name the runs: give one of them"
        )
    named = {key: config.get(key) for key in ("data", "model")}
    named = {key: v["class_path"] for key, v in named.items() if isinstance(v, Namespace) and "class_path" in v}
    data_class, model_class = ({**(fixed or {}), **named}.get(key) for key in ("data", "model"))
    family = root / (runs.name or logger_name or default_name(data_class or model_class))
    legacy = root / default_name(None)  # where 1.1.0 and before filed a model that brings its own data
    if not runs.name and not logger_name and not data_class and model_class and legacy.is_dir() and not family.exists():
        return legacy  # its runs stay one family: --ckpt_path last still finds them
    return family


def next_version_dir(family: Path) -> Path:
    versions = [int(p.name[8:]) for p in family.glob("version_*") if p.is_dir() and p.name[8:].isdigit()]
    return family / f"version_{max(versions, default=-1) + 1}"


def new_version(family: Path, **fields: Any) -> RunPlan:
    """A plan for the next version, claimed (``claim_next_version``); it names the folders the claim created, for a
    failed start to remove them again (``run_folder.clean_up_failed_start``)."""
    made = tuple(p for p in reversed([family, *family.parents]) if not p.exists())
    return RunPlan(claim_next_version(family), made=made if rank_zero_only.rank == 0 else (), **fields)


def claim_next_version(family: Path) -> Path:
    """The next ``version_N``, made here by rank 0 with an exclusive ``mkdir`` before anything is built: runs
    started together (a sweep's workers, a job array) each get a folder of their own, never one another's. The
    other ranks only name it (``RUN_DIR_ENV``, under Lightning's launcher, which starts them from rank 0) and take
    rank 0's folder once the processes meet (``RunFolder.setup``; under torchrun each rank plans alone). A run that
    fails before writing into it removes it (``run_folder.clean_up_failed_start``)."""
    if rank_zero_only.rank != 0:
        given = os.environ.get(RUN_DIR_ENV)  # rank 0's claim, when rank 0 started this process
        return Path(given) if given and Path(given).parent == family else next_version_dir(family)
    family.mkdir(parents=True, exist_ok=True)
    while True:
        path = next_version_dir(family)
        try:
            path.mkdir()
        except FileExistsError:  # another run took it between the listing and the mkdir: the next one
            continue
        # Lightning's ddp launcher starts the other ranks with this process's environment: they name this folder
        # from the start (their failure notes land in it); set for the run only (lightkeep.run_scope)
        os.environ[RUN_DIR_ENV] = str(path)
        return path


def launcher_job(command: list[str]) -> dict[str, Any]:
    """What ``run.json`` records of the launcher that restarts a failed job with its command as it was (``{}``
    without one), for the restart to find the run again (``jobs_runs``): SLURM's job id, or torchrun's run id (its
    agents, which stay while their workers restart, are added as the run starts: ``run_folder``); and the command."""
    if "TORCHELASTIC_RUN_ID" in os.environ:  # torchrun, under SLURM too: the one that restarts the workers
        return {"torchrun_run_id": os.environ["TORCHELASTIC_RUN_ID"], "command": command}
    job = os.environ.get("SLURM_JOB_ID")
    return {"slurm_job_id": job, "command": command} if job and SLURMEnvironment.detect() else {}


def torchrun_agent() -> str:
    """This worker's torchrun agent (its parent process), which outlives the workers it restarts."""
    return f"{socket.gethostname()}:{os.getppid()}"


def jobs_runs(family: Path, command: list[str]) -> list[Path]:
    """The runs in ``family`` this job started with this command, newest first, for a restarted job. Lightning's
    SLURM auto-requeue (SIGUSR1: an ``hpc_ckpt``, then ``scontrol requeue``) reruns the job's command as it was, and
    so does torchrun's ``--max-restarts`` after a worker fails; Lightning resumes only the first, from the ``hpc_ckpt``
    in ``default_root_dir``: a new run folder here. The command tells apart the fits of a job that runs several (a loop
    over seeds); under torchrun, whose run id is "none" unless given, so does this worker's agent. A ``run.json``
    that does not read is passed over, and said."""
    job = launcher_job(command)
    if not job:
        return []
    runs = sorted(family.glob("version_*"), key=lambda p: int(p.name[8:]) if p.name[8:].isdigit() else -1)
    mine = []
    for run_dir in reversed(runs):
        try:
            record = json.loads((run_dir / RUN_RECORD).read_text())
        except FileNotFoundError:
            continue
        except (OSError, ValueError) as error:  # a node that failed while writing it
            rank_zero_info(f"Skipping {run_dir / RUN_RECORD}, which does not read: {error}")
            continue
        if not isinstance(record, dict) or any(record.get(key) != value for key, value in job.items()):
            continue
        if "torchrun_run_id" in job and torchrun_agent() not in record.get("torchrun_agents", []):
            continue
        mine.append(run_dir)
    return mine


def requeued_jobs_checkpoint(family: Path, command: list[str]) -> tuple[Path, int] | None:
    """A restarted job's (``SLURM_RESTART_COUNT``, ``TORCHELASTIC_RESTART_COUNT`` 1 or more) newest run of this
    command, when it has a loadable checkpoint: that file and its global step (after a node failure's requeue, with no
    ``hpc_ckpt``, too)."""
    torchrun = "TORCHELASTIC_RUN_ID" in os.environ
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT" if torchrun else "SLURM_RESTART_COUNT") or 0)
    if restarts < 1 or not (runs := jobs_runs(family, command)):
        return None
    found = find_last_checkpoint(runs[0], IN_A_RUN)
    if found is not None:
        how = "torchrun restarted the workers" if torchrun else f"SLURM job {os.environ['SLURM_JOB_ID']} requeued"
        rank_zero_info(f"{how} (restart {restarts}): resuming the run from {found[0]} (global step {found[1]})")
    return found


def check_save_dir(family: Path) -> None:
    """Raises ``ValueError`` before anything runs if the runs folder cannot become a writable folder.

    Otherwise a run would fail once started, in a traceback from deep inside a logger or checkpoint writer.
    """
    existing = family
    while not existing.exists() and existing != existing.parent:  # the part of the path that is there
        existing = existing.parent
    flag = "--run.root"
    if not existing.is_dir():
        raise ValueError(f"{flag} {family.parent}: {existing} is a file, not a folder. Choose another {flag}.")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {family.parent}: the folder {existing} is not writable. Choose another {flag}.")


def plan_run(
    config: Namespace,
    subcommand: str,
    fixed: dict[str, str] | None = None,
    command: list[str] | None = None,
    family: Path | None = None,
) -> RunPlan:
    """Resolves ``ckpt_path`` (``last``: the newest loadable checkpoint) and picks the run folder (``fixed``: as
    ``family_dir`` reads it; ``command``: the arguments the command was given, which a SLURM job's requeue gives
    again; ``family``: the folder of the runs, where a logger's link applied at instantiation decided it).

    Only ``fit`` continues a run's folder: ``validate``/``test``/``predict`` of a checkpoint get a folder of their
    own, so they never add points to the training curves.
    """
    plan = _plan_run(config, subcommand, family or family_dir(config, fixed), command or [])
    plan.job = launcher_job(command or [])
    return plan


def _plan_run(config: Namespace, subcommand: str, family: Path, command: list[str]) -> RunPlan:
    check_save_dir(family)
    if isinstance(config.get("run"), Namespace):  # the run's config.yaml names its family's root, however given
        config["run"]["root"] = str(family.parent)
    ckpt_path = config.get("ckpt_path")
    requeued = requeued_jobs_checkpoint(family, command) if ckpt_path is None and subcommand == "fit" else None
    if requeued is not None:
        path, global_step = requeued
        config["ckpt_path"] = str(path)
        continues = True
    elif ckpt_path is None or ckpt_path == "registry":
        return new_version(family)
    elif ckpt_path == "best" or (Path(ckpt_path).is_dir() and not is_checkpoint_folder(Path(ckpt_path))):
        path = find_best_checkpoint(ckpt_path, family)
        config["ckpt_path"] = str(path)
        # a new version even for fit: starting from a run's best is a branch, the run itself is never written into
        return new_version(family, resumed_from=path, global_step=read_global_step(path))
    elif ckpt_path in ("last", "hpc"):  # hpc: Lightning's SLURM checkpoint, the newest of any run here
        # a job's hpc is its own run's, as Lightning's is the one in its own default_root_dir
        own = jobs_runs(family, command) if ckpt_path == "hpc" else []
        found = next(filter(None, (find_last_checkpoint(run, IN_A_RUN[1:]) for run in own)), None)
        found = found or find_last_checkpoint(family, RUN_CHECKPOINTS if ckpt_path == "last" else RUN_CHECKPOINTS[1:])
        # evaluating random weights is never what was asked for, nor (Lightning says so too) a fresh fit for hpc
        if found is None and (subcommand != "fit" or ckpt_path == "hpc"):
            what = "checkpoint" if ckpt_path == "last" else "hpc_ckpt_N.ckpt (SIGUSR1's under SLURM)"
            raise ResumeError(
                f"--ckpt_path {ckpt_path}: no {what} under {family}/*/ to {subcommand}. Train one first "
                f"({entry().command} fit), or give a .ckpt file."
            )
        if found is None:
            rank_zero_info(f"--ckpt_path last: no checkpoint under {family}/*/; starting from scratch.")
            config["ckpt_path"] = None
            return new_version(family)
        path, global_step = found
        if subcommand == "fit":  # an evaluation's start line names the checkpoint (lightkeep.guarantees)
            rank_zero_info(f"--ckpt_path {ckpt_path}: resuming from {path} (global step {global_step})")
        config["ckpt_path"] = str(path)
        continues = True
    else:
        path = Path(ckpt_path)
        if not (path.is_file() or is_checkpoint_folder(path)):
            raise ResumeError(
                f"--ckpt_path {ckpt_path}: no such file or run folder. Give an existing .ckpt, a run folder "
                f"({family}/version_N), 'best' or 'last'."
            )
        try:
            global_step = read_global_step(path)
        except ResumeError as error:
            good = next((p for p in checkpoints_newest_first(path.parent, "*.ckpt") if is_loadable(p)), None)
            hint = f" The newest other checkpoint beside it is {good}." if good else ""
            raise ResumeError(f"{error}.{hint} Resume from another file, or from 'last'.") from None
        continues = path.name.startswith(("last", "hpc_ckpt_"))
    run_dir = run_of(path)
    if subcommand == "fit" and continues and run_dir.parent == family.resolve() and run_dir.name[8:].isdigit():
        record_file = run_dir / RUN_RECORD
        record = json.loads(record_file.read_text()) if record_file.is_file() else {}
        log_step = read_positions(path)[1]  # the loggers count batches, not optimizer steps
        return RunPlan(family / run_dir.name, True, path, global_step, record, log_step)
    return new_version(family, resumed_from=path, global_step=global_step)
