"""An existing project's files stay its own: a ``ModelCheckpoint`` that names its best file ``last.ckpt`` keeps it (the
engine's own last checkpoint takes another name, said in the start line), and a logger whose ``save_dir`` the project
links from a data argument decides the run folder, one per command, never one that holds an earlier run's files.

The project is the one an adopter wrote: its own ``LightningCLI`` subclass (one import changed to the engine's), a
``ModelCheckpoint`` added with ``add_lightning_class_args``, a ``CSVLogger`` and a link into its ``save_dir``."""

import csv
import hashlib
import textwrap
from pathlib import Path

import pytest
import torch
from jsonargparse import Namespace

from lightkeep.runs import family_dir
from lightkeep.testing import run_cli

MODEL = """
import lightning as L
import torch
from torch import nn


class Regressor(L.LightningModule):
    def __init__(self, hidden: int = 16, lr: float = 0.02) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(4, hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x).squeeze(-1), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.net(x).squeeze(-1), y))

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=self.hparams.lr)
        # from epoch 4 on, a step up the gradient: the best epoch is one before the last
        return [optimizer], [torch.optim.lr_scheduler.LambdaLR(optimizer, lambda epoch: 1.0 if epoch < 4 else -0.5)]
"""

DATA = """
import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset


class Points(L.LightningDataModule):
    def __init__(self, model_dir: str = "models", batch_size: int = 8) -> None:
        super().__init__()
        self.model_dir, self.batch_size = model_dir, batch_size

    def setup(self, stage: str) -> None:
        self.train_set, self.val_set = points()

    def train_dataloader(self):
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self):
        return DataLoader(self.val_set, batch_size=self.batch_size)


def points():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(120, 4, generator=g)
    y = x @ torch.tensor([1.0, -2.0, 0.5, 3.0]) + 0.1 * torch.randn(120, generator=g)
    return TensorDataset(x[:96], y[:96]), TensorDataset(x[96:], y[96:])
"""

# The project's script: its best checkpoint is named last.ckpt; its CSV logs go under the data's model_dir
MAIN = """
from lightning.pytorch.callbacks import ModelCheckpoint
from lightkeep import LightningCLI

from mylab.data import Points
from mylab.model import Regressor


class LabCLI(LightningCLI):
    def add_arguments_to_parser(self, parser):
        parser.add_lightning_class_args(ModelCheckpoint, "checkpoint")
        parser.set_defaults({"checkpoint.filename": "last", "checkpoint.save_last": False,
                             "checkpoint.monitor": "val_loss", "checkpoint.mode": "min"})
        parser.link_arguments("data.model_dir", "trainer.logger.init_args.save_dir", apply_on="APPLY_ON")


if __name__ == "__main__":
    LabCLI(Regressor, Points, trainer_defaults={"logger": {"class_path": "CSVLogger"}})
"""

QUIET = ["--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false"]


def adopters_project(folder: Path, apply_on: str = "parse") -> Path:
    package = folder / "mylab"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "model.py").write_text(textwrap.dedent(MODEL))
    (package / "data.py").write_text(textwrap.dedent(DATA))
    (folder / "main.py").write_text(textwrap.dedent(MAIN).replace("APPLY_ON", apply_on))
    return folder


def main(folder: Path, *args: str):
    # warnings shown: Lightning's about a log folder that holds files is one
    return run_cli("main.py", *args, *QUIET, cwd=folder, env={"PYTHONWARNINGS": "default"})


def fit(folder: Path, *args: str):
    return main(folder, "fit", "--seed_everything", "7", *args)


def start_line(proc) -> str:
    return next(line for line in proc.stdout.splitlines() if line.startswith("Run "))


def run_folder(project: Path, version: int) -> Path:
    """The project's run ``version`` of its data, ``points``, wherever its logs went (``runs/``, its ``models/``)."""
    (run,) = project.glob(f"*/points/version_{version}")
    return run


def load(path: Path) -> dict:
    return torch.load(path, weights_only=True)


def test_the_folder_a_project_gives_its_logger_is_where_its_runs_go_and_the_engines_placeholders_are_not():
    def family(save_dir=None, name="lightning_logs", version=None, root="runs", run_name=None) -> Path:
        logger = Namespace(class_path="CSVLogger", init_args=Namespace(save_dir=save_dir, name=name, version=version))
        return family_dir(Namespace(run=Namespace(root=root, name=run_name), data=Namespace(class_path="my.Points"),
                                    trainer=Namespace(logger=logger, default_root_dir=None)))  # fmt: skip

    assert family() == Path("runs") / "points"  # a save_dir linked at instantiation: known later (LoggerFolder)
    assert family("models") == Path("models") / "points"
    assert family("models", "exp") == Path("models") / "exp"
    assert family("runs") == Path("runs") / "points"  # configs/csv.yaml's: there only because CSVLogger needs one
    assert family("old", "points", version=3) == Path("runs") / "points"  # a run's config.yaml, read back
    assert family("/scratch", root="/scratch") == Path("/scratch") / "points"
    with pytest.raises(ValueError, match=r"^run.root elsewhere and trainer.logger's save_dir models both say"):
        family("models", root="elsewhere")
    with pytest.raises(ValueError, match=r"^run.name other and trainer.logger's name exp both name the runs"):
        family(name="exp", run_name="other")


@pytest.fixture(scope="module")
def weights_at_epoch_3(tmp_path_factory) -> dict:
    """An independent oracle: the weights another fit, of epochs 0-3 only, ends epoch 3 with."""
    project = adopters_project(tmp_path_factory.mktemp("reference"))
    fit(project, "--trainer.max_epochs", "4")
    checkpoint = load(run_folder(project, 0) / "checkpoints" / "epoch003.ckpt")
    assert checkpoint["global_step"] == 48, "precondition: 4 epochs of 12 batches"
    return checkpoint


@pytest.mark.slow
# the default timer's case is also in make test's test_adopted_project (the same project shape): long here
@pytest.mark.parametrize(
    "last_every",
    [pytest.param("0:10:00", marks=pytest.mark.long), "0:00:00.01"],
    ids=["default_timer", "timer_every_batch"],
)
def test_a_best_file_the_project_names_last_ckpt_is_never_written_by_the_engine(
    tmp_path, weights_at_epoch_3, last_every
):
    project = adopters_project(tmp_path)
    proc = fit(project, "--trainer.max_epochs", "6", "--checkpoints.last_every", last_every)
    run = run_folder(project, 0)
    theirs, ours = run / "checkpoints" / "last.ckpt", run / "checkpoints" / "last-lightkeep.ckpt"

    # the project's file holds its best epoch, 3, as the metrics say and as another fit of epochs 0-3 ends it
    best = load(theirs)
    with open(run / "metrics.csv") as f:
        scores = {int(r["epoch"]): float(r["val_loss"]) for r in csv.DictReader(f) if r["val_loss"] and r["epoch"]}
    assert min(scores, key=scores.get) == 3 and max(scores) == 5, (
        f"precondition: the best epoch is not the last {scores}"
    )
    assert (best["epoch"], best["global_step"]) == (3, 48), (best["epoch"], best["global_step"])
    assert all(best["state_dict"][k].equal(v) for k, v in weights_at_epoch_3["state_dict"].items())
    # under its own name, none other (Lightning's last-v1.ckpt), and as the callback recorded its best
    assert sorted(p.name for p in run.glob("checkpoints/last*")) == ["last-lightkeep.ckpt", "last.ckpt"]
    record = next(
        s for k, s in load(ours)["callbacks"].items() if k.startswith("ModelCheckpoint{'monitor': 'val_loss'")
    )
    assert Path(record["best_model_path"]).name == "last.ckpt"
    assert float(record["best_model_score"]) == pytest.approx(scores[3])
    # the engine's file is the end of the fit, and the start line said where it went
    assert load(ours)["global_step"] == 72
    assert f"the engine's last checkpoint is {ours.relative_to(project)}" in start_line(proc), start_line(proc)

    proc = fit(project, "--trainer.max_epochs", "7", "--ckpt_path", "last")
    assert f"continues from step 72 of {ours.relative_to(project)}" in start_line(proc), start_line(proc)
    assert load(ours)["global_step"] == 84 and load(theirs)["global_step"] == 48  # epoch 6 was no better

    proc = main(project, "validate", "--ckpt_path", "best")
    assert f"(validate of {theirs.relative_to(project)}, step 48)" in start_line(proc), start_line(proc)
    with open(run_folder(project, 1) / "metrics.csv") as f:
        (row,) = list(csv.DictReader(f))
    assert float(row["val_loss"]) == pytest.approx(float(record["best_model_score"]), rel=1e-6)


def hashes(folder: Path) -> dict[Path, str]:
    return {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.slow
# a link applied at parsing is also in make test's test_adopted_project: long here
@pytest.mark.parametrize(
    ("apply_on", "weights"),
    [pytest.param("parse", "best", marks=pytest.mark.long), ("instantiate", "my_models/points/version_0")],
)
def test_a_logger_folder_the_project_links_is_the_run_folder_and_no_command_reuses_one(tmp_path, apply_on, weights):
    project = adopters_project(tmp_path, apply_on)
    proc = fit(project, "--trainer.max_epochs", "2", "--data.model_dir", "my_models")
    run = project / "my_models" / "points" / "version_0"
    assert start_line(proc).startswith(f"Run {run.relative_to(project)} (fresh)"), start_line(proc)
    assert (run / "metrics.csv").is_file() and (run / "checkpoints" / "last.ckpt").is_file()
    assert (run / "config.yaml").is_file() and not (project / "runs").exists() and not (project / "models").exists()

    earlier = hashes(project / "my_models")
    for version in (1, 2):
        proc = main(project, "validate", "--data.model_dir", "my_models", "--ckpt_path", weights)
        evaluation = project / "my_models" / "points" / f"version_{version}"
        assert start_line(proc).startswith(f"Run {evaluation.relative_to(project)} (validate of "), start_line(proc)
        assert (evaluation / "metrics.csv").is_file(), sorted(evaluation.parent.rglob("*"))
        assert "exists and is not empty" not in proc.stdout + proc.stderr
        assert {p: h for p, h in hashes(project / "my_models").items() if p in earlier} == earlier
        earlier = hashes(project / "my_models")
    assert not (project / "runs").exists() and not (project / "models").exists()
