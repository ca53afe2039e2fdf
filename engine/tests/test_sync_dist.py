"""``self.log(..., sync_dist=True)`` under DDP: an epoch mean of a plain tensor is the mean over every sample of the
epoch, as on one process, also when ranks hold unequal shares (the engine's exactly-once evaluation split gives
101 samples as 51/50 and 34/34/33; a count-weighted training value sums to other totals on each rank). Lightning
divided by a truncated mean of the ranks' counts (``compat_logging.weigh_synced_means_by_samples``)."""

import pytest

from tests.fixtures.sync_dist import SIZES, closed_form, split
from tests.helpers import QUIET, cli, run_dirs, scalars

pytestmark = pytest.mark.slow

OWN = ["--model", "tests.fixtures.sync_dist.SyncDistModel", "--data", "tests.fixtures.sync_dist.SyncDistData",
       "--run.monitor", "val/loss", "--run.mode", "min"]  # fmt: skip
RANKS = (1, 2, 3)
BATCH = 4  # SyncDistData's


def on_ranks(n: int) -> list[str]:
    """One plain process (the oracle's setting), or ``n`` gloo DDP ranks."""
    ddp = ["--trainer.strategy", "ddp"] if n > 1 else []
    return ["--trainer.accelerator", "cpu", "--trainer.devices", str(n), *ddp]


def last_values(cwd, *args: str) -> dict[str, float]:
    """Each TensorBoard tag's last value after ``python -m project ARGS`` in ``cwd``."""
    cwd.mkdir()
    cli(*args, *QUIET, *OWN, cwd=cwd, timeout=300)
    (run,) = run_dirs(cwd, "sync_dist")
    return {tag: points[-1][1] for tag, points in scalars(run).items()}


def test_the_splits_leave_ranks_unequal_counts_whose_mean_is_no_integer():
    for stage in ("val", "test"):
        assert all(SIZES[stage] % n for n in RANKS[1:]), stage  # 51/50, 34/34/33 samples
    for stage in ("train", "val", "test"):
        total = int(split(stage)[2].sum())  # what train/weighted's batch_size sums to over the epoch
        assert all(total % n for n in RANKS[1:]), (stage, total)
    # and no training padding on any number of ranks: every run's training epoch holds the same 96 samples
    assert all(SIZES["train"] % (BATCH * n) == 0 for n in RANKS)


@pytest.mark.parametrize(
    ("subcommand", "ranks"),
    [
        ("validate", (1, 3)),
        # CI and make test-all: 2 ranks' unequal split (51/50) is the same guarantee as 3 ranks' (34/34/33), which
        # make test checks in [validate-1-3] above (a 2-rank DDP start less there)
        pytest.param("validate", (1, 2), marks=pytest.mark.long),
        pytest.param("test", RANKS, marks=pytest.mark.long),  # the same loop
    ],
    ids=lambda x: "-".join(map(str, x)) if isinstance(x, tuple) else x,
)
def test_evaluation_means_on_one_two_and_three_ranks_are_the_single_process_ones(tmp_path, subcommand, ranks):
    stage = "val" if subcommand == "validate" else "test"
    exact = closed_form(stage)
    logged = {n: last_values(tmp_path / f"ranks{n}", subcommand, *on_ranks(n)) for n in ranks}
    for name, mean in exact.items():
        values = " / ".join(f"{logged[n][stage + '/' + name]:.7g}" for n in ranks)
        print(f"{stage}/{name} on {'/'.join(map(str, ranks))} ranks: {values} (all samples: {mean:.7g})")
    for n, values in logged.items():  # untrained weights, seeded alike: the same loss on any number of ranks
        assert values[f"{stage}/loss"] == pytest.approx(logged[1][f"{stage}/loss"], rel=1e-6), (n, values)
        for name, mean in exact.items():
            assert values[f"{stage}/{name}"] == pytest.approx(mean, rel=1e-6), (n, name, values)


@pytest.mark.long  # CI and make test-all; validate's means are in make test
def test_training_and_validation_epoch_means_of_a_fit_are_those_of_all_samples(tmp_path):
    train, val = closed_form("train"), closed_form("val")
    for n in RANKS:
        values = last_values(tmp_path / f"ranks{n}", "fit", "--trainer.max_epochs", "1", *on_ranks(n))
        for name, mean in train.items():  # on_step and on_epoch: Lightning's train/..._epoch
            assert values[f"train/{name}_epoch"] == pytest.approx(mean, rel=1e-6), (n, name, values)
        for name, mean in val.items():
            assert values[f"val/{name}"] == pytest.approx(mean, rel=1e-6), (n, name, values)
