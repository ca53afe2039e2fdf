"""Checkpoint writing that a kill at any moment cannot corrupt."""

import os
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.plugins.io import TorchCheckpointIO


class AtomicCheckpointIO(TorchCheckpointIO):
    """Writes ``<name>.tmp`` beside the target, fsyncs it and renames it over the target.

    A rename within one directory is atomic on POSIX filesystems, so ``last.ckpt`` is always either the previous
    complete file or the new complete one. (Lightning's own save goes through a temporary file in the system temp
    folder, which is a copy, not a rename, when that folder is on another filesystem.) Local paths only; remote
    URLs fall back to Lightning's writer.
    """

    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None) -> None:
        if "://" in str(path):
            return super().save_checkpoint(checkpoint, path, storage_options)
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.tmp")
        try:
            with open(tmp, "wb") as f:
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
