"""The DataModule skeleton and a real fit through the CLI: replace them with tests of your own data."""

import pytest
import torch
import yaml

from project.data import DataModule
from project.nets import MLP
from tests.helpers import QUIET, cli


def test_splits_are_deterministic_disjoint_and_complete():
    a, b = DataModule(num_samples=100, seed=1), DataModule(num_samples=100, seed=1)
    a.setup("fit")
    b.setup("fit")
    assert {k: len(v) for k, v in a.splits.items()} == {"val": 15, "test": 15, "train": 70}
    for name in ("train", "val", "test"):
        assert torch.equal(a.splits[name].tensors[0], b.splits[name].tensors[0])
    rows = torch.cat([a.splits[n].tensors[0] for n in ("train", "val", "test")])
    assert len(torch.unique(rows, dim=0)) == 100


def test_init_has_no_side_effects_and_rejects_bad_values():
    assert DataModule().splits == {}
    with pytest.raises(ValueError, match=r"batch_size \(0\) must be >= 1"):
        DataModule(batch_size=0)
    with pytest.raises(ValueError, match="val_fraction"):
        DataModule(val_fraction=0.6, test_fraction=0.5)


def test_batches_fit_the_default_net():
    dm = DataModule(batch_size=8)
    dm.setup("fit")
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == (8, 64) and y.shape == (8,) and MLP()(x).shape == (8, 10)


def test_fit_through_the_cli_writes_a_checkpoint(tmp_path):
    cli("fit", *QUIET, "--trainer.max_epochs", "2", "--trainer.limit_train_batches", "3",
        "--trainer.limit_val_batches", "2", cwd=tmp_path)  # fmt: skip
    (run,) = tmp_path.glob("runs/*/version_0")
    assert (run / "checkpoints" / "last.ckpt").is_file()
    assert yaml.safe_load((run / "config.yaml").read_text())["data"]["class_path"].endswith(".data.DataModule")
