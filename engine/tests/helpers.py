"""Test helpers, imported by the tests (``from tests.helpers import cli, QUIET``): run the real CLI in a subprocess
or in this process, read what a run wrote. Fixtures live in ``conftest.py``."""

import os
import socket
import sys
from pathlib import Path

from lightkeep.testing import DDP2, QUIET, run_cli, scalars
from lightkeep.testing import run_dirs as _run_dirs

ENGINE = Path(__file__).resolve().parents[1]  # engine/: its tests import as `tests` from here
REPO = ENGINE.parent  # the template checkout, whose configs/ and scripts/ some engine tests run
__all__ = ["DDP2", "QUIET", "scalars"]
# What the engine tests train, unless they name their own classes: the stand-in (tests/fixtures/stand_in.py), not the
# example, so that editing or deleting the example breaks only tests/. Flags given after it replace it.
STAND_IN = ["--model", "tests.fixtures.stand_in.StandIn", "--data", "tests.fixtures.stand_in.BlobsDataModule"]
RUN_NAME = "blobs"  # runs/blobs/version_N: the run folder named after BlobsDataModule
_TRAINS = ("fit", "validate", "test", "predict")
PYTHONPATH = os.pathsep.join([str(ENGINE), str(REPO)])  # the stand-in (tests.fixtures) and the project's package


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (a rendezvous for torchrun or a TensorBoard server)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def with_stand_in(args: tuple[str, ...] | list[str], example: bool = False) -> list[str]:
    """``args`` with the stand-in's classes put after the subcommand; ``example=True``: as given (the example)."""
    args = list(args)
    if example or not args or args[0] not in _TRAINS:
        return args
    return [args[0], *STAND_IN, *args[1:]]


def cli(*args: str, cwd: Path, timeout: float = 300, check: bool = True, env: dict | None = None,
        example: bool = False):  # fmt: skip
    """Runs ``python -m project ARGS`` in ``cwd`` (runs/ lands there) and returns the CompletedProcess; it trains
    the stand-in unless ``args`` name other classes, or ``example=True`` (the base config's example)."""
    args = with_stand_in(args, example)
    return run_cli("project", *args, cwd=cwd, pythonpath=PYTHONPATH, timeout=timeout, check=check, env=env)


def run_dirs(cwd: Path, name: str = RUN_NAME) -> list[Path]:
    return _run_dirs(cwd, name)


def newest_checkpoint(run_dir: Path) -> Path:
    """The run's most recently written checkpoint file: what ``--ckpt_path last`` resumes from after a hard crash
    (the default writes last.ckpt every 10 minutes and at the end of fit, the best 3 and every 2 epochs)."""
    return max((run_dir / "checkpoints").glob("*.ckpt"), key=lambda p: p.stat().st_mtime)


def saved_steps(run_dir: Path) -> dict[str, int]:
    """``{file name: global_step}`` of each checkpoint file in the run."""
    import torch

    return {p.name: torch.load(p, weights_only=True)["global_step"] for p in (run_dir / "checkpoints").glob("*.ckpt")}


BASE_CONFIG = REPO / "configs" / "default.yaml"  # what `python -m project` reads first (project/__main__.py)


def cli_main(args=None, run: bool = True, base_config=BASE_CONFIG, program: str = "project"):
    """``lightkeep.cli_main`` as ``python -m project`` calls it (the engine tests run the template's entry)."""
    from lightkeep.main import cli_main as engine_cli_main

    return engine_cli_main(args, run=run, base_config=base_config, program=program)


def cli_in_process(*args: str, root: Path, example: bool = False):
    """Runs ``python -m project ARGS`` in this process, its runs under ``root``; returns the LightningCLI. Trains the
    stand-in, as ``cli`` does.

    Single-process runs only (Lightning's ``ddp`` re-executes ``sys.argv``: DDP goes through ``cli``).
    """
    from unittest import mock

    with mock.patch.object(sys, "argv", ["project"]):  # pytest's own arguments are not the CLI's
        args = with_stand_in(args, example)
        return cli_main([args[0], "--run.root", str(root), *args[1:]])


def crash_in_process(step: int, *args: str, root: Path) -> Path:
    """Runs ``fit ARGS`` in this process until it crashes before optimizer step ``step`` (``tests.faults.CrashAt``),
    as a bug would, with the checkpoints of earlier steps on disk; returns the newest run's last.ckpt."""
    import pytest

    with pytest.raises(RuntimeError, match="injected crash"):
        cli_in_process("fit", *args, "--trainer.callbacks+=tests.faults.CrashAt", f"--trainer.callbacks.step={step}",
                       root=root)  # fmt: skip
    return sorted((root / RUN_NAME).glob("version_*"))[-1] / "checkpoints" / "last.ckpt"


def max_abs_diff(a, b) -> float:
    import torch

    """The largest |a - b| over every tensor of two nested checkpoints parts (their structure must match)."""
    if isinstance(a, torch.Tensor):
        return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        return max((max_abs_diff(a[k], b[k]) for k in a), default=0.0)
    if isinstance(a, list | tuple):
        assert len(a) == len(b)
        return max((max_abs_diff(x, y) for x, y in zip(a, b, strict=True)), default=0.0)
    assert a == b
    return 0.0


def run_onnx(path: Path):
    """An exported ONNX file as a function of one input tensor (input named ``input``), run by onnxruntime."""
    import onnxruntime
    import torch

    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return lambda x: torch.from_numpy(session.run(None, {"input": x.numpy()})[0])
