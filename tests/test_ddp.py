"""Two CPU ranks (gloo) through the real CLI: one run folder, one event stream, checkpoints, metrics."""

import math

import pytest
import torch

from tests.fixtures.stand_in import SAMPLES
from tests.helpers import DDP2, QUIET, cli, run_dirs, scalars

pytestmark = pytest.mark.slow


def test_two_rank_fit_writes_exactly_one_run(workdir):
    # every step logged (the default logs every 50th: fewer host syncs), so that each step's train/loss is counted
    cli("fit", *QUIET, *DDP2, "--trainer.max_epochs", "2", "--model.warmup", "1", "--trainer.log_every_n_steps", "1",
        cwd=workdir, timeout=240)  # fmt: skip
    (run,) = run_dirs(workdir)
    assert len(list(run.glob("events.out.tfevents.*"))) == 1
    assert sorted(p.name for p in run.glob("*.yaml")) == ["config.yaml", "hparams.yaml"]
    ckpt = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)
    train = SAMPLES - 2 * int(SAMPLES * 0.15)  # the stand-in's train split (15 % val, 15 % test)
    per_rank_batches = math.ceil(math.ceil(train / 2) / 64)  # each rank's half, padded to equal, in batches of 64
    assert ckpt["global_step"] == 2 * per_rank_batches
    logged = scalars(run)
    assert len(logged["val/acc"]) == 2 and 0.5 < logged["val/acc"][-1][1] <= 1
    assert len(logged["train/loss"]) == 2 * per_rank_batches
