"""pytest fixtures shared by the tests; helpers they import are in ``tests/helpers.py``."""

from pathlib import Path

import pytest
from tensorboard.summary.writer import event_file_writer

# TensorBoard reads a run folder's event files in name order: events.out.tfevents.<second>.<host>.<pid>.<counter>.
# Runs in this one process (cli_in_process) share the pid, and a crashed run and its resume often start in the same
# second, so the counter decides, compared as text: the 10th writer's file (".10") would be read before the 9th's,
# and the crashed run's points would hide the resumed run's. Seven-digit counters sort as numbers. (A user's resume
# is another process, seconds later.)
event_file_writer._global_uid = event_file_writer.AtomicCounter(1_000_000)


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    return tmp_path
