"""The engine's self-check on this project's own module and data (lightkeep.selfcheck): stopped mid-epoch by a
SIGTERM, as a preempted job is, and resumed with ``fit --ckpt_path last``, the run ends bitwise equal to the same
run uninterrupted. Edit the flags to your config's cheapest run that still crosses an epoch."""

import pytest

from lightkeep.selfcheck import resume_delta
from tests.helpers import PROGRAM, REPO

pytestmark = pytest.mark.slow  # three real fits: uninterrupted, stopped, resumed
SMALL = ["--trainer.max_epochs", "2", "--trainer.limit_train_batches", "6", "--trainer.limit_val_batches", "2"]


def test_a_stopped_and_resumed_run_equals_the_uninterrupted_one(tmp_path):
    assert resume_delta(PROGRAM, SMALL, stop_step=7, root=tmp_path, pythonpath=str(REPO)) == 0.0  # in epoch 2
