"""RunSummary: the line a finished run ends with. (Printed once under 2 ranks: tests/test_launch.py, torchrun.)"""

import re
from pathlib import Path

import pytest

from lightkeep.judge import scored_checkpoint
from tests.helpers import QUIET, cli, run_dirs, scalars

pytestmark = pytest.mark.slow  # real runs of the CLI in subprocesses

SUMMARY: list[str] = []  # flags a run needs for its summary line: none, the engine always adds RunSummary
TINY = ["--trainer.max_epochs", "3", "--trainer.limit_train_batches", "4", "--trainer.limit_val_batches", "2"]
LINE = re.compile(r"^Run summary: best val/acc (\S+) \| best checkpoint (\S+) \| run folder (\S+)$")


def summary_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("Run summary:")]


def test_finished_run_ends_with_best_score_checkpoint_and_folder(workdir):
    proc = cli("fit", *QUIET, *TINY, *SUMMARY, cwd=workdir)
    (line,) = summary_lines(proc.stdout + proc.stderr)
    assert proc.stdout.strip().splitlines()[-1] == line  # the run's last word
    score, checkpoint, folder = LINE.match(line).groups()
    (run,) = run_dirs(workdir)
    assert workdir / folder == run
    best = max(value for _, value in scalars(run)["val/acc"])  # the curve TensorBoard shows
    assert float(score) == round(best, 4)
    assert (workdir / checkpoint).is_file() and Path(checkpoint).parent == Path(folder) / "checkpoints"
    scored = scored_checkpoint(workdir / checkpoint)  # the score that file's ModelCheckpoint saved it with
    assert scored is not None and (scored.monitor, scored.mode) == ("val/acc", "max")
    assert scored.score == pytest.approx(best)
