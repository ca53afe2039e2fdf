"""Validation across ranks: every sample evaluated once, the numbers of a single process."""

import pytest

from tests.fixtures.stand_in import SAMPLES
from tests.helpers import QUIET, cli, run_dirs, scalars

pytestmark = pytest.mark.slow

PRIME_VAL = ["--data.val_fraction", "0.1509", "--data.batch_size", "32"]
VAL_SIZE = int(SAMPLES * 0.1509)  # 271, a prime: no number of ranks splits it evenly
TEST_SIZE = int(SAMPLES * 0.15)  # the default test_fraction


def ddp(n: int) -> list[str]:
    if n == 1:
        return ["--trainer.accelerator", "cpu", "--trainer.devices", "1"]
    return ["--trainer.accelerator", "cpu", "--trainer.devices", str(n), "--trainer.strategy", "ddp"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("train")
    cli("fit", *QUIET, *PRIME_VAL, "--trainer.max_epochs", "2", "--model.warmup", "1", cwd=cwd)
    (run,) = run_dirs(cwd)
    return run / "checkpoints" / "last.ckpt"


@pytest.mark.parametrize(
    "subcommand",
    # CI and make test-all; make test validates on 1, 2 and 3 ranks against one process in test_sync_dist.py
    [pytest.param("validate", marks=pytest.mark.long), pytest.param("test", marks=pytest.mark.long)],
)
def test_one_two_and_three_ranks_give_the_single_process_numbers(checkpoint, tmp_path, subcommand):
    stage = "val" if subcommand == "validate" else "test"
    results = {}
    ranks = (1, 2, 3) if subcommand == "validate" else (1, 2)  # 3 ranks once keeps the suite short
    for n in ranks:
        cwd = tmp_path / f"ranks{n}"
        cwd.mkdir()
        probe = ["--trainer.callbacks+=tests.faults.CountEvalSamples", f"--trainer.callbacks.out_dir={cwd / 'count'}"]
        cli(subcommand, *QUIET, *PRIME_VAL, *ddp(n), *probe,
            "--ckpt_path", str(checkpoint), cwd=cwd, timeout=300)  # fmt: skip
        (run,) = run_dirs(cwd)
        logged = scalars(run)
        counts = [int(p.read_text()) for p in sorted((cwd / "count").glob("rank*.txt"))]
        assert len(counts) == n
        expected = VAL_SIZE if stage == "val" else TEST_SIZE
        assert sum(counts) == expected, counts  # every sample exactly once: no padding duplicates
        results[n] = (logged[f"{stage}/acc"][-1][1], logged[f"{stage}/loss"][-1][1])
    for n in ranks[1:]:
        assert results[n][0] == pytest.approx(results[1][0], abs=1e-7), n
        assert results[n][1] == pytest.approx(results[1][1], rel=1e-5), n


@pytest.mark.long  # CI and make test-all; one event stream again, under DDP validate (the example's sample images
# written once: tests/test_validation.py)
def test_a_ddp_validate_writes_one_event_stream_with_each_value_once(checkpoint, tmp_path):
    cli("validate", *QUIET, *PRIME_VAL, *ddp(2), "--ckpt_path", str(checkpoint), cwd=tmp_path, timeout=240)
    (run,) = run_dirs(tmp_path)
    assert len(list(run.glob("events.out.tfevents.*"))) == 1
    logged = scalars(run)
    assert len(logged["val/acc"]) == len(logged["val/loss"]) == 1
