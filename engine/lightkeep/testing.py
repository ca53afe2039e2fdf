"""Helpers for a project's own tests (and the engine's): run the real command line in a subprocess, as a user does,
and read what the run wrote. ``from lightkeep.testing import run_cli, QUIET``."""

import os
import subprocess
import sys
from pathlib import Path

# Small, quiet runs: the real Trainer and CLI, just no progress bar or model summary in the output.
QUIET = ["--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false"]
DDP2 = ["--trainer.accelerator", "cpu", "--trainer.devices", "2", "--trainer.strategy", "ddp"]


def run_cli(program: str, *args: str, cwd: Path, pythonpath: str | None = None, timeout: float = 300,
            check: bool = True, env: dict | None = None) -> subprocess.CompletedProcess:  # fmt: skip
    """``python -m PROGRAM ARGS`` (``python PROGRAM ARGS`` for a script, ``main.py``) in ``cwd`` (runs/ lands there),
    ``pythonpath`` first on its path (then this process's PYTHONPATH); ``check``: an ``AssertionError`` with its
    output's tail if it exits non-zero."""
    joined = os.pathsep.join(p for p in (pythonpath, os.environ.get("PYTHONPATH")) if p)
    path = {"PYTHONPATH": joined} if joined else {}
    full_env = {**os.environ, **path, "PYTHONWARNINGS": "ignore", **(env or {})}
    from lightkeep.config import Entry  # how a program name is run, as the engine's printed commands say

    proc = subprocess.run([sys.executable, *Entry(program).launch, *args], cwd=cwd, env=full_env, capture_output=True,
                          text=True, timeout=timeout)  # fmt: skip
    if check and proc.returncode != 0:
        raise AssertionError(f"CLI {args} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc


def scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar TensorBoard shows for ``run_dir``, as ``{tag: [(step, value), ...]}``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def run_dirs(cwd: Path, name: str) -> list[Path]:
    """The run folders ``cwd/runs/NAME/version_N``, oldest first."""
    return sorted((cwd / "runs" / name).glob("version_*"), key=lambda p: int(p.name.split("_")[-1]))


def load_exported(path: Path):
    """An exported file (``scripts/export.py``: .safetensors, .onnx, .pt2, .pth) as a function called as ``forward``
    is (positional and keyword tensors), to compare with the module's own ``forward`` (``lightning_model``)."""
    import json

    import torch

    from lightkeep.export.weights import build, load_net

    path = Path(path)
    if path.suffix == ".safetensors":
        return load_net(path)
    if path.suffix == ".onnx":
        import onnxruntime

        session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        names = [i.name for i in session.get_inputs()]  # forward's order; keyword inputs by their own names

        def run(*args, **kwargs):
            feed = {**dict(zip(names, args, strict=False)), **kwargs}
            return torch.from_numpy(session.run(None, {k: v.numpy() for k, v in feed.items()})[0])

        return run
    if path.suffix == ".pt2":
        return torch.export.load(path).module()
    if path.suffix == ".pth":
        module = build(json.loads(path.with_suffix(".json").read_text()))
        module.load_state_dict(torch.load(path, weights_only=True))
        return module.eval()
    raise ValueError(f"{path}: not a format scripts/export.py writes")


def lightning_model(ckpt: Path):
    """The oracle for an export: the run's module (its ``config.yaml``) with the checkpoint's weights, in eval mode,
    as Lightning's predict would run it."""
    import yaml
    from lightning.pytorch import LightningModule

    from lightkeep.checkpoint_files import load_checkpoint_file
    from lightkeep.export.weights import build

    ckpt = Path(ckpt)
    module = build(yaml.safe_load((ckpt.parent.parent / "config.yaml").read_text())["model"], LightningModule)
    module.load_state_dict(load_checkpoint_file(ckpt)["state_dict"])
    return module.eval()
