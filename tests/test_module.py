"""The LightningModule on its own: shapes, one optimization step, argument checks."""

import lightning as L
import pytest
import torch

from lightkeep.schedule import FitScheduleToRun
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
        enable_model_summary=False, default_root_dir=tmp_path, callbacks=[FitScheduleToRun()],
    )  # fmt: skip
    trainer.fit(model, dm)
    after = torch.nn.functional.cross_entropy(model(x), y).item()
    assert trainer.global_step == 3 * len(dm.train_dataloader()) == 30
    assert after < 0.7 * before


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"lr": -0.1}, r"lr \(-0.1\) must be a finite number > 0"),
        ({"lr": float("nan")}, r"lr \(nan\) must be a finite number > 0"),
        ({"lr": float("inf")}, r"lr \(inf\) must be a finite number > 0"),
        ({"weight_decay": -1.0}, "weight_decay"),
        ({"warmup": 20, "max_schedule": 10}, r"warmup \(20\) must be <= max_schedule \(10\)"),
        ({"interval": "epoch", "schedule_unit": "step"}, "schedule_unit='epoch'"),
    ],
)
def test_invalid_arguments_fail_at_construction(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Classifier(MLP(), **kwargs)


@pytest.mark.parametrize(
    ("trainer_kwargs", "warmup", "steps", "warmup_steps"),
    [
        ({"max_epochs": 1}, 15, 20, 20),  # warmup 15 epochs > the 1-epoch run: shortened to the run
        ({"fast_dev_run": 2}, 15, 2, 2),
        ({"max_epochs": -1, "max_steps": 7}, 15, 7, 7),
        ({"max_epochs": 30, "max_steps": 25}, 1, 25, 20),  # max_steps ends it first: the schedule spans 25 steps
    ],
)
def test_the_schedule_fits_a_run_shorter_than_its_warmup(trainer_kwargs, warmup, steps, warmup_steps, tmp_path):
    lrs: list[float] = []

    class RecordLR(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, *_):
            lrs.append(trainer.optimizers[0].param_groups[0]["lr"])

    trainer = L.Trainer(
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        limit_val_batches=0, default_root_dir=tmp_path, callbacks=[RecordLR(), FitScheduleToRun()], **trainer_kwargs,
    )  # fmt: skip
    model = Classifier(MLP(), lr=0.01, warmup=warmup)  # max_schedule None: the run's length
    trainer.fit(model, DigitsDataModule())
    scheduler = trainer.lr_scheduler_configs[0].scheduler
    assert trainer.global_step == steps == len(lrs)
    assert (scheduler.warmup_steps, scheduler.total_steps) == (warmup_steps, steps)
    # the closed form with the adapted horizon: linear from lr/W up to lr over the W warmup steps
    w = warmup_steps
    warmup = [0.01 / w + t * (0.01 - 0.01 / w) / max(1, w - 1) for t in range(w)]
    assert lrs[:w] == pytest.approx(warmup)
    assert all(lr < 0.01 for lr in lrs[w + 1 :])  # then the cosine decay, when the run is longer than the warmup
