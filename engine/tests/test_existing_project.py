"""An existing Lightning project adopts the engine with nothing copied: its own package (a module and a data module
written from Lightning's docs, no import of the engine or the template), its own config with its own callbacks list,
and ``python -m steadfast fit`` run in its folder. Killed with SIGKILL mid-epoch, ``fit --ckpt_path last`` ends with
the weights of the uninterrupted run, bit for bit."""

import textwrap
from pathlib import Path

import pytest
import torch

from steadfast.testing import run_cli, run_dirs
from tests.faults import kill_at
from tests.helpers import ENGINE

pytestmark = pytest.mark.slow

MODEL = """
import lightning as L
import torch
from torch import nn


class Regressor(L.LightningModule):
    def __init__(self, hidden: int = 16, lr: float = 1e-2) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(4, hidden), nn.ReLU(), nn.Dropout(0.1), nn.Linear(hidden, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x).squeeze(-1), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.net(x).squeeze(-1), y), sync_dist=True)

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
"""

DATA = """
import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset


class Points(L.LightningDataModule):
    def __init__(self, batch_size: int = 8) -> None:
        super().__init__()
        self.batch_size = batch_size

    def setup(self, stage: str) -> None:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(120, 4, generator=g)
        y = x @ torch.tensor([1.0, -2.0, 0.5, 3.0]) + 0.1 * torch.randn(120, generator=g)
        self.train_set, self.val_set = TensorDataset(x[:96], y[:96]), TensorDataset(x[96:], y[96:])

    def train_dataloader(self):
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self):
        return DataLoader(self.val_set, batch_size=self.batch_size)
"""

CONFIG = """
seed_everything: 7
model:
  class_path: mylab.model.Regressor
data:
  class_path: mylab.data.Points
trainer:
  max_epochs: 2
  enable_progress_bar: false
  enable_model_summary: false
  callbacks:
    - class_path: ModelCheckpoint
      init_args:
        monitor: val_loss
        mode: min
        every_n_train_steps: 3
        save_last: true
"""


def existing_project(folder: Path) -> Path:
    """A Lightning project as its owner wrote it: ``mylab/`` and ``config.yaml``."""
    package = folder / "mylab"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "model.py").write_text(textwrap.dedent(MODEL))
    (package / "data.py").write_text(textwrap.dedent(DATA))
    (folder / "config.yaml").write_text(CONFIG)
    return folder


def steadfast(folder: Path, *args: str, check: bool = True):
    # ENGINE on the path for tests.faults only (the kill); mylab imports from the folder, as `python -m` puts it first
    return run_cli("steadfast", "fit", "--config", "config.yaml", *args, cwd=folder, pythonpath=str(ENGINE),
                   check=check)  # fmt: skip


def final_weights(folder: Path) -> dict[str, torch.Tensor]:
    (run,) = run_dirs(folder, "points")
    return torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)


def test_an_existing_lightning_project_killed_mid_epoch_resumes_exactly_with_nothing_copied(tmp_path):
    reference = existing_project(tmp_path / "reference")
    steadfast(reference)
    ref = final_weights(reference)
    assert ref["global_step"] == 24  # 96 samples in batches of 8, 2 epochs

    project = existing_project(tmp_path / "project")
    proc = steadfast(project, *kill_at(17, settle=True), check=False)  # epoch 1, batch 5: step 15's last.ckpt
    assert proc.returncode == -9, proc.stderr[-3000:]
    (run,) = run_dirs(project, "points")
    saved = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)
    assert saved["global_step"] == 15 and saved["epoch"] == 1, "precondition: a mid-epoch last.ckpt"

    proc = steadfast(project, "--ckpt_path", "last")
    line = next(x for x in proc.stdout.splitlines() if x.startswith("Run "))
    got = final_weights(project)
    delta = max((got["state_dict"][k] - v).abs().max().item() for k, v in ref["state_dict"].items())
    print(f"max |delta| {delta} | {line}")
    assert got["global_step"] == 24 and delta == 0.0
    assert got["optimizer_states"][0]["state"][0]["exp_avg"].equal(ref["optimizer_states"][0]["state"][0]["exp_avg"])
    assert "exact resume: resume verified" in line, line
    # the user's own ModelCheckpoint judged the run: its monitor is the run's, no example's val/acc
    assert "val/acc" not in proc.stdout + proc.stderr
    assert list(run.glob("checkpoints/epoch=*-step=*.ckpt")), sorted(p.name for p in run.rglob("*.ckpt"))
