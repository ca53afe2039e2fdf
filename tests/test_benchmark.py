"""The benchmark scripts at a tiny size: every side does the same work. No timings are checked. (Here, with the
example: the scripts train the digits MLP by design, the hand-written loop beside the template's Classifier.)"""

import json
import os
import subprocess
import sys

import pytest

from tests.helpers import REPO

pytestmark = pytest.mark.slow  # four interpreters (driver, hand-written loop, plain Lightning, template CLI)


def run_script(name: str, *args: str) -> subprocess.CompletedProcess:
    """``python scripts/NAME ARGS``, which must exit 0."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / name), *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, f"{name} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


@pytest.mark.long  # CI and make test-all; the benchmark script's three sides
def test_benchmark_runs_three_sides_on_the_same_steps():
    proc = run_script("benchmark.py", "--epochs", "2", "--hidden", "32", "--repeats", "1")
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    hand, lightning, template = summary["hand"], summary["lightning"], summary["template"]
    # The oracle is the hand-written loop: the same number of steps, each with its loss, on every side.
    assert hand["steps"] == lightning["steps"] == template["steps"] > 0
    assert summary["same_steps"] and summary["same_losses"] and summary["same_threads"]
    assert summary["loss_abs_diff_vs_hand"].keys() == {"lightning", "template"}
    assert summary["max_loss_abs_diff"] <= 1e-4
    # Every side checkpointed: the blog and plain Lightning every 2 epochs, the template per its config.
    assert hand["saves_per_epoch"] == lightning["saves_per_epoch"] == 0.5 and template["saves_per_epoch"] > 0
    for key in ("ratio", "ratio_vs_lightning"):
        assert summary[key]["median"] > 0 and len(summary[key]["pairs"]) == 1
    assert set(summary["extra_us_per_step"]) == {"vs_hand", "vs_lightning"}
    # Start-up counts from the end of `import lightning` in each run's own process, before anything is built.
    for side in (lightning, template):
        assert 0 < side["phases_s"]["imported"] < side["phases_s"]["built"] < side["first_step_s"]
        assert side["own_startup_s"]["median"] == side["first_step_s"] - side["phases_s"]["imported"]
    assert hand["own_startup_s"] is None  # no Lightning there
    # A step's median time on every side, within the training span; the ratio within the round.
    for side in (hand, lightning, template):
        assert 0 < side["step_s"] * side["steps"] < side["train_s"]
    assert summary["step_ratio_vs_lightning"]["pairs"] == [template["step_s"] / lightning["step_s"]]


def test_step_benchmark_compares_the_same_steps_and_prints_each_piece():
    """scripts/benchmark_step.py: the bare loop and the minimal LightningModule take the same steps with the same
    losses (its exit status says so), and each piece of a step is printed."""
    proc = run_script("benchmark_step.py", "--hidden", "16", "--repeats", "1")
    assert "same steps and losses, bare and minimal Lightning: True" in proc.stdout
    for piece in ("bare PyTorch step", "Lightning, minimal module", "the template's Classifier", "NaN guard",
                  "self.log", "profiling context"):  # fmt: skip
        assert piece in proc.stdout, piece
