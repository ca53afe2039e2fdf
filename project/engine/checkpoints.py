"""Checkpoint files: written so that a kill or a full disk at any moment cannot corrupt them, read so that a file
from anywhere cannot run code."""

import os
import pickle
import re
import zipfile
from pathlib import Path
from typing import Any, BinaryIO

import torch
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import nn


class CheckpointLoadError(ValueError):
    """A file that cannot be loaded as a checkpoint (or not into this model); the message names it and the fix."""


def load_checkpoint_file(path: _PATH, mmap: bool = False, map_location: Any = "cpu") -> dict[str, Any]:
    """``torch.load`` with ``weights_only=True``: tensors, numbers, strings and containers only, never code.

    A pickle can name any function to call while it is loaded (``os.system``, ...); ``weights_only`` refuses
    every name outside torch's allow-list. The template's own checkpoints hold nothing else. ``mmap`` reads the
    structure now and the tensors' bytes only when they are used.
    """
    if not zipfile.is_zipfile(path):  # what torch.save writes since 1.6; mmap would fail with a puzzling message
        kind = (
            "an empty file" if os.path.getsize(path) == 0 else "not a zip archive (cut short, or another kind of file)"
        )
        raise CheckpointLoadError(f"{path} is not a readable checkpoint: it is {kind}")
    try:
        checkpoint = torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as error:
        found = re.search(r"Unsupported global: GLOBAL (\S+)", str(error))
        what = f"a Python object ({found[1]})" if found else "a Python object"
        raise CheckpointLoadError(
            f"{path} holds {what} besides tensors and plain data, and loading it could run code, so it was not "
            "loaded. Use checkpoints you trust only; if you trust this one and the object is your own class, allow "
            "it with torch.serialization.add_safe_globals([YourClass]) before the run"
        ) from None
    except Exception as error:  # a damaged archive: torch raises RuntimeError, EOFError, ... depending on where
        first_line = str(error).splitlines()[0] if str(error) else ""
        raise CheckpointLoadError(
            f"{path} is not a readable checkpoint ({type(error).__name__}: {first_line})"
        ) from None
    if not isinstance(checkpoint, dict) or "state_dict" not in checkpoint:
        raise CheckpointLoadError(
            f"{path} is not a Lightning checkpoint: it holds a {type(checkpoint).__name__} without a 'state_dict'"
        )
    return checkpoint


def check_fits(path: _PATH, module: nn.Module) -> None:
    """Raises ``CheckpointLoadError`` listing each parameter whose shape differs (and, when the module loads
    strictly, each one missing on either side), before a run starts and writes anything.

    Lightning finds the same only after the run folder and its config exist, in a traceback of torch's list.
    """
    saved = load_checkpoint_file(path, mmap=True)["state_dict"]
    full = module.state_dict()
    here = {k: v for k, v in full.items() if isinstance(v, torch.Tensor) and not nn.parameter.is_lazy(v)}
    problems = [
        f"{key} is {list(saved[key].shape)} in the checkpoint, {list(value.shape)} here"
        for key, value in here.items()
        if isinstance(saved.get(key), torch.Tensor) and saved[key].shape != value.shape
    ]
    if getattr(module, "strict_loading", True):
        missing, unexpected = sorted(full.keys() - saved.keys()), sorted(saved.keys() - full.keys())
        problems += [f"{key} is missing from the checkpoint" for key in missing]
        if not is_overridden("configure_model", module):  # else those layers may be built there, later
            problems += [f"{key} is in the checkpoint only" for key in unexpected]
    if not problems:
        return
    shown = "; ".join(problems[:10]) + (f"; and {len(problems) - 10} more" if len(problems) > 10 else "")
    run_config = Path(path).parent.parent / "config.yaml"  # <run>/checkpoints/<file>.ckpt
    fix = f"add --config {run_config}" if run_config.is_file() else "give the --model arguments of its run"
    raise CheckpointLoadError(
        f"{path} holds a different network from the one configured: {shown}. "
        f"Build the network the checkpoint was saved from: {fix}"
    )


class AtomicCheckpointIO(TorchCheckpointIO):
    """Writes ``<name>.tmp`` beside the target, fsyncs it and renames it over the target.

    A rename within one directory is atomic on POSIX filesystems, so ``last.ckpt`` is always either the previous
    complete file or the new complete one. (Lightning's own save goes through a temporary file in the system temp
    folder, which is a copy, not a rename, when that folder is on another filesystem.) A failed write (a full
    disk, a lost mount) removes the ``.tmp`` and raises an ``OSError`` that names the folder and what to do.
    Local paths only; remote URLs fall back to Lightning's writer.

    Loading always uses ``weights_only=True`` (see ``load_checkpoint_file``), whatever ``--weights_only`` says.
    """

    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None) -> None:
        if "://" in str(path):
            return super().save_checkpoint(checkpoint, path, storage_options)
        path = Path(path)
        tmp = path.with_name(f"{path.name}.tmp")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") as f:
                self._write(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except OSError as error:
            tmp.unlink(missing_ok=True)
            raise OSError(
                error.errno,
                f"could not save the checkpoint {path.name} in {path.parent} ({error.strerror or error}); the "
                "checkpoints already there are intact. Free space there (or make it writable), then resume with "
                "--ckpt_path last",
            ) from error
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    def _write(self, checkpoint: dict[str, Any], f: BinaryIO) -> None:  # tests.faults.DiskFullOnSave cuts it short
        torch.save(checkpoint, f)

    def load_checkpoint(self, path: _PATH, map_location: Any = "cpu", weights_only: bool | None = None) -> dict:
        if "://" in str(path):
            return super().load_checkpoint(path, map_location, weights_only=True)
        if not Path(path).is_file():
            raise FileNotFoundError(f"Checkpoint file not found: {path}")
        return load_checkpoint_file(path, map_location=map_location)
