"""The example's data module stops a split it would leave empty before training, in one ``error:`` line naming the
fraction and the value that fixes it (the engine's own checks of bad input: tests/test_bad_input.py)."""

import pytest

from tests.helpers import QUIET, cli, run_dirs

pytestmark = pytest.mark.slow  # a real run of the CLI in a subprocess


def test_a_val_fraction_that_leaves_no_val_sample_stops_before_training(tmp_path):
    args = [*QUIET, "--trainer.max_epochs", "1", "--data.val_fraction", "0.0005"]
    proc = cli("fit", *args, cwd=tmp_path, check=False, timeout=120)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    error = proc.stderr[proc.stderr.rindex("error: ") :]  # the last thing printed
    # int(0.0005 * 1797) = 0 digits; 0.0006 is the smallest fraction of four decimals that leaves one (1.08)
    for words in ("val_fraction (0.0005) leaves no val samples", "1797", "--data.val_fraction to at least 0.0006"):
        assert words in error, f"{words!r} not in {error!r}"
    for run in run_dirs(tmp_path, name="digits"):  # the failed run's folder holds no checkpoint: no step ran
        assert not (run / "checkpoints").exists()
