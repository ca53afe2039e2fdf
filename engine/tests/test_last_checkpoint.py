"""The timed ``last.ckpt`` under DDP: rank 0's clock decides, every rank saves at the same batch end, agreed without a
collective the host waits for at each step (the count in ``tests/test_signal_syncs.py``), and the fit's end still
writes the final step."""

import json
from pathlib import Path

import lightning as L
import pytest
import torch

from lightkeep.agreement import AGREE_EVERY
from tests.helpers import DDP2, QUIET, cli, run_dirs

pytestmark = pytest.mark.slow


class SaveSteps(L.Callback):
    """Test probe: the global step of every checkpoint this rank takes part in (``on_save_checkpoint`` runs on every
    rank, rank 0 writes), in ``out/rank{R}.json`` at teardown."""

    def __init__(self, out: str) -> None:
        self.out, self.steps = Path(out), []

    def on_save_checkpoint(self, trainer: L.Trainer, *_: object) -> None:
        self.steps.append(trainer.global_step)

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(self.steps))


def test_under_ddp_every_rank_refreshes_last_ckpt_at_the_batch_end_rank_0s_clock_agreed_and_at_the_end(tmp_path):
    # An interval of 1 µs: rank 0's clock is up at every batch end, so each agreement says "save". 2 epochs of 24
    # batches, no validation and no periodic files: every save is last.ckpt's.
    args = [*QUIET, *DDP2, "--data.batch_size", "16", "--trainer.max_epochs", "2"]
    args += ["--trainer.limit_train_batches", "24", "--trainer.limit_val_batches", "0"]
    args += ["--checkpoints.every_n_epochs", "null", "--checkpoints.last_every", "0:00:00.000001"]
    args += ["--trainer.callbacks+=tests.test_last_checkpoint.SaveSteps", f"--trainer.callbacks.out={tmp_path / 's'}"]
    cli("fit", *args, cwd=tmp_path, timeout=300)
    # Agreements start at batch ends 10, 20, 30, 40 (AGREE_EVERY) and are read AGREE_EVERY batches later, or at an
    # epoch's end (24) and acted on at the next batch end (25); the fit's end saves its final step (48).
    assert AGREE_EVERY == 10, "the expected steps below follow from AGREE_EVERY = 10"
    expected = [20, 25, 40, 48]
    saved = [json.loads((tmp_path / "s" / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert saved == [expected, expected], f"saves at steps {saved} (rank 0, rank 1), expected {expected} on both"
    (run,) = run_dirs(tmp_path)
    assert torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 48
