"""What a fresh run's start line names under ``opts out:`` (``steadfast.guarantees``) for settings the README lists as
not kept exact and that no other test reads: checkpointing off, a logger the engine does not know, augmenting loader
workers with ``run.seed_per_sample`` off, the workers of a loader that keeps its own position. In this process, one
short fit each."""

import pytest
from lightning.pytorch.loggers.logger import Logger

from tests.helpers import QUIET, cli_in_process


class OwnLogger(Logger):
    """A logger of the user's own: the engine cannot point it at the run or continue its run on a resume."""

    name, version = "own", 0  # and no ``experiment``, as Lightning's Logger has none: the engine's saves flush it

    def log_metrics(self, metrics, step=None) -> None:
        pass

    def log_hyperparams(self, params, *args, **kwargs) -> None:
        pass


SHORT = [*QUIET, "--trainer.max_epochs", "1", "--trainer.limit_train_batches", "2", "--trainer.limit_val_batches", "1",
         "--run.monitor", "null"]  # fmt: skip


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--trainer.enable_checkpointing", "false"], "opts out: checkpointing is off: nothing to resume from"),
        (["--trainer.logger", f"{__name__}.OwnLogger"],
         "logger OwnLogger: unknown to the engine, a resume starts a new run in it"),
        (["--data.num_workers", "2", "--run.seed_per_sample", "false"],
         "train loader 0: run.seed_per_sample is off: random draws in the dataset's __getitem__ depend on the loader "
         "worker that fetches each sample, so a resume augments differently"),
        (["--model", "tests.fixtures.streams.NextToken", "--data", "tests.fixtures.streams.TokenData",
          "--data.batch_size", "4", "--data.loader", "stateful", "--data.state", "true", "--data.num_workers", "2"],
         "train loader 0: random draws in its 2 workers (augmentation) start again from the workers' seeds on a "
         "resume: StatefulDataLoader's state_dict keeps no generator state (each resume checks its first batch)"),
    ],
    ids=["checkpointing-off", "unknown-logger", "seed-per-sample-off", "own-position-workers"],
)  # fmt: skip
def test_a_fresh_runs_start_line_names_what_the_settings_give_up(flags, named, tmp_path, capsys):
    cli_in_process("fit", *SHORT, *flags, root=tmp_path)
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("Run "))
    assert "exact resume: see opts out" in line and named in line, line
