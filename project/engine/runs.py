"""Where runs live: ``<save_dir>/<name>/version_N/`` holds a run's events, ``config.yaml`` and ``checkpoints/``.

Lightning gives every invocation a new ``version_N`` and looks for ``--ckpt_path last`` only inside it, so a
plain resume finds nothing and silently trains from scratch. Here ``last`` means the newest loadable checkpoint
of any version, and ``fit`` from it (or from a run's ``last*.ckpt``) continues in that run's folder, so its
curves go on; TensorBoard drops what the interrupted run logged after the checkpoint (``purge_step``). ``fit``
from any other checkpoint branches into a new version, which never overwrites the files of the run it came from.
"""

import os
from pathlib import Path

from jsonargparse import Namespace
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from project.engine.checkpoints import CheckpointLoadError, load_checkpoint_file


class ResumeError(ValueError):
    """A ``--ckpt_path`` that cannot be resumed from; the message names the file and what to do."""


def _tensorboard_init_args(trainer_config: Namespace) -> Namespace | None:
    logger = trainer_config.get("logger")
    if isinstance(logger, list):
        logger = logger[0] if len(logger) == 1 else None
    if not isinstance(logger, Namespace) or not str(logger.get("class_path")).endswith("TensorBoardLogger"):
        return None
    return logger.init_args


def read_global_step(path: Path) -> int:
    """Opens a checkpoint without unpickling code or reading its tensors; raises ``ResumeError`` if unreadable."""
    try:
        return int(load_checkpoint_file(path, mmap=True)["global_step"])
    except CheckpointLoadError as error:
        raise ResumeError(str(error)) from None
    except (KeyError, TypeError, ValueError) as error:
        raise ResumeError(f"{path} is not a training checkpoint: no global step ({error})") from None


def _loads(path: Path) -> bool:
    try:
        read_global_step(path)
    except ResumeError:
        return False
    return True


def _checkpoints_newest_first(folder: Path, pattern: str = "*/checkpoints/*.ckpt") -> list[Path]:
    files = [p for p in folder.glob(pattern) if p.is_file()]
    return sorted(files, key=lambda p: p.stat().st_mtime, reverse=True)


def find_last_checkpoint(runs_dir: Path) -> tuple[Path, int] | None:
    """The most recently written checkpoint under ``runs_dir/*/checkpoints/`` that loads, and its global step."""
    for path in _checkpoints_newest_first(runs_dir):
        try:
            return path, read_global_step(path)
        except ResumeError as error:
            rank_zero_warn(f"Skipping {error}")
    return None


def check_save_dir(config: Namespace) -> None:
    """Raises ``ValueError`` before anything runs if the logger's ``save_dir`` cannot become a writable folder.

    Otherwise a run would fail once started, in a traceback from deep inside the logger.
    """
    logger_args = _tensorboard_init_args(config["trainer"])
    if logger_args is None:
        return
    save_dir = Path(logger_args["save_dir"])
    existing = save_dir
    while not existing.exists() and existing != existing.parent:  # the part of the path that is there
        existing = existing.parent
    flag = "--trainer.logger.init_args.save_dir"
    if not existing.is_dir():
        raise ValueError(f"{flag} {save_dir}: {existing} is a file, not a folder. Choose another {flag}.")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {save_dir}: the folder {existing} is not writable. Choose another {flag}.")


def resolve_resume(config: Namespace, continue_run: bool) -> None:
    """Rewrites ``ckpt_path`` (and, when ``continue_run``, the logger's ``version``) of a subcommand's config.

    Only ``fit`` continues a run's folder: ``validate``/``test``/``predict`` of a checkpoint log into a folder
    of their own, so they never add points to the training curves.
    """
    ckpt_path = config.get("ckpt_path")
    if ckpt_path is None or ckpt_path in ("best", "hpc", "registry"):
        return
    logger_args = _tensorboard_init_args(config["trainer"])
    runs_dir = Path(logger_args["save_dir"]) / (logger_args.get("name") or "lightning_logs") if logger_args else None
    if ckpt_path == "last":
        found = find_last_checkpoint(runs_dir) if runs_dir is not None else None
        if found is None:
            rank_zero_info(f"--ckpt_path last: no checkpoint under {runs_dir}/*/checkpoints/; starting from scratch.")
            config["ckpt_path"] = None
            return
        path, global_step = found
        rank_zero_info(f"--ckpt_path last: resuming from {path} (global step {global_step})")
        config["ckpt_path"] = str(path)
        continues = True
    else:
        path = Path(ckpt_path)
        if not path.is_file():
            raise ResumeError(f"--ckpt_path {ckpt_path}: no such file. Give an existing .ckpt, or 'last'.")
        try:
            global_step = read_global_step(path)
        except ResumeError as error:
            good = next((p for p in _checkpoints_newest_first(path.parent, "*.ckpt") if _loads(p)), None)
            hint = f" The newest other checkpoint beside it is {good}." if good else ""
            raise ResumeError(f"{error}.{hint} Resume from another file, or from 'last'.") from None
        continues = path.name.startswith("last")
    run_dir = path.resolve().parent.parent
    if continue_run and continues and runs_dir is not None and run_dir.parent == runs_dir.resolve():
        logger_args["version"] = run_dir.name
        logger_args["purge_step"] = global_step  # steps >= this one were logged by the interrupted run
