"""Every logger the engine knows (TensorBoard, CSV, MLflow, W&B) pointed at the run folder ``lightkeep.runs``
planned, continuing the same run on a resume: the CSV rows before the checkpoint's step kept, the MLflow and W&B
ids kept in ``run.json``.
"""

import csv
import importlib.util
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from jsonargparse import Namespace

from lightkeep.compat_logging import set_csv_columns
from lightkeep.loggers import class_named
from lightkeep.runs import RUN_RECORD, RunPlan


def default_logger() -> dict[str, Any]:
    """The run's logger when its config names none, as Lightning chooses it: TensorBoard (the engine's throttled
    one) where tensorboard is installed, else a CSV file; its folder set by ``point_loggers_at``."""
    if importlib.util.find_spec("tensorboard") is None:  # an optional extra: a project may log elsewhere
        return {"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {"save_dir": "runs"}}
    return {"class_path": "lightkeep.ThrottledTensorBoardLogger",
            "init_args": {"save_dir": "runs", "default_hp_metric": False}}  # fmt: skip


def point_loggers_at(plan: RunPlan, trainer_config: Namespace) -> list[str]:
    """Sets each known logger's arguments so that it writes into (or continues) the planned run; returns the class
    names of loggers it does not know, which Lightning places as they say."""
    from lightning.pytorch.loggers import CSVLogger, MLFlowLogger, TensorBoardLogger, WandbLogger

    trainer_config["default_root_dir"] = str(plan.dir)  # Lightning's folder when there is no logger
    if trainer_config.get("logger") in (None, True):  # Lightning's own default, TensorBoard: the engine's throttled one
        default = default_logger()
        trainer_config["logger"] = Namespace(
            class_path=default["class_path"], init_args=Namespace(**default["init_args"])
        )
    family, unknown = plan.dir.parent, []
    loggers = trainer_config.get("logger")
    for item in loggers if isinstance(loggers, list) else [loggers]:
        cls = class_named(item.class_path) if isinstance(item, Namespace) and item.get("class_path") else None
        if cls is None:
            continue
        args = item.init_args
        if issubclass(cls, (TensorBoardLogger, CSVLogger)):
            for key, value in folder_args(plan, cls).items():
                args[key] = value
        elif issubclass(cls, MLFlowLogger):
            if args.get("experiment_name") in (None, "lightning_logs"):
                args["experiment_name"] = family.name
            args["run_name"] = f"{family.name}/{plan.dir.name}"
            args["run_id"] = plan.record.get("mlflow_run_id") if plan.continues else None
        elif issubclass(cls, WandbLogger):
            args["save_dir"] = str(plan.dir)
            args["project"] = args.get("project") or family.name
            args["name"] = f"{family.name}/{plan.dir.name}"
            args["id"] = args["version"] = plan.record.get("wandb_id") if plan.continues else None
        else:
            unknown.append(cls.__name__)
    return unknown


def folder_args(plan: RunPlan, cls: type) -> dict[str, Any]:
    """The arguments that put a TensorBoard or CSV logger (``cls``) in the planned run's folder."""
    from lightning.pytorch.loggers import TensorBoardLogger

    family = plan.dir.parent
    args: dict[str, Any] = {"save_dir": str(family.parent), "name": family.name, "version": plan.version}
    if issubclass(cls, TensorBoardLogger):
        # steps >= this one were logged by the interrupted run; TensorBoard drops them from the file
        args["purge_step"] = plan.log_step if plan.continues else None
    return args


class LoggerFolder:
    """Builds the TensorBoard and CSV loggers (a jsonargparse instantiator, ``CLI.instantiate_classes``). A link
    applied at instantiation (``apply_on="instantiate"``) gives a logger its ``save_dir`` or ``name`` after the run
    was planned: ``follow`` then plans the run in that folder, and the logger gets the run's version, so that the
    run's folder and the logger's are one."""

    def __init__(self, follow: Callable[[Path], RunPlan]) -> None:
        self.follow = follow

    def __call__(self, cls: type, *args: Any, **kwargs: Any) -> Any:
        save_dir, name = kwargs.get("save_dir"), kwargs.get("name")
        if save_dir is not None:
            plan = self.follow(Path(save_dir) / (name or ""))
            kwargs.update(folder_args(plan, cls))
        return cls(*args, **kwargs)


def keep_csv_history(plan: RunPlan, loggers: list[Any]) -> None:
    """A continued run's CSV file keeps every row before the checkpoint's step and none after it.

    Lightning's CSV writer deletes ``metrics.csv`` of a folder that is not empty when it starts; called on rank 0
    before the Trainer starts the writer, this starts it here and puts the rows back.
    """
    from lightning.pytorch.loggers import CSVLogger

    for logger in loggers:
        if not (plan.continues and isinstance(logger, CSVLogger)):
            continue
        path = Path(logger.log_dir) / "metrics.csv"
        rows: list[dict[str, str]] = []
        if path.is_file():
            with open(path, newline="") as f:
                rows = [r for r in csv.DictReader(f) if r.get("step", "") == "" or int(r["step"]) < plan.log_step]
        writer = logger.experiment  # the writer starts and removes the file
        if rows:
            with open(path, "w", newline="") as f:
                rows_writer = csv.DictWriter(f, fieldnames=list(rows[0]))
                rows_writer.writeheader()
                rows_writer.writerows(rows)
            # the columns already in the file; without them its first write drops the ones it has not seen yet
            set_csv_columns(writer, list(rows[0]))


def write_record(run_dir: Path, loggers: list[Any], job: dict[str, Any]) -> None:
    """``run.json``: the ids a resume needs to continue the same MLflow/W&B run, and the SLURM ``job``'s, whose requeue
    continues the run (``runs.jobs_runs``); replaced atomically, on the disk before it is renamed (a requeue follows
    a node's failure)."""
    from lightning.pytorch.loggers import MLFlowLogger, WandbLogger

    record: dict[str, Any] = dict(job)
    for logger in loggers:
        if isinstance(logger, MLFlowLogger) and logger.run_id:
            record["mlflow_run_id"] = logger.run_id
        elif isinstance(logger, WandbLogger):
            record["wandb_id"] = logger.experiment.id
    run_dir.mkdir(parents=True, exist_ok=True)
    tmp = run_dir / f"{RUN_RECORD}.tmp"
    with tmp.open("w") as f:
        f.write(json.dumps(record, indent=2) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, run_dir / RUN_RECORD)
