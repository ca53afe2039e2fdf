"""The engine's check on a project's own module and data: a run stopped by SIGTERM mid-epoch and resumed with
``fit --ckpt_path last`` ends bitwise equal to the same run uninterrupted (weights and optimizer state). A copy's
``tests/test_engine_check.py`` runs it on the project's base config; anyone can:
``python -m lightkeep.selfcheck project --trainer.max_epochs 2 --trainer.limit_train_batches 6``."""

import os
import signal
import sys
import tempfile
from pathlib import Path

import lightning as L
import torch

from lightkeep.testing import QUIET, run_cli


class SignalAt(L.Callback):
    """Sends this process ``sig`` (SIGTERM: a preemption) just before optimizer step ``step`` runs."""

    def __init__(self, step: int, sig: int = 15) -> None:
        self.step, self.sig = step, sig

    def on_train_batch_start(self, trainer: L.Trainer, *_: object) -> None:
        if trainer.global_step == self.step and trainer.is_global_zero:
            os.kill(os.getpid(), signal.Signals(self.sig))


def resume_delta(program: str, args: list[str], stop_step: int, root: Path, pythonpath: str | None = None) -> float:
    """``python -m PROGRAM fit ARGS`` once uninterrupted and once stopped at ``stop_step`` then resumed, in
    ``root``; the largest |difference| of their final weights and optimizer states (0.0: exact). The stop saves
    within a few steps after the signal (every rank agrees on it without a collective per step); ``AssertionError``
    if a run fails, or the stop saved no checkpoint before the run's end."""
    fit = ["fit", *QUIET, *args]
    whole, stopped = root / "uninterrupted", root / "stopped"
    for folder in (whole, stopped):
        folder.mkdir(parents=True, exist_ok=True)
    run_cli(program, *fit, cwd=whole, pythonpath=pythonpath)
    signal_at = [f"--trainer.callbacks+={__name__}.SignalAt", f"--trainer.callbacks.step={stop_step}"]
    first = run_cli(program, *fit, *signal_at, cwd=stopped, pythonpath=pythonpath, check=False)
    assert first.returncode == 143, f"the stopped run exited {first.returncode}, not 143:\n{first.stderr[-3000:]}"
    (last,) = stopped.glob("runs/*/version_0/checkpoints/last.ckpt")
    step = torch.load(last, map_location="cpu", weights_only=True)["global_step"]
    run_cli(program, *fit, "--ckpt_path", "last", cwd=stopped, pythonpath=pythonpath)
    (a,) = whole.glob("runs/*/version_0/checkpoints/last.ckpt")
    (b,) = stopped.glob("runs/*/version_0/checkpoints/last.ckpt")
    a, b = (torch.load(p, map_location="cpu", weights_only=True) for p in (a, b))
    assert a["global_step"] == b["global_step"], f"steps {a['global_step']} and {b['global_step']}"
    assert stop_step <= step < a["global_step"], f"the stop saved step {step}: not from {stop_step} to the run's end"
    return max(_max_delta(a["state_dict"], b["state_dict"]), _max_delta(a["optimizer_states"], b["optimizer_states"]))


def _max_delta(a: object, b: object) -> float:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.shape == b.shape
        return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0
    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), "the two checkpoints hold different keys"
        return max((_max_delta(a[k], b[k]) for k in a), default=0.0)
    if isinstance(a, list | tuple):
        assert isinstance(b, list | tuple) and len(a) == len(b)
        return max((_max_delta(x, y) for x, y in zip(a, b, strict=True)), default=0.0)
    assert a == b, f"{a!r} != {b!r}"
    return 0.0


if __name__ == "__main__":
    program, *rest = sys.argv[1:] or ["lightkeep"]
    with tempfile.TemporaryDirectory() as tmp:
        delta = resume_delta(program, rest, stop_step=int(os.environ.get("STOP_STEP", "5")), root=Path(tmp),
                             pythonpath=os.getcwd())  # fmt: skip
    print(f"max |delta| after SIGTERM at step and resume: {delta}")
    sys.exit(0 if delta == 0.0 else 1)
