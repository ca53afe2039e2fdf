"""scripts/count_syncs.py counts the host reads of device values per optimizer step, by source, on CPU. (Here,
with the example: its sides are scripts/benchmark.py's, which train the digits MLP by design.)"""

import json
import subprocess
import sys

import pytest

from tests.helpers import REPO

pytestmark = pytest.mark.slow


@pytest.mark.long  # CI and make test-all (~55 s: one process and 2 ranks of each loop)
def test_count_syncs_sees_the_hand_loops_item_per_step_and_the_guards_staged_reads(tmp_path):
    out = tmp_path / "syncs.json"
    cmd = [sys.executable, str(REPO / "scripts" / "count_syncs.py"), "--epochs", "2", "--sides", "hand,template"]
    cmd += ["--fused", "--json", str(out)]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    sides = json.loads(out.read_text())["sides"]
    hand, template = sides["hand"], sides["template"]
    assert hand["by_source"]["the script's own code"] == 1.0  # loss.item() for TensorBoard, every step
    assert "engine" not in template["by_source"]  # the NaN guard: no device read within the steps
    assert template["host_only"]["host: staged copies"] > 0  # ...its reads are of host copies
    assert template["by_source"].get("lightning: progress bar", 0) == 0  # the bar reads staged copies too
