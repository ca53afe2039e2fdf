"""What a fit is judged by is said once (``run.monitor``/``run.mode``), and a user's own classes start from their own
defaults. On ``tests/fixtures/shapes.py``: a module that logs ``val_loss`` on dict batches, with no ``net``."""

import contextlib
import io
import sys
from unittest import mock

import pytest
import yaml

from tests.helpers import DDP2, QUIET, RUN_NAME, cli, cli_in_process, scalars

OWN = ["--model", "tests.fixtures.shapes.DictRegression", "--data", "tests.fixtures.shapes.DictData"]
SHORT = [*QUIET, "--trainer.max_epochs", "2", "--trainer.limit_val_batches", "2"]


def failure(*args: str, root) -> str:
    with pytest.raises(SystemExit) as exited:
        cli_in_process("fit", *args, root=root)
    return str(exited.value.code)


def test_a_module_that_does_not_log_the_monitored_key_stops_at_the_first_validation_in_one_line(tmp_path):
    """Judged where Lightning's callbacks judge their monitors, at the first validation after the sanity check (a
    module may skip logging during the sanity check), and before any checkpoint is written."""
    message = failure(*OWN, *SHORT, root=tmp_path)  # default.yaml monitors the example's val/acc
    assert message.startswith(
        "error: run.monitor is 'val/acc', which the module did not log by the end of the first validation "
        "(it logs: train_loss, val_loss): monitor one of those (--run.monitor KEY --run.mode min|max), or none "
        "(--run.monitor null), or self.log('val/acc', ...) in the module (raised at "
    ), message
    assert "\n" not in message
    assert not list(tmp_path.glob("dict/*/checkpoints/*.ckpt"))


def test_without_a_sanity_check_the_first_validation_stops_it_before_any_checkpoint(tmp_path):
    message = failure(*OWN, *SHORT, "--trainer.num_sanity_val_steps", "0", root=tmp_path)
    assert "by the end of the first validation (it logs: train_loss, val_loss)" in message, message
    assert not list(tmp_path.glob("dict/*/checkpoints/*.ckpt"))


def test_a_user_added_early_stopping_is_checked_alike(tmp_path):
    stop = ["--trainer.callbacks+=EarlyStopping", "--trainer.callbacks.monitor=val/mse"]
    message = failure(*OWN, *SHORT, "--run.monitor", "val_loss", *stop, root=tmp_path)
    assert message.startswith(
        "error: the monitor of a EarlyStopping in trainer.callbacks is 'val/mse', which the module did not log by "
        "the end of the first validation (it logs: train_loss, val_loss): change that monitor to one of those"
    ), message


def test_run_monitor_picks_the_best_checkpoints_and_null_keeps_none(tmp_path, capsys):
    fit = cli_in_process("fit", *OWN, *SHORT, "--run.monitor", "val_loss", "--run.mode", "min", root=tmp_path)
    run = tmp_path / "dict" / "version_0"
    best = sorted(p.name for p in (run / "checkpoints").glob("best-*.ckpt"))
    steps = fit.trainer.global_step // 2  # per epoch
    assert best == [f"best-epoch000-step{steps}.ckpt", f"best-epoch001-step{2 * steps}.ckpt"], best
    (checkpoint,) = [c for c in fit.trainer.checkpoint_callbacks if getattr(c, "monitor", None)]
    assert (checkpoint.monitor, checkpoint.mode, checkpoint.save_top_k) == ("val_loss", "min", 3)
    assert f"Run summary: best val_loss {checkpoint.best_model_score.item():.4f}" in capsys.readouterr().out
    cli_in_process("fit", *OWN, *SHORT, "--run.monitor", "null", root=tmp_path)
    names = sorted(p.name for p in (tmp_path / "dict" / "version_1" / "checkpoints").glob("*.ckpt"))
    assert names == ["epoch001.ckpt", "last.ckpt"], names


def test_patience_stops_early_on_run_monitor_and_needs_one(tmp_path, capsys):
    fit = cli_in_process(
        "fit", *OWN, *SHORT, "--trainer.max_epochs", "20", "--model.lr", "1e-9",  # no improvement to speak of
        "--run.monitor", "train_loss", "--run.mode", "max", "--run.patience", "1", "--trainer.num_sanity_val_steps",
        "0", root=tmp_path,
    )  # fmt: skip
    assert fit.trainer.current_epoch < 19 and fit.trainer.should_stop
    assert failure(*OWN, "--run.monitor", "null", "--run.patience", "3", root=tmp_path) == "2"  # before any run
    message = capsys.readouterr().err
    assert "error: run.patience (3) stops on run.monitor, which is null: give --run.monitor KEY" in message, message


@pytest.mark.parametrize("given", ["flags", "config file"])
def test_switching_classes_starts_from_that_classs_own_defaults_and_the_command_line(tmp_path, given):
    out = io.StringIO()
    from tests.helpers import cli_main

    switch = OWN
    if given == "config file":  # the classes named in a --config file, as a user's own base config would
        mine = tmp_path / "mine.yaml"
        mine.write_text(
            "model:\n  class_path: tests.fixtures.shapes.DictRegression\ndata: tests.fixtures.shapes.DictData\n"
        )
        switch = ["--config", str(mine)]
    with contextlib.redirect_stdout(out), mock.patch.object(sys, "argv", ["project"]), pytest.raises(SystemExit):
        cli_main(["fit", *switch, "--model.hidden", "5", "--print_config"])
    config = yaml.safe_load(out.getvalue())
    assert config["model"] == {"class_path": "tests.fixtures.shapes.DictRegression", "init_args": {"hidden": 5,
                               "lr": 0.05}}  # fmt: skip
    assert config["data"] == {"class_path": "tests.fixtures.shapes.DictData", "init_args": {"batch_size": 16,
                              "samples": 64}}  # fmt: skip


@pytest.mark.slow  # DDP: a subprocess
@pytest.mark.parametrize(
    "data",
    [[], pytest.param(["--data", "tests.fixtures.slow_net.SlowToFail"], marks=pytest.mark.long)],
    ids=["prompt", "slow_rank0"],
)
def test_an_error_raised_on_every_rank_is_said_once_and_leaves_no_run_folder(tmp_path, data):
    # 1 test sample for 2 ranks: the engine's sampler refuses it alike on both. slow_rank0: rank 0 ends 7 s after
    # rank 1, past Lightning's observer's 5 s poll, which once SIGKILLed it mid-message (exit -9, no line)
    proc = cli("predict", *QUIET, *DDP2, *data, "--data.test_fraction", "0.001", cwd=tmp_path, check=False)
    errors = [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("error:")]
    assert proc.returncode == 1 and len(errors) == 1, proc.stdout + proc.stderr
    assert "fewer than the 2 ranks" in errors[0]
    assert not (tmp_path / "runs" / RUN_NAME).exists()


TWO_VAL = ["--model", "tests.fixtures.kinds.TwoValRegress", "--data", "tests.fixtures.kinds.TwoValData"]


def test_a_monitor_of_one_of_several_validation_loaders_judges_the_run_and_a_wrong_one_stops_it(tmp_path, capsys):
    """Lightning fills ``callback_metrics`` of several validation loaders only after the sanity check: the key a
    ``ModelCheckpoint`` of the user's monitors (``val_mse/dataloader_idx_0``) is checked at the first validation,
    not refused at the sanity check as never logged."""
    own = ["--trainer.callbacks+=ModelCheckpoint", "--trainer.callbacks.mode=min"]
    fit = cli_in_process("fit", *TWO_VAL, *SHORT, *own, "--trainer.callbacks.monitor=val_mse/dataloader_idx_0",
                         root=tmp_path)  # fmt: skip
    (judge,) = [c for c in fit.trainer.checkpoint_callbacks if getattr(c, "monitor", None)]
    logged = dict(scalars(tmp_path / "two_val" / "version_0")["val_mse/dataloader_idx_0"])
    assert judge.best_model_score.item() == pytest.approx(min(logged.values()), abs=1e-6), (judge, logged)
    assert f"Run summary: best val_mse/dataloader_idx_0 {min(logged.values()):.4f}" in capsys.readouterr().out
    message = failure(*TWO_VAL, *SHORT, *own, "--trainer.callbacks.monitor=val_mse/dataloader_idx_2", root=tmp_path)
    assert message.startswith(
        "error: the monitor of a ModelCheckpoint in trainer.callbacks is 'val_mse/dataloader_idx_2', which the module "
        "did not log by the end of the first validation (it logs: train_mse, val_mse/dataloader_idx_0, "
        "val_mse/dataloader_idx_1)"
    ), message
