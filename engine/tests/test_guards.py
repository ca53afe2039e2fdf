"""The NaN guard keeps its check on the device: a bad step is a no-op there, read by the host steps later."""

import copy

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightkeep.guards import StopOnNonFinite
from tests.fixtures.shapes import DictData, DictRegression


class FusedAdamW(DictRegression):
    """Fused AdamW: its kernel takes ``found_inf`` and skips a step on the device, as under GradScaler."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, fused=True)


class NaNAt(L.Callback):
    """NaN in the input of optimizer step ``step``; keeps the weights and optimizer state from just before it."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.before: tuple[dict, dict] | None = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:  # type: ignore[no-untyped-def]
        if trainer.global_step == self.step:
            state = copy.deepcopy(trainer.optimizers[0].state_dict())
            self.before = ({k: v.clone() for k, v in pl_module.state_dict().items()}, state)
            batch["x"][0, 0] = float("nan")


def fit(module: L.LightningModule, step: int, tmp_path, read_every: int, checkpoints: bool):
    nan = NaNAt(step)
    callbacks = [StopOnNonFinite(read_every), nan]
    if checkpoints:  # a checkpoint after every step: none may hold a step at or after the NaN
        callbacks.append(ModelCheckpoint(tmp_path, "{step}", every_n_train_steps=1, save_top_k=-1))
    trainer = L.Trainer(
        accelerator="cpu",
        max_epochs=10,
        logger=False,
        enable_checkpointing=checkpoints,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=callbacks,
    )
    torch.manual_seed(0)
    with pytest.raises(SystemExit):
        trainer.fit(module, datamodule=DictData())
    return nan


def assert_same_as_before(nan: NaNAt, module: L.LightningModule, optimizer_state: dict) -> None:
    assert nan.before is not None
    weights, state = nan.before
    for key, value in module.state_dict().items():
        assert torch.equal(value, weights[key]), key
    for index, tensors in state["state"].items():
        for name, value in tensors.items():
            assert torch.equal(optimizer_state["state"][index][name], value), (index, name)


@pytest.mark.parametrize("checkpoints", [False, True])
def test_a_nan_at_step_k_is_a_no_op_on_the_device_and_the_stop_names_k(tmp_path, capsys, checkpoints):
    module, k = FusedAdamW(), 6
    nan = fit(module, k, tmp_path, read_every=4, checkpoints=checkpoints)
    assert f"NaN or infinite at step {k} (epoch 1, batch 2)" in capsys.readouterr().err  # 4 batches an epoch
    # the host saw it later: at the next save, else at the read (steps 0, 4, 8, 12) of the copy made at the one
    # after k (step 8); the steps between changed nothing
    # (optimizer steps taken when it stopped: the save after step k's, or none at step 12's read)
    assert module.trainer.global_step == (k + 1 if checkpoints else 12), module.trainer.global_step
    assert_same_as_before(nan, module, module.trainer.optimizers[0].state_dict())
    if checkpoints:
        saved = {p.name: torch.load(p, weights_only=True) for p in tmp_path.glob("*.ckpt")}
        newest = max(saved.values(), key=lambda c: c["global_step"])
        assert newest["global_step"] == k, sorted(saved)  # the weights of step k-1, after k optimizer steps
        for key, value in newest["state_dict"].items():
            assert torch.equal(value, nan.before[0][key]), key  # type: ignore[index]


def test_an_optimizer_that_cannot_skip_on_the_device_is_read_at_every_step(tmp_path, capsys):
    module, k = DictRegression(), 5  # plain SGD: no found_inf, the bad step would change the weights
    nan = fit(module, k, tmp_path, read_every=4, checkpoints=False)
    assert f"NaN or infinite at step {k} (epoch 1, batch 1)" in capsys.readouterr().err
    assert module.trainer.global_step == k
    assert_same_as_before(nan, module, module.trainer.optimizers[0].state_dict())
