"""Checkpoint files read so that a file from anywhere cannot run code, and checked against the model before a run
starts and writes anything."""

import os
import pickle
import re
import zipfile
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import nn

from lightkeep.compat_torch import uncompiled_key
from lightkeep.console import first_line

FilePath = str | os.PathLike  # a path; Lightning's own alias, `_PATH`, is private


class CheckpointLoadError(ValueError):
    """A file that cannot be loaded as a checkpoint (or not into this model); the message names it and the fix."""


def load_checkpoint_file(path: FilePath, mmap: bool = False, map_location: Any = "cpu") -> dict[str, Any]:
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
        raise CheckpointLoadError(f"{path} is not a readable checkpoint ({first_line(error)})") from None
    if not isinstance(checkpoint, dict) or "state_dict" not in checkpoint:
        raise CheckpointLoadError(
            f"{path} is not a Lightning checkpoint: it holds a {type(checkpoint).__name__} without a 'state_dict'"
        )
    return checkpoint


def check_fits(path: FilePath, module: nn.Module) -> None:
    """Raises ``CheckpointLoadError`` listing each parameter whose shape differs (and, when the module loads
    strictly, each one missing on either side), before a run starts and writes anything.

    Lightning finds the same only after the run folder and its config exist, in a traceback of torch's list.
    """
    # keys as uncompiled: a module may compile a layer in configure_model, which this check does not run
    saved = {uncompiled_key(k): v for k, v in load_checkpoint_file(path, mmap=True)["state_dict"].items()}
    full = {uncompiled_key(k): v for k, v in module.state_dict().items()}
    here = {k: v.shape for k, v in full.items() if isinstance(v, torch.Tensor) and not nn.parameter.is_lazy(v)}
    missing, only = [], []
    if getattr(module, "strict_loading", True):
        missing = sorted(full.keys() - saved.keys())
        if not is_overridden("configure_model", module):  # else those layers may be built there, later
            only = sorted(saved.keys() - full.keys())
    run_config = Path(path).parent.parent / "config.yaml"  # <run>/checkpoints/<file>.ckpt
    fix = f"add --config {run_config}" if run_config.is_file() else "give the --model arguments of its run"
    check_shapes(path, {k: v.shape for k, v in saved.items() if isinstance(v, torch.Tensor)}, here, missing, only, fix)


def check_shapes(path: FilePath, saved: dict, here: dict, missing: list[str], only: list[str], fix: str) -> None:
    """Raises ``CheckpointLoadError`` naming each weight whose shape differs (``saved``, ``here``: key -> shape),
    each ``missing`` from the checkpoint and each in it ``only``; ``fix``: how to build the checkpoint's network."""
    problems = [f"{k} is {list(saved[k])} in the checkpoint, {list(v)} here" for k, v in here.items()
                if k in saved and saved[k] != v]  # fmt: skip
    problems += [f"{k} is missing from the checkpoint" for k in missing]
    problems += [f"{k} is in the checkpoint only" for k in only]
    if problems:
        shown = "; ".join(problems[:10]) + (f"; and {len(problems) - 10} more" if len(problems) > 10 else "")
        raise CheckpointLoadError(
            f"{path} holds a different network from the one configured: {shown}. "
            f"Build the network the checkpoint was saved from: {fix}"
        )
