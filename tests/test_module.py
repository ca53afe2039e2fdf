"""The LightningModule on its own: shapes, one optimization step, argument checks."""

import lightning as L
import pytest
import torch

from project.data import DigitsDataModule
from project.module import Classifier
from project.nets import CNN, MLP


@pytest.mark.parametrize("net", [MLP(), CNN()])
def test_nets_map_digit_images_to_logits(net):
    assert net(torch.rand(5, 1, 8, 8)).shape == (5, 10)


@pytest.mark.parametrize("net_class", [MLP, CNN])
def test_a_few_real_steps_reduce_the_loss(net_class, tmp_path):
    torch.manual_seed(0)
    model = Classifier(net_class(dropout=0.0), lr=1e-2, warmup=0, max_schedule=3)
    dm = DigitsDataModule(batch_size=128)
    dm.setup("fit")
    x, y = dm.splits["train"].tensors
    before = torch.nn.functional.cross_entropy(model(x), y).item()
    trainer = L.Trainer(
        max_epochs=3, limit_val_batches=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=tmp_path,
    )  # fmt: skip
    trainer.fit(model, dm)
    after = torch.nn.functional.cross_entropy(model(x), y).item()
    assert trainer.global_step == 3 * len(dm.train_dataloader()) == 30
    assert after < 0.7 * before


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"lr": -0.1}, r"lr \(-0.1\) must be > 0"),
        ({"weight_decay": -1.0}, "weight_decay"),
        ({"warmup": 20, "max_schedule": 10}, r"warmup \(20\) must be <= max_schedule \(10\)"),
        ({"interval": "epoch", "schedule_unit": "step"}, "schedule_unit='epoch'"),
    ],
)
def test_invalid_arguments_fail_at_construction(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Classifier(MLP(), **kwargs)


def test_warmup_longer_than_training_fails_before_the_first_step(tmp_path):
    trainer = L.Trainer(max_epochs=2, logger=False, enable_checkpointing=False, default_root_dir=tmp_path)
    with pytest.raises(ValueError, match=r"warmup \(15\) must be <= max_schedule \(2 epochs\)"):
        trainer.fit(Classifier(MLP()), DigitsDataModule())
    assert trainer.global_step == 0
