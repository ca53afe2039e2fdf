"""What a fresh run's start line names under ``opts out:`` (``lightkeep.guarantees``) for settings the README lists as
not kept exact and that no other test reads: checkpointing off, a logger the engine does not know, augmenting loader
workers with ``run.seed_per_sample`` off, the workers of a loader that keeps its own position, Lightning's
``StochasticWeightAveraging``. In this process, one short fit each; and, on 2 DDP ranks in
subprocesses, an evaluation limit (``limit_val_batches``, ``limit_test_batches``), which Lightning applies per rank,
and an evaluation loader's ``drop_last``, counted."""

import pytest
from lightning.pytorch.loggers.logger import Logger

from lightkeep.guarantees import per_rank_limit
from tests.helpers import DDP2, QUIET, cli, cli_in_process, run_dirs, scalars


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
        (["--trainer.callbacks+=StochasticWeightAveraging", "--trainer.callbacks.swa_lrs=0.01"],
         "StochasticWeightAveraging: Lightning's callback starts its SWALR schedule and its average at an epoch's "
         "start, so a resume mid-epoch continues them inexactly (a resume at an epoch's end is exact)"),
    ],
    ids=["checkpointing-off", "unknown-logger", "seed-per-sample-off", "own-position-workers", "swa"],
)  # fmt: skip
def test_a_fresh_runs_start_line_names_what_the_settings_give_up(flags, named, tmp_path, capsys):
    cli_in_process("fit", *SHORT, *flags, root=tmp_path)
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("Run "))
    assert "exact resume: see opts out" in line and named in line, line


def test_what_resumes_exactly_is_not_named(tmp_path, capsys):
    """Lightning's ``EMAWeightAveraging`` keeps its average in the checkpoint and updates it at each step (a resume
    mid-epoch continues it exactly); an evaluation limit in one process evaluates what one process evaluates."""
    flags = ["--trainer.callbacks+=EMAWeightAveraging", "--trainer.limit_val_batches", "2"]
    cli_in_process("fit", *SHORT, *flags, root=tmp_path)
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("Run "))
    assert "exact resume: yes, also mid-epoch (each resume checks its first batch)" in line, line
    assert "opts out" not in line, line


PER_RANK = "applies per rank"
# the stand-in's 269 validation and 269 test samples in batches of 64: 5 batches in one process; on 2 ranks 135 and
# 134 samples, 3 batches each
NAMED_PER_RANK = [
    ("fit", ["--trainer.limit_val_batches", "2"],
     "limit_val_batches 2 applies per rank: 2 ranks evaluate 4 batches (256 samples) a validation where one process "
     "evaluates 2 (128), so its values are not one process's"),
    pytest.param("test", ["--trainer.limit_test_batches", "0.7"],
                 "limit_test_batches 0.7 applies per rank: 2 ranks evaluate 4 batches (256 samples) a test where one "
                 "process evaluates 3 (192), so its values are not one process's", marks=pytest.mark.long),
    pytest.param("validate", ["--trainer.limit_val_batches", "2"],
                 "limit_val_batches 2 applies per rank: 2 ranks evaluate 4 batches (256 samples) a validation where "
                 "one process evaluates 2 (128), so its values are not one process's", marks=pytest.mark.long),
]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize(("command", "limit", "named"), NAMED_PER_RANK, ids=["fit", "test", "validate"])
def test_an_evaluation_limit_under_ddp_is_named_as_applied_per_rank(command, limit, named, tmp_path, capsys):
    """Lightning cuts each rank's share of the evaluation to the limit, while the engine splits the samples over the
    ranks: 2 ranks evaluate other samples than one process, so the epoch values are not one process's. In one
    process the same limit is not named."""
    short = [*QUIET, "--trainer.max_epochs", "1", "--trainer.limit_train_batches", "2", "--run.monitor", "null"]
    lines, logged = {}, {}
    for devices, ranks in ((1, ["--trainer.accelerator", "cpu", "--trainer.devices", "1"]), (2, DDP2)):
        cwd = tmp_path / str(devices)
        cwd.mkdir()
        args = [*(short if command == "fit" else QUIET), *ranks, *limit]
        if devices == 1:  # one process: the real CLI in this one (Lightning's ddp re-executes sys.argv: 2 ranks not)
            capsys.readouterr()
            cli_in_process(command, *args, root=cwd / "runs")
            out = capsys.readouterr().out
        else:
            out = cli(command, *args, cwd=cwd).stdout
        lines[devices] = next(x for x in out.splitlines() if x.startswith("Run "))
        logged[devices] = {tag: values[-1][1] for tag, values in scalars(run_dirs(cwd)[-1]).items()}
    assert named in lines[2], lines[2]
    assert PER_RANK not in lines[1], lines[1]
    if command == "fit":
        assert "exact resume: see opts out" in lines[2] and "exact resume: yes" in lines[1], lines
    else:  # the untrained weights, alike on 1 and 2 ranks: what the line warns of, measured
        tag = "test/loss" if command == "test" else "val/loss"
        assert abs(logged[2][tag] - logged[1][tag]) > 1e-4, (logged[1][tag], logged[2][tag])


@pytest.mark.parametrize(
    ("limit", "shares", "total", "expected"),
    [
        (2, [135, 134], 269, ((4, 256), (2, 128))),  # each rank cuts its own share: twice the batches
        (0.7, [135, 134], 269, ((4, 256), (3, 192))),
        (0.5, [135, 134], 269, None),  # one batch of each rank's share: the first 128 positions, as one process
        (5, [135, 134], 269, None),  # no cut: every sample on one rank
        (3, [135, 134], 269, ((6, 269), (3, 192))),  # each rank's 3 batches end short: all 269 where one has 192
    ],
)
def test_a_per_rank_limit_is_counted_against_the_samples_one_process_evaluates(limit, shares, total, expected):
    assert per_rank_limit(limit, shares, total, 64, drop_last=False) == expected


@pytest.mark.parametrize(
    ("shares", "total", "expected"),
    [
        ([34, 34, 33], 101, ((9, 90), (10, 100))),  # each rank drops its short 4th batch, one process only 1 sample
        ([50, 50], 100, None),  # 5 whole batches a rank: the 100 one process evaluates
        ([51, 50], 101, None),  # each drops its 1 or 0 left over: positions 0-99, as one process
    ],
)
def test_an_evaluation_loaders_drop_last_on_n_ranks_is_counted_against_one_process(shares, total, expected):
    """drop_last=True in a validation loader of batch 10: Lightning drops each rank's short last batch."""
    got = per_rank_limit(1.0, shares, total, 10, drop_last=True)
    assert got == expected
