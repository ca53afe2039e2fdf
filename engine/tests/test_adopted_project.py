"""A research project nobody here wrote, adopted with one import: its own ``LightningCLI`` subclass in omegaconf mode
with its own ``Trainer`` subclass, a ``ModelCheckpoint`` added by ``add_lightning_class_args`` whose best file is
named ``last``, links (one sends a data argument to the CSV logger's ``save_dir``), the data section in a file of its
own (``--data data.yaml``), a module that logs nothing during the sanity check and an ``EarlyStopping`` on what it
logs after it. Plain Lightning runs it; so must the engine, keeping every file the project owns and adding its
guarantees: killed with SIGKILL mid-epoch, ``--ckpt_path last`` ends bit-equal to the uninterrupted run."""

import hashlib
import textwrap
from pathlib import Path

import pytest
import torch

from lightkeep.testing import run_cli
from tests.faults import kill_at
from tests.helpers import ENGINE

pytestmark = pytest.mark.slow

MODEL = """
import lightning as L
import torch
from torch import nn


class Net(L.LightningModule):
    def __init__(self, num_classes: int = 2, hidden: int = 16, lr: float = 5e-2, ascend_from: int = 99) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(6, hidden), nn.ReLU(), nn.Linear(hidden, num_classes))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self.net(x)
        if not self.trainer.sanity_checking:  # as many projects do: no numbers from the sanity check
            self.log("val_loss", nn.functional.cross_entropy(logits, y))
            self.log("val_accuracy", (logits.argmax(-1) == y).float().mean())

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)
        # from epoch `ascend_from` on the loss climbs: the best epoch is not the last (what the test needs)
        ascend = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda e: 1.0 if e < self.hparams.ascend_from else -1.0)
        return {"optimizer": optimizer, "lr_scheduler": ascend}
"""

DATA = """
import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset


class Bundled(L.LightningDataModule):
    def __init__(self, model_dir: str = "models", batch_size: int = 8) -> None:
        super().__init__()
        self.model_dir, self.batch_size, self.num_classes = model_dir, batch_size, 3

    def setup(self, stage: str) -> None:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(160, 6, generator=g)
        y = (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()
        self.train_set, self.val_set = TensorDataset(x[:128], y[:128]), TensorDataset(x[128:], y[128:])

    def train_dataloader(self):
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self):
        return DataLoader(self.val_set, batch_size=self.batch_size)
"""

MAIN = """
import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint
from lightkeep import LightningCLI  # was: from lightning.pytorch.cli import LightningCLI

from lab.data import Bundled
from lab.model import Net


class LabTrainer(L.Trainer):
    pass


class LabCLI(LightningCLI):
    def add_arguments_to_parser(self, parser):
        parser.add_lightning_class_args(ModelCheckpoint, "checkpoint")
        parser.set_defaults({"checkpoint.monitor": "val_accuracy", "checkpoint.mode": "max",
                             "checkpoint.filename": "last", "checkpoint.save_last": False})
        parser.link_arguments("data.num_classes", "model.num_classes", apply_on="instantiate")
        parser.link_arguments("data.model_dir", "trainer.logger.init_args.save_dir")


if __name__ == "__main__":
    LabCLI(Net, Bundled, trainer_class=LabTrainer, seed_everything_default=11,
           parser_kwargs={"parser_mode": "omegaconf"})
"""

CONFIG = """
model:
  ascend_from: 2
trainer:
  max_epochs: 3
  enable_progress_bar: false
  enable_model_summary: false
  logger:
    class_path: lightning.pytorch.loggers.CSVLogger
    init_args:
      name: lab
  callbacks:
    - class_path: lightning.pytorch.callbacks.EarlyStopping
      init_args:
        monitor: val_loss
        patience: 5
"""

DATA_YAML = """
model_dir: models
batch_size: 8
"""

STEPS = 48  # 128 samples in batches of 8, 3 epochs


def lab(folder: Path) -> Path:
    package = folder / "lab"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "model.py").write_text(textwrap.dedent(MODEL))
    (package / "data.py").write_text(textwrap.dedent(DATA))
    (folder / "main.py").write_text(textwrap.dedent(MAIN))
    (folder / "config.yaml").write_text(CONFIG)
    (folder / "data.yaml").write_text(DATA_YAML)
    return folder


def main(folder: Path, command: str, *args: str, check: bool = True):
    # ENGINE on the path for tests.faults only (the kill)
    return run_cli("main.py", command, "--config", "config.yaml", "--data", "data.yaml", *args, cwd=folder,
                   pythonpath=str(ENGINE), check=check)  # fmt: skip


def hashes(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() and "__pycache__" not in p.parts}  # fmt: skip


def run_folders(folder: Path) -> list[Path]:
    """Every folder below ``folder`` that holds a file of a run (a checkpoint, metrics, a config)."""
    marks = ("*.ckpt", "metrics.csv", "hparams.yaml")
    return sorted({p.parent.parent if p.parent.name == "checkpoints" else p.parent
                   for mark in marks for p in folder.rglob(mark)})  # fmt: skip


def users_best(folder: Path) -> tuple[Path, dict]:
    """The project's own ModelCheckpoint's best file, and what the callback recorded of it."""
    state = next(
        v
        for k, v in engine_last(folder)["callbacks"].items()
        if k.startswith("ModelCheckpoint") and "val_accuracy" in k
    )
    return folder / state["best_model_path"], state  # relative to where the run started, or absolute


def engine_last(folder: Path) -> dict:
    """The newest full-state checkpoint under ``folder`` (the furthest step, then the newest file): what
    ``--ckpt_path last`` resumes from."""
    files = [p for p in folder.rglob("*.ckpt") if p.is_file()]
    loaded = [(torch.load(p, weights_only=True), p.stat().st_mtime_ns) for p in files]
    full = [(c["global_step"], t, i) for i, (c, t) in enumerate(loaded) if "optimizer_states" in c]
    return loaded[max(full)[2]][0]


def epoch_values(run: Path, key: str) -> dict[int, float]:
    """``key`` per step of validation in a run's ``metrics.csv`` (the CSV logger's own record)."""
    import csv

    rows = list(csv.DictReader((run / "metrics.csv").open()))
    return {int(r["step"]): float(r[key]) for r in rows if r.get(key)}


def test_an_adopted_project_keeps_its_files_folders_and_resumes_exactly(tmp_path):
    reference = lab(tmp_path / "reference")
    sources = hashes(reference)  # what the project's owner wrote
    proc = main(reference, "fit")
    assert "Run summary: no ModelCheckpoint monitors" not in proc.stdout, proc.stdout[-2000:]
    (run,) = run_folders(reference)  # checkpoints and the CSV logs in one folder: the one the project linked
    assert run == reference / "models" / "lab" / "version_0", run_folders(reference)
    best_path, best = users_best(reference)
    # the user's best file, named last.ckpt, holds the best epoch by the logger's own record (not the engine's state)
    accuracy = epoch_values(run, "val_accuracy")
    best_step = max(accuracy, key=lambda step: (accuracy[step], -step))
    assert best_step < STEPS, f"precondition: the best epoch is not the last {accuracy}"
    assert best_path == run / "checkpoints" / "last.ckpt"
    kept = torch.load(best_path, weights_only=True)
    assert kept["global_step"] == best_step + 1 and best["best_model_score"] == accuracy[best_step], (kept, accuracy)
    assert not list(reference.rglob("last-v*.ckpt"))
    ref = engine_last(reference)
    assert ref["global_step"] == STEPS

    # two validates of the best: folders of their own, nothing of the fit's touched, the user's best file scored
    before = hashes(reference)
    for version in (1, 2):
        proc = main(reference, "validate", "--ckpt_path", "best")
        assert "exists and is not empty" not in proc.stdout + proc.stderr
        scored = epoch_values(reference / "models" / "lab" / f"version_{version}", "val_accuracy")
        assert list(scored.values()) == [accuracy[best_step]], (scored, accuracy)
    after = hashes(reference)
    assert {k: after[k] for k in before} == before, [k for k in before if after.get(k) != before[k]]
    assert [p.relative_to(reference) for p in run_folders(reference)] == [
        Path(f"models/lab/version_{v}") for v in range(3)
    ]

    project = lab(tmp_path / "project")
    due = ["--trainer.callbacks+=tests.faults.LastDueAt", "--trainer.callbacks.step=20"]  # the engine's timer
    proc = main(project, "fit", *due, *kill_at(23, settle=True), check=False)  # epoch 1, batch 7
    assert proc.returncode == -9, proc.stderr[-3000:]
    saved = engine_last(project)
    assert saved["epoch"] == 1 and saved["global_step"] % 16 != 0, "precondition: a mid-epoch checkpoint"
    proc = main(project, "fit", "--ckpt_path", "last")
    line = next(x for x in proc.stdout.splitlines() if x.startswith("Run "))
    assert "exact resume: resume verified" in line, line
    got = engine_last(project)
    delta = max((got["state_dict"][k] - v).abs().max().item() for k, v in ref["state_dict"].items())
    print(f"max |delta| {delta} | {line}")
    assert got["global_step"] == STEPS and delta == 0.0
    momentum = got["optimizer_states"][0]["state"][0]["momentum_buffer"]
    assert momentum.equal(ref["optimizer_states"][0]["state"][0]["momentum_buffer"])
    # the resume continued the killed run's folder: its logs and the user's best file are the uninterrupted run's
    (run,) = run_folders(project)
    assert (run / "metrics.csv").read_text() == (reference / "models/lab/version_0/metrics.csv").read_text()
    their_best = torch.load(users_best(project)[0], weights_only=True)
    assert all(their_best["state_dict"][k].equal(v) for k, v in kept["state_dict"].items())
    for folder in (reference, project):
        assert {k: hashes(folder)[k] for k in sources} == sources  # the project's own files, untouched
