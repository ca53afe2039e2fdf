"""A training step reuses the host memory the previous one freed: no page is faulted in again step after step."""

import re
import resource
import statistics

import pytest
from lightning.pytorch.callbacks import Callback

from tests.helpers import QUIET, cli


class Probe(Callback):
    """Prints the median of the minor page faults of the training steps after the first few."""

    def __init__(self) -> None:
        self.faults: list[int] = []

    def on_train_batch_start(self, *_: object) -> None:
        self.start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt

    def on_train_batch_end(self, *_: object) -> None:
        self.faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - self.start)

    def on_train_end(self, *_: object) -> None:
        print(f"page faults per step: {statistics.median(self.faults[4:])}")


def _faults_per_step(tmp_path, env: dict | None = None) -> float:
    proc = cli("fit", *QUIET, "--trainer.max_steps", "14", "--trainer.limit_val_batches", "1",
               "--model.net.init_args.hidden_sizes", "[2048, 2048]", "--trainer.enable_checkpointing", "false",
               "--trainer.callbacks+=tests.test_host_memory.Probe", cwd=tmp_path, env=env)  # fmt: skip
    return float(re.search(r"page faults per step: (\S+)", proc.stdout)[1])


@pytest.mark.slow  # two fits of a 2048-wide MLP in fresh processes (~20 s)
def test_steps_reuse_freed_host_memory_unless_the_environment_tunes_malloc(tmp_path):
    # The oracle: the same run with glibc's default thresholds set in the environment (which the engine leaves
    # alone): each step's 16 MiB gradients and optimizer temporaries come back as fresh, zeroed pages.
    assert _faults_per_step(tmp_path, env={"MALLOC_TRIM_THRESHOLD_": "131072"}) > 2000
    assert _faults_per_step(tmp_path) < 100
