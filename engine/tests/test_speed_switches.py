"""The GPU speed switches (configs/gpu.yaml) on CPU: they run, and change nothing a checkpoint records."""

import functools

import lightning as L
import pytest
import torch

from lightkeep.schedule import FitScheduleToRun
from lightkeep.speed.switches import Compile, MatmulPrecision
from tests.fixtures.stand_in import BlobsDataModule, StandIn
from tests.helpers import QUIET, REPO, cli, run_dirs, scalars

pytestmark = pytest.mark.slow  # real runs of the CLI in subprocesses


def test_compile_and_matmul_precision_are_set_for_the_run_and_keep_checkpoint_keys(tmp_path):
    before = torch.get_float32_matmul_precision()
    other = "medium" if before != "medium" else "high"
    plain, fast = StandIn(), StandIn()
    seen = []

    class Probe(L.Callback):
        def on_train_start(self, trainer, pl_module):
            seen.append(torch.get_float32_matmul_precision())

    trainer = L.Trainer(
        max_steps=2, limit_val_batches=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=tmp_path,
        callbacks=[Compile(), MatmulPrecision(other), Probe(), FitScheduleToRun()],
    )  # fmt: skip
    trainer.fit(fast, BlobsDataModule())
    assert fast.net._compiled_call_impl is not None and fast.metrics["val_acc"]._compiled_call_impl is None
    assert seen == [other] and torch.get_float32_matmul_precision() == before  # for the run only
    assert list(fast.state_dict()) == list(plain.state_dict())  # no "_orig_mod." prefix


@pytest.mark.long  # CI and make test-all; the GPU overlay on CPU: ~40 s
@pytest.mark.slow
def test_gpu_config_trains_on_cpu_and_its_checkpoint_validates_in_a_plain_run(tmp_path):
    # bf16-mixed autocast, a compiled net, loader workers with pinned memory, all through the real CLI.
    gpu = ["--config", str(REPO / "configs" / "gpu.yaml"), "--trainer.accelerator", "cpu"]
    short = [
        "--trainer.max_epochs",
        "2",
        "--trainer.limit_train_batches",
        "10",
        "--model.warmup",
        "1",
        "--trainer.log_every_n_steps",
        "1",
    ]  # every step: the curves are compared step by step
    cli("fit", *QUIET, *short, cwd=tmp_path)  # the reference: float32, uncompiled, no workers
    cli("fit", *QUIET, *gpu, *short, cwd=tmp_path, timeout=600)
    reference, run = run_dirs(tmp_path)
    logged = scalars(run)
    losses = [v for _, v in logged["train/loss"]]
    reference_losses = [v for _, v in scalars(reference)["train/loss"]]
    # Same batches, same dropout masks, same steps: the curves differ only by bfloat16 rounding.
    assert len(losses) == len(reference_losses) == 20
    assert losses == pytest.approx(reference_losses, rel=0.05)
    # The same weights evaluated in float32 by an uncompiled net: the number bf16 reported, to bf16's precision.
    cli("validate", *QUIET, "--ckpt_path", str(run / "checkpoints" / "last.ckpt"), cwd=tmp_path)
    validated = run_dirs(tmp_path)[-1]
    assert validated not in (reference, run)
    [(_, plain_acc)] = scalars(validated)["val/acc"]
    assert plain_acc == pytest.approx(logged["val/acc"][-1][1], abs=0.02)


def test_speed_settings_hold_with_the_users_own_callbacks_list(tmp_path, capsys, monkeypatch):
    """``speed:`` is a setting, not a callback a user's ``trainer.callbacks`` list replaces: with a list of their
    own, the switches asked for are on (named in the start line), once each, and for the run only. The matmul
    precision is set before the Trainer is built, whose GPU set-up would otherwise advise setting it."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from tests.helpers import cli_in_process

    before = torch.get_float32_matmul_precision()
    other = "medium" if before != "medium" else "high"
    own = ["--trainer.callbacks", '[{"class_path": "lightning.pytorch.callbacks.ModelCheckpoint", '
           '"init_args": {"every_n_train_steps": 1}}]']  # fmt: skip
    at_the_trainer = []  # the precision Lightning's GPU set-up reads (it advises setting it when "highest")
    real_init = L.Trainer.__init__

    @functools.wraps(real_init)  # the same signature for the CLI's parser
    def init(self, *args, **kwargs):
        at_the_trainer.append(torch.get_float32_matmul_precision())
        real_init(self, *args, **kwargs)

    monkeypatch.setattr(L.Trainer, "__init__", init)
    cli = cli_in_process("fit", *own, "--speed.matmul_precision", other, "--trainer.max_steps", "2",
                         "--trainer.limit_val_batches", "1", *QUIET, root=tmp_path)  # fmt: skip
    assert at_the_trainer == [other]
    kinds = [type(c).__name__ for c in cli.trainer.callbacks]
    assert kinds.count("MatmulPrecision") == 1 and kinds.count("KeepFreedHostMemory") == 1, kinds
    assert any(type(c) is ModelCheckpoint and c._every_n_train_steps == 1 for c in cli.trainer.callbacks)
    assert f"float32 matmuls at '{other}' precision" in capsys.readouterr().out
    assert torch.get_float32_matmul_precision() == before
