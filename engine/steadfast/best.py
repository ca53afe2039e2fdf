"""The best checkpoint of a run, read from the checkpoint files themselves (``--ckpt_path best`` or a run folder).

Lightning adds a top-k file to its ``ModelCheckpoint``'s ``best_k_models`` (path -> score) before saving it, so each
such file lists itself, with its own score, in the callback state it carries. The best of a run is the file on disk
that ranks first by its own record. Hence:

- a file deleted by ``save_top_k`` rotation is not on disk, so it is never picked (the record in a newer file may
  still name it);
- a run continued by ``fit --ckpt_path last`` finds the files of every segment, also when the resumed callback
  started a fresh record (Lightning drops ``best_k_models`` when the checkpoint folder's path changed);
- a run folder that was moved or copied still works: files are matched by name, not by the path they were saved at.
"""

from dataclasses import dataclass
from pathlib import Path

from steadfast.checkpoint_files import CheckpointLoadError, load_checkpoint_file
from steadfast.compat import state_key_arguments
from steadfast.resume import ExactResume
from steadfast.sharded import is_sharded_checkpoint, read_meta


@dataclass(frozen=True)
class Scored:
    """A top-k checkpoint and the score its ``ModelCheckpoint`` saved it with."""

    path: Path
    monitor: str
    mode: str  # "min" or "max"
    score: float
    mtime: float


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
            if judge is not None and judge.get("state_key") == key:
                mode = judge["mode"]
            else:
                mode = state_key_arguments(key).get("mode", "min")
            return Scored(path, state["monitor"], mode, float(scores[path.name]), path.stat().st_mtime)
    return None


def _complete(path: Path) -> bool:
    return path.is_file() or is_sharded_checkpoint(path)


def best_checkpoint(run_dir: Path) -> tuple[Scored, int] | None:
    """The best top-k checkpoint in ``run_dir/checkpoints`` and how many were ranked; ``None`` if none was saved by
    a ``ModelCheckpoint`` with a ``monitor``.

    Files are ranked by the monitor (and mode) of the newest of them, should a resumed run have changed it; on a
    tie the older file wins, as in Lightning's own choice.
    """
    scored = [s for p in (run_dir / "checkpoints").glob("*.ckpt") if _complete(p) and (s := scored_checkpoint(p))]
    if not scored:
        return None
    scored.sort(key=lambda s: s.mtime)
    newest = scored[-1]
    ranked = [s for s in scored if (s.monitor, s.mode) == (newest.monitor, newest.mode)]
    pick = max if newest.mode == "max" else min
    return pick(ranked, key=lambda s: s.score), len(ranked)
