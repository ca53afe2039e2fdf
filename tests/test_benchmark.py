"""scripts/benchmark.py at a tiny size: it runs both sides and they do the same work. No timings are checked."""

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.slow  # three interpreters (driver, hand-written loop, template CLI): 20-45 s on 2 cores


def test_benchmark_runs_both_sides_on_the_same_steps():
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "benchmark.py"), "--epochs", "2", "--hidden", "32", "--repeats", "1"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, f"benchmark exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    hand, template = summary["hand"], summary["template"]
    assert hand["steps"] == template["steps"] > 0
    assert summary["same_steps"] and summary["same_losses"] and summary["same_threads"]
    assert summary["max_loss_abs_diff"] <= 1e-4
    # Both sides checkpointed: the blog every 2 epochs, the template per its config (best k, last, every 2).
    assert hand["saves_per_epoch"] > 0 and template["saves_per_epoch"] > 0
    assert summary["ratio"]["median"] > 0 and len(summary["ratio"]["pairs"]) == 1
