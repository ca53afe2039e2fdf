"""A run's checkpoints found by name (``--ckpt_path last``, ``best``, a run folder, ``lightkeep.runs``), and
a checkpoint's global step read without unpickling code or reading its tensors.
"""

import os
from pathlib import Path

from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities import rank_zero_info

from lightkeep.checkpoint_files import CheckpointLoadError, load_checkpoint_file
from lightkeep.config import entry
from lightkeep.judge import best_checkpoint
from lightkeep.last_checkpoint import OWN_LAST
from lightkeep.sharded.folders import is_sharded_checkpoint, read_meta


class ResumeError(ValueError):
    """A ``--ckpt_path`` that cannot be resumed from; the message names the file and what to do."""


# The first logging step a resumed run writes, saved by lightkeep.run_folder.RunFolder (absent from the
# checkpoints of other programs and older versions: then the global step, which it equals with one optimizer)
NEXT_LOGGING_STEP = "next_logging_step"
EVALUATION_LOGGING_STEPS = "evaluation_logging_steps"  # lightkeep.run_folder


def read_positions(path: Path) -> tuple[int, int]:
    """``(global step, next logging step)`` of a checkpoint (a file, or a sharded folder's ``meta.pt``), opened
    without unpickling code or reading its tensors; raises ``ResumeError`` if unreadable."""
    try:
        checkpoint = read_meta(path) if path.is_dir() else load_checkpoint_file(path, mmap=True)
        step = int(checkpoint["global_step"])
        return step, int(checkpoint.get(NEXT_LOGGING_STEP, step))
    except CheckpointLoadError as error:
        raise ResumeError(str(error)) from None
    except (KeyError, TypeError, ValueError) as error:
        raise ResumeError(f"{path} is not a training checkpoint: no global step ({error})") from None


def read_global_step(path: Path) -> int:
    return read_positions(path)[0]


def is_loadable(path: Path) -> bool:
    try:
        read_global_step(path)
    except ResumeError:
        return False
    return True


def checkpoints_newest_first(folder: Path, *patterns: str) -> list[Path]:
    files = [p for pattern in patterns for p in folder.glob(pattern) if p.is_file() or is_sharded_checkpoint(p)]
    # the names of one file (hard links: a validation's files and last.ckpt) share its time: last.ckpt first of
    # them, the name whose resume continues its run (the engine's own first, where a user's best is named last)
    last = ModelCheckpoint.CHECKPOINT_NAME_LAST
    return sorted(files, key=lambda p: (p.stat().st_mtime, p.name.startswith(last), p.stem == OWN_LAST), reverse=True)


# Where a run's checkpoints are: ModelCheckpoint's folder, and the run folder itself for Lightning's SLURM
# checkpoint (hpc_ckpt_N.ckpt, written into default_root_dir when SIGUSR1 announces the time limit).
IN_A_RUN = ("checkpoints/*.ckpt", "hpc_ckpt_*.ckpt")
RUN_CHECKPOINTS = tuple(f"*/{pattern}" for pattern in IN_A_RUN)


def run_of(checkpoint: Path) -> Path:
    parent = checkpoint.resolve().parent
    return parent.parent if parent.name == "checkpoints" else parent


def find_last_checkpoint(family: Path, patterns: tuple[str, ...] = RUN_CHECKPOINTS) -> tuple[Path, int] | None:
    """The most recently written checkpoint of any run under ``family`` that loads (of one run folder with
    ``IN_A_RUN``), and its global step.

    Rank 0 says in one line each file it passes over and why (a printed line, not a warning, which
    ``PYTHONWARNINGS=ignore`` would hide): a link to nothing, a file that does not load; the caller names the one
    taken."""
    for link in (p for pattern in patterns for p in family.glob(pattern) if p.is_symlink() and not p.exists()):
        rank_zero_info(f"Skipping a link to nothing: {link} -> {os.readlink(link)}")
    for path in checkpoints_newest_first(family, *patterns):
        try:
            return path, read_global_step(path)
        except ResumeError as error:
            rank_zero_info(f"Skipping a checkpoint that does not load: {error}")
    return None


def find_best_checkpoint(name: str, family: Path) -> Path:
    """``best``: the best checkpoint of the newest run (the run ``last`` would pick); a run folder: that run's best
    (``lightkeep.judge``). A run with no checkpoint saved by a monitoring ``ModelCheckpoint`` gives its newest
    loadable one instead. Rank 0 prints which file and why; ``ResumeError`` when there is no checkpoint to give."""
    flag = f"--ckpt_path {name}"
    if name == "best":
        found = find_last_checkpoint(family)
        if found is None:
            raise ResumeError(
                f"{flag}: no checkpoint under {family}/*/. Train one first ({entry().command} fit), or give a .ckpt "
                "file or a run folder."
            )
        folder = found[0].parent
        run_dir = folder.parent if folder.name == "checkpoints" else folder  # as run_of, but as the user wrote it
    else:
        run_dir = Path(name)
    best = best_checkpoint(run_dir)
    if best is not None:
        scored, ranked = best
        rank_zero_info(
            f"{flag}: {scored.path} (best {scored.monitor} {scored.score:.4f}, mode {scored.mode}, of the {ranked} "
            f"top-k checkpoint(s) of {run_dir})"
        )
        return scored.path
    newest = next((p for p in checkpoints_newest_first(run_dir, *IN_A_RUN) if is_loadable(p)), None)
    if newest is None:
        raise ResumeError(
            f"{flag}: {run_dir} holds no loadable checkpoint (in checkpoints/). Give a run folder "
            f"({family}/version_N) that has one, 'best' or 'last'."
        )
    rank_zero_info(f"{flag}: {newest} (no ModelCheckpoint with a monitor saved a checkpoint in {run_dir}: its last)")
    return newest
