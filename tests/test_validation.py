"""Validation across ranks: distributed and rank-zero modes both equal the single-process numbers."""

import pytest
import torch

from tests.conftest import QUIET, cli, run_dirs, scalars

pytestmark = pytest.mark.slow

PRIME_VAL = ["--data.val_fraction", "0.1509", "--data.batch_size", "32"]  # int(1797 * 0.1509) = 271, a prime
VAL_SIZE = 271


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
    ("subcommand", "mode"),
    [("validate", "distributed")]  # the others: CI and make test-all
    + [pytest.param(*case, marks=pytest.mark.long) for case in [("validate", "rank_zero"), ("test", "distributed"),
                                                                 ("test", "rank_zero")]],
)  # fmt: skip
def test_one_two_and_three_ranks_give_the_single_process_numbers(checkpoint, tmp_path, mode, subcommand):
    stage = "val" if subcommand == "validate" else "test"
    results = {}
    ranks = (1, 2, 3) if subcommand == "validate" else (1, 2)  # 3 ranks once per mode keeps the suite short
    for n in ranks:
        cwd = tmp_path / f"ranks{n}"
        cwd.mkdir()
        probe = ["--trainer.callbacks+=tests.faults.CountEvalSamples", f"--trainer.callbacks.out_dir={cwd / 'count'}"]
        cli(subcommand, *QUIET, *PRIME_VAL, *ddp(n), f"--model.validation={mode}", *probe,
            "--ckpt_path", str(checkpoint), cwd=cwd, timeout=300)  # fmt: skip
        (run,) = run_dirs(cwd)
        logged = scalars(run)
        counts = [int(p.read_text()) for p in sorted((cwd / "count").glob("rank*.txt"))]
        assert len(counts) == n
        expected = VAL_SIZE if stage == "val" else int(1797 * 0.15)
        assert sum(counts) == expected, counts  # every sample exactly once: no padding duplicates
        if mode == "rank_zero":
            assert counts[1:] == [0] * (n - 1)
        results[n] = (logged[f"{stage}/acc"][-1][1], logged[f"{stage}/loss"][-1][1])
    for n in ranks[1:]:
        assert results[n][0] == pytest.approx(results[1][0], abs=1e-7), (mode, n)
        assert results[n][1] == pytest.approx(results[1][1], rel=1e-5), (mode, n)


@pytest.mark.long  # CI and make test-all; the rank-zero mode again, with callbacks
def test_rank_zero_mode_with_checkpointing_and_early_stopping_finishes_and_agrees(tmp_path):
    early_stop = [
        "--trainer.callbacks+=lightning.pytorch.callbacks.EarlyStopping",
        "--trainer.callbacks.monitor=val/acc",
        "--trainer.callbacks.mode=max",
        "--trainer.callbacks.patience=1",
        "--trainer.callbacks.min_delta=0.5",
    ]  # stops after 2 epochs
    train = tmp_path / "train"
    train.mkdir()
    cli(
        "fit",
        *QUIET,
        *PRIME_VAL,
        *ddp(2),
        "--model.validation=rank_zero",
        "--trainer.max_epochs",
        "6",
        "--model.warmup",
        "1",
        *early_stop,
        cwd=train,
        timeout=240,
    )  # fmt: skip  (fails instead of hanging)
    (run,) = run_dirs(train)
    ckpt = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)
    logged = scalars(run)["val/acc"]
    assert len(logged) == 2 and ckpt["epoch"] < 5  # both ranks stopped after epoch 2, as min_delta 0.5 makes it
    best = list((run / "checkpoints").glob("best-*.ckpt"))
    assert len(best) == min(3, len(logged)) and len(list(run.glob("events.out.tfevents.*"))) == 1
    for path in best:  # each best checkpoint, re-validated by one process, has the score rank 0 reported
        check = tmp_path / path.stem
        check.mkdir()
        cli("validate", *QUIET, *PRIME_VAL, *ddp(1), "--ckpt_path", str(path), cwd=check)
        (val_run,) = run_dirs(check)
        single = scalars(val_run)["val/acc"][-1][1]
        assert f"acc{single:.4f}" in path.name
        assert any(abs(v - single) < 1e-7 for _, v in logged)


@pytest.mark.long  # CI and make test-all; sample predictions again, under DDP
def test_rank_zero_writes_sample_predictions_once(checkpoint, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cli("validate", *QUIET, *PRIME_VAL, *ddp(2), "--ckpt_path", str(checkpoint), cwd=tmp_path, timeout=240)
    (run,) = run_dirs(tmp_path)
    assert len(list(run.glob("events.out.tfevents.*"))) == 1
    events = EventAccumulator(str(run), size_guidance={"images": 0, "tensors": 0})
    events.Reload()
    assert events.Tags()["images"] == ["val/samples"] and len(events.Images("val/samples")) == 1
    table = events.Tensors("val/predictions/text_summary")[0].tensor_proto.string_val[0].decode()
    assert len(table.splitlines()) == 2 + 16  # header, separator, 16 samples
