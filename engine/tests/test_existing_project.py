"""An existing Lightning project adopts the engine with nothing copied: its own package (a module and a data module
written from Lightning's docs, no import of the engine or the template), its own config with its own callbacks list,
and ``python -m lightkeep fit`` run in its folder; or its own ``main.py`` (a ``LightningCLI`` subclass of fixed
classes that links an argument, and the config Lightning printed for it) with the one import changed. Killed with
SIGKILL mid-epoch, ``fit --ckpt_path last`` ends with the weights of the uninterrupted run, bit for bit."""

import textwrap
from pathlib import Path

import pytest
import torch

from lightkeep.testing import run_cli, run_dirs
from tests.faults import kill_at
from tests.helpers import ENGINE

pytestmark = pytest.mark.slow

MODEL = """
import lightning as L
import torch
from torch import nn


class Regressor(L.LightningModule):
    def __init__(self, features: int, hidden: int = 16, lr: float = 1e-2) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(features, hidden), nn.ReLU(), nn.Dropout(0.1), nn.Linear(hidden, 1))

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
        self.batch_size, self.features = batch_size, 4

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
  init_args:
    features: 4
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


# The project's own script: Lightning's CLI of its two classes, the module's `features` linked from the data's.
MAIN = """
from lightning.pytorch.cli import LightningCLI

from mylab.data import Points
from mylab.model import Regressor


class LabCLI(LightningCLI):
    def add_arguments_to_parser(self, parser):
        parser.link_arguments("data.features", "model.features", apply_on="instantiate")


if __name__ == "__main__":
    LabCLI(Regressor, Points)
"""


def lightkeep(folder: Path, *args: str, check: bool = True):
    # ENGINE on the path for tests.faults only (the kill); mylab imports from the folder, as `python -m` puts it first
    return run_cli("lightkeep", "fit", "--config", "config.yaml", *args, cwd=folder, pythonpath=str(ENGINE),
                   check=check)  # fmt: skip


def final_weights(folder: Path) -> dict[str, torch.Tensor]:
    (run,) = run_dirs(folder, "points")
    return torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)


def resumed_as(project: Path, ref: dict, proc) -> None:
    """The resumed run ``proc`` ended with the uninterrupted run's weights and optimizer state, its first batch
    verified."""
    line = next(x for x in proc.stdout.splitlines() if x.startswith("Run "))
    got = final_weights(project)
    delta = max((got["state_dict"][k] - v).abs().max().item() for k, v in ref["state_dict"].items())
    print(f"max |delta| {delta} | {line}")
    assert got["global_step"] == 24 and delta == 0.0
    assert got["optimizer_states"][0]["state"][0]["exp_avg"].equal(ref["optimizer_states"][0]["state"][0]["exp_avg"])
    assert "exact resume: resume verified" in line, line


def test_an_existing_lightning_project_killed_mid_epoch_resumes_exactly_with_nothing_copied(tmp_path):
    reference = existing_project(tmp_path / "reference")
    lightkeep(reference)
    ref = final_weights(reference)
    assert ref["global_step"] == 24  # 96 samples in batches of 8, 2 epochs

    project = existing_project(tmp_path / "project")
    proc = lightkeep(project, *kill_at(17, settle=True), check=False)  # epoch 1, batch 5: step 15's last.ckpt
    assert proc.returncode == -9, proc.stderr[-3000:]
    (run,) = run_dirs(project, "points")
    saved = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)
    assert saved["global_step"] == 15 and saved["epoch"] == 1, "precondition: a mid-epoch last.ckpt"

    proc = lightkeep(project, "--ckpt_path", "last")
    resumed_as(project, ref, proc)
    # the user's own ModelCheckpoint judged the run: its monitor is the run's, no example's val/acc
    assert "val/acc" not in proc.stdout + proc.stderr
    assert list(run.glob("checkpoints/epoch=*-step=*.ckpt")), sorted(p.name for p in run.rglob("*.ckpt"))


def its_own_script(folder: Path) -> Path:
    """The project with its ``main.py`` and the config plain Lightning printed for it (no class paths: the classes
    are the script's), then the script's one import changed to the engine's."""
    existing_project(folder)
    (folder / "config.yaml").unlink()
    main = folder / "main.py"
    main.write_text(textwrap.dedent(MAIN))
    monitored = ["--trainer.callbacks+=ModelCheckpoint", "--trainer.callbacks.monitor=val_loss",
                 "--trainer.callbacks.every_n_train_steps=3", "--trainer.callbacks.save_last=true"]  # fmt: skip
    printed = run_cli("main.py", "fit", "--print_config", "--seed_everything", "7", "--trainer.max_epochs", "2",
                      "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false", *monitored,
                      cwd=folder).stdout  # fmt: skip
    assert "class_path: mylab" not in printed and "lightkeep" not in printed, printed
    (folder / "config.yaml").write_text(printed)
    main.write_text(main.read_text().replace("from lightning.pytorch.cli import", "from lightkeep import"))
    return folder


def script(folder: Path, *args: str, check: bool = True):
    return run_cli("main.py", "fit", "--config", "config.yaml", *args, cwd=folder, pythonpath=str(ENGINE),
                   check=check)  # fmt: skip


@pytest.mark.long  # ~40 s; make test adopts an existing project once, above
def test_a_projects_own_lightning_cli_script_with_a_link_keeps_its_config_and_resumes_exactly(tmp_path, monkeypatch):
    reference = its_own_script(tmp_path / "reference")
    # without its script, the config names no class, and the classes named need the linked value: each said so
    proc = lightkeep(reference, check=False)
    assert proc.returncode == 2 and "config.yaml: no model class is named for 'hidden'" in proc.stderr, proc.stderr
    classes = ["--model", "mylab.model.Regressor", "--data", "mylab.data.Points"]
    proc = run_cli("lightkeep", "fit", *classes, "--config", "config.yaml", cwd=reference, check=False)
    assert proc.returncode == 2 and "mylab.model.Regressor needs features" in proc.stderr, proc.stderr
    assert not (reference / "runs").exists()
    # the commands the engine prints are the script's
    proc = script(reference, "--ckpt_path", "best", check=False)
    assert proc.returncode == 2 and "(python main.py fit)" in proc.stderr, proc.stderr[-2000:]
    script(reference)
    ref = final_weights(reference)
    assert ref["global_step"] == 24 and ref["hyper_parameters"]["features"] == 4  # the link applied

    project = its_own_script(tmp_path / "project")
    proc = script(project, *kill_at(17, settle=True), check=False)
    assert proc.returncode == -9, proc.stderr[-3000:]
    resumed_as(project, ref, script(project, "--ckpt_path", "last"))
    # its config names no class to export: a config naming the module's class does, its arguments from the checkpoint
    from lightkeep.export.formats import load_checkpoint_module

    monkeypatch.syspath_prepend(str(project))
    (run,) = run_dirs(project, "points")
    with pytest.raises(ValueError, match=r"give --config FILE with model: your\.Net"):
        load_checkpoint_module(run / "checkpoints" / "last.ckpt")
    (project / "export.yaml").write_text("model: mylab.model.Regressor\n")
    module, _, _ = load_checkpoint_module(run / "checkpoints" / "last.ckpt", project / "export.yaml")
    assert module.hparams.features == 4 and all(module.state_dict()[k].equal(v) for k, v in ref["state_dict"].items())


def test_a_scripts_parser_kwargs_and_trainer_defaults_go_where_lightnings_cli_puts_them(tmp_path, monkeypatch):
    """A script's other LightningCLI arguments, as Lightning's docs teach them: ``parser_kwargs={"default_env":
    True}`` reads the Trainer's settings from the environment, and ``trainer_defaults`` holds a logger and
    callbacks. Each takes effect as in plain Lightning's CLI (the oracle, run beside it); the defaults' progress bar
    is the run's only one and their ModelCheckpoint judges the run, as one in the config would."""
    import sys

    from lightning.pytorch.callbacks import ModelCheckpoint, ProgressBar, TQDMProgressBar
    from lightning.pytorch.cli import LightningCLI as PlainCLI

    from lightkeep import LightningCLI
    from tests.fixtures.kinds import Classify, KindData

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["main.py"])
    monkeypatch.setenv("PL_FIT__TRAINER__MAX_EPOCHS", "2")
    built = {}
    for name, cls in (("plain", PlainCLI), ("lightkeep", LightningCLI)):
        bar, best = TQDMProgressBar(refresh_rate=5), ModelCheckpoint(monitor="val/acc", mode="max")
        cli = cls(Classify, KindData, args=["fit", "--trainer.enable_model_summary", "false"],
                  parser_kwargs={"default_env": True},
                  trainer_defaults={"logger": False, "callbacks": [bar, best]})  # fmt: skip
        built[name] = cli, best
        bars = [c for c in cli.trainer.callbacks if isinstance(c, ProgressBar)]
        assert bars == [bar], (name, bars)
        assert cli.trainer.logger is None and best in cli.trainer.callbacks
    (plain, _), (ours, best) = built["plain"], built["lightkeep"]
    assert plain.trainer.max_epochs == ours.trainer.max_epochs == 2 and ours.trainer.current_epoch == 2
    assert ours.judge is best and best.best_model_path, "the defaults' ModelCheckpoint judged and saved the run"
