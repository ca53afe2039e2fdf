"""Where runs live: ``<save_dir>/<name>/version_N/`` holds a run's events, ``config.yaml`` and ``checkpoints/``.

Lightning gives every invocation a new ``version_N`` and looks for ``--ckpt_path last`` only inside it, so a
plain resume finds nothing and silently trains from scratch. Here ``last`` means the newest ``last.ckpt`` of any
version, and ``fit`` from a run's ``last*.ckpt`` continues in that run's folder, so its curves go on. Resuming
from any other checkpoint branches into a new version, which never overwrites the files of the run it came from.
"""

from pathlib import Path

from jsonargparse import Namespace
from lightning.pytorch.utilities import rank_zero_info


def _tensorboard_init_args(trainer_config: Namespace) -> Namespace | None:
    logger = trainer_config.get("logger")
    if isinstance(logger, list):
        logger = logger[0] if len(logger) == 1 else None
    if not isinstance(logger, Namespace) or not str(logger.get("class_path")).endswith("TensorBoardLogger"):
        return None
    return logger.init_args


def find_last_checkpoint(runs_dir: Path) -> Path | None:
    """The most recently written ``last*.ckpt`` under ``runs_dir/*/checkpoints/``."""
    candidates = [p for p in runs_dir.glob("*/checkpoints/last*.ckpt") if p.is_file()]
    return max(candidates, key=lambda p: p.stat().st_mtime) if candidates else None


def resolve_resume(config: Namespace, continue_run: bool) -> None:
    """Rewrites ``ckpt_path`` (and, when ``continue_run``, the logger's ``version``) of a subcommand's config.

    Only ``fit`` continues a run's folder: ``validate``/``test``/``predict`` of a checkpoint log into a folder
    of their own, so they never add points to the training curves.
    """
    ckpt_path = config.get("ckpt_path")
    logger_args = _tensorboard_init_args(config["trainer"])
    if ckpt_path is None or logger_args is None:
        return
    runs_dir = Path(logger_args["save_dir"]) / (logger_args.get("name") or "lightning_logs")
    if ckpt_path == "last":
        found = find_last_checkpoint(runs_dir)
        if found is None:
            rank_zero_info(f"--ckpt_path last: no last*.ckpt under {runs_dir}/*/checkpoints/; starting from scratch.")
            config["ckpt_path"] = None
            return
        rank_zero_info(f"--ckpt_path last: resuming from {found}")
        config["ckpt_path"] = ckpt_path = str(found)
    path = Path(ckpt_path).resolve()
    run_dir = path.parent.parent
    if continue_run and path.name.startswith("last") and path.parent.name == "checkpoints":
        if run_dir.parent == runs_dir.resolve():
            logger_args["version"] = run_dir.name
