"""A config with its own ``trainer.callbacks`` and ``trainer.plugins`` lists, the Lightning way, keeps every
guarantee: ``last.ckpt`` on the timer, at the end and on SIGTERM, the periodic files, the LR curve, the run summary,
an exact resume; what it switches off is said in the start line (the real CLI: SIGTERMed runs in a process of their own,
the others in this process)."""

from pathlib import Path

import pytest
import torch

from tests.helpers import QUIET, cli, cli_in_process, run_dirs, scalars

pytestmark = pytest.mark.slow

# 3 epochs of 4 steps; the user's own ModelCheckpoint every 7 steps, and nothing of the engine's in the list
OWN = """\
trainer:
  callbacks:
    - class_path: lightning.pytorch.callbacks.ModelCheckpoint
      init_args:
        every_n_train_steps: 7
{more}
"""
TERM_AT_6 = """\
    - class_path: tests.faults.KillAt
      init_args: {step: 6, sig: 15}
"""
ARGS = [*QUIET, "--trainer.max_epochs", "3", "--trainer.limit_train_batches", "4", "--trainer.limit_val_batches", "2",
        "--model.warmup", "1", "--trainer.log_every_n_steps", "1"]  # fmt: skip


def own_config(tmp_path, name: str, more: str = "") -> str:
    path = tmp_path / name
    path.write_text(OWN.format(more=more))
    return str(path)


def test_a_callbacks_list_of_ones_own_keeps_last_ckpt_sigterm_saves_and_an_exact_resume(tmp_path, capsys):
    reference, resumed = tmp_path / "reference", tmp_path / "resumed"
    reference.mkdir(), resumed.mkdir()
    cli_in_process("fit", *ARGS, "--config", own_config(tmp_path, "own.yaml"), root=reference / "runs")
    proc = capsys.readouterr()
    (run,) = run_dirs(reference)
    files = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert "last.ckpt" in files and "epoch001.ckpt" in files and "epoch=1-step=7.ckpt" in files, files
    assert torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 12
    out = proc.out + proc.err
    assert "exact resume: yes" in out and "Run summary: best val/acc" in out, out[-2000:]
    assert any(tag.startswith("lr") for tag in scalars(run)), scalars(run).keys()  # LearningRateMonitor's curve

    # SIGTERM as step 6 begins: Lightning stops at that batch's end, last.ckpt holds step 7
    # the root the resume in this process names (a checkpoint's callbacks restore their state in the same dirpath)
    killed = cli("fit", *ARGS, "--config", own_config(tmp_path, "term.yaml", TERM_AT_6), "--run.root",
                 str(resumed / "runs"), cwd=resumed, check=False)  # fmt: skip
    assert killed.returncode == 143, killed.stderr[-2000:]  # preempted: saved, then a failure for the launcher
    (run2,) = run_dirs(resumed)
    saved = torch.load(run2 / "checkpoints" / "last.ckpt", weights_only=True)
    assert saved["global_step"] == 7 and 0 < saved["loops"]["fit_loop"]["epoch_loop.batch_progress"]["current"][
        "completed"] < 4  # fmt: skip  # mid-epoch: the resume below must continue inside epoch 1
    cli_in_process("fit", *ARGS, "--config", own_config(tmp_path, "own.yaml"), "--ckpt_path", "last",
                   root=resumed / "runs")  # fmt: skip
    want = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)
    got = torch.load(run2 / "checkpoints" / "last.ckpt", weights_only=True)
    assert got["global_step"] == 12
    diffs = {k: (got["state_dict"][k] - v).abs().max().item() for k, v in want["state_dict"].items()}
    print(f"own callbacks list: SIGTERM exit {killed.returncode}, last.ckpt of step {saved['global_step']}, files "
          f"{files}; after the resume max |delta| {max(diffs.values())}")  # fmt: skip
    assert all(torch.equal(got["state_dict"][k], v) for k, v in want["state_dict"].items()), diffs


@pytest.mark.long  # CI and make test-all
def test_what_a_config_switches_off_is_named_in_the_start_line(tmp_path):
    plugins = "  plugins:\n    - class_path: lightning.pytorch.plugins.io.TorchCheckpointIO\n"
    config = own_config(tmp_path, "own.yaml")
    with open(config, "a") as f:
        f.write(plugins)
    proc = cli("fit", *ARGS, "--trainer.max_epochs", "1", "--config", config, "--checkpoints.every_n_epochs", "null",
               cwd=tmp_path)  # fmt: skip
    (line,) = [line for line in proc.stdout.splitlines() if "exact resume:" in line]
    assert "| off: periodic checkpoints (checkpoints.every_n_epochs null); atomic saves: trainer.plugins' " \
           "TorchCheckpointIO writes the checkpoints" in line, line  # fmt: skip
    (run,) = run_dirs(tmp_path)
    assert (run / "checkpoints" / "last.ckpt").is_file() and not list((run / "checkpoints").glob("epoch0*"))


@pytest.mark.long  # CI and make test-all
def test_ones_own_model_checkpoint_monitoring_what_run_monitor_names_is_the_best_k(tmp_path):
    """The README's advice for a module logging its own metric: ``--run.monitor KEY --run.mode min`` beside the
    user's ``ModelCheckpoint(monitor=KEY, mode="min")``; Lightning refused the two (one state key)."""
    config = tmp_path / "own.yaml"
    config.write_text("trainer:\n  callbacks:\n    - class_path: lightning.pytorch.callbacks.ModelCheckpoint\n"
                      "      init_args: {monitor: val/loss, mode: min, save_last: true}\n")  # fmt: skip
    proc = cli("fit", *ARGS, "--config", str(config), "--run.monitor", "val/loss", "--run.mode", "min", cwd=tmp_path)
    (run,) = run_dirs(tmp_path)
    losses = dict(scalars(run)["val/loss"])
    best_step = min(losses, key=losses.get)
    (summary,) = [line for line in proc.stdout.splitlines() if line.startswith("Run summary:")]
    assert f"best val/loss {losses[best_step]:.4f}" in summary, summary
    # Lightning's default file name of the user's callback, at the step of the lowest val/loss TensorBoard shows
    assert f"step={best_step + 1}.ckpt" in summary, (summary, losses)


REGRESS = [*QUIET, "--model", "tests.fixtures.kinds.DictRegress", "--data", "tests.fixtures.kinds.KindData",
           "--data.as_dict", "true", "--trainer.max_epochs", "3", "--trainer.limit_train_batches", "4"]  # fmt: skip


def test_ones_own_monitor_judges_the_run_not_the_base_configs_val_acc(tmp_path, capsys, caplog):
    """A module logging ``val_mse`` (never the example's ``val/acc``) with its own ModelCheckpoint in its own list:
    that checkpoint is the run's best, for the summary and ``--ckpt_path best``; no best-k of the engine's."""
    config = tmp_path / "own.yaml"
    config.write_text("trainer:\n  callbacks:\n    - class_path: lightning.pytorch.callbacks.ModelCheckpoint\n"
                      "      init_args: {monitor: val_mse, mode: min, save_last: true}\n")  # fmt: skip
    cli_in_process("fit", *REGRESS, "--config", str(config), root=tmp_path / "runs")
    proc = capsys.readouterr()
    out = proc.out + proc.err
    assert "monitor: 'val_mse' (min), the first ModelCheckpoint of trainer.callbacks; the base config's " \
           "run.monitor 'val/acc' is set aside" in out, out[-3000:]  # fmt: skip
    (run,) = run_dirs(tmp_path, "kind")
    mse = dict(scalars(run)["val_mse"])
    best_step = min(mse, key=mse.get)
    (summary,) = [line for line in proc.out.splitlines() if line.startswith("Run summary:")]
    assert f"best val_mse {mse[best_step]:.4f}" in summary and f"step={best_step + 1}.ckpt" in summary, summary
    assert not list((run / "checkpoints").glob("best-*"))  # run.monitor's best-k was not built beside it
    caplog.set_level("INFO")
    cli_in_process("validate", *REGRESS, "--ckpt_path", "best", root=tmp_path / "runs")
    # Lightning's info logger writes to the stderr it found when a test before this one in the process set it up
    assert f"step={best_step + 1}.ckpt (best val_mse {mse[best_step]:.4f}, mode min" in caplog.text, caplog.text


def test_of_two_own_model_checkpoints_the_first_judges_the_run_though_the_other_saved_last(tmp_path, capsys, caplog):
    """Two ModelCheckpoints of the user's with other monitors: the first (``train_mse``) is the run's, named at
    start beside the other, and ``--ckpt_path best`` ranks by it though the newest file is the other's
    (``val_mse``): the summary and ``--ckpt_path best`` name one file."""
    config = tmp_path / "own.yaml"
    config.write_text("trainer:\n  callbacks:\n    - class_path: lightning.pytorch.callbacks.ModelCheckpoint\n"
                      "      init_args: {monitor: train_mse, mode: min, filename: 'train-{step}'}\n"
                      "    - class_path: lightning.pytorch.callbacks.ModelCheckpoint\n"
                      "      init_args: {monitor: val_mse, mode: min, save_top_k: 2}\n")  # fmt: skip
    cli_in_process("fit", *REGRESS, "--config", str(config), root=tmp_path / "runs")
    proc = capsys.readouterr()
    assert "monitor: 'train_mse' (min), the first ModelCheckpoint of trainer.callbacks; another also keeps files " \
           "by 'val_mse'; the base config's run.monitor 'val/acc' is set aside (--run.monitor KEY chooses)" in \
        proc.out, proc.out[-3000:]  # fmt: skip
    (run,) = run_dirs(tmp_path, "kind")
    (summary,) = [line for line in proc.out.splitlines() if line.startswith("Run summary:")]
    best = summary.split("| best checkpoint ")[1].split(" |")[0]
    assert "best train_mse" in summary and Path(best).name.startswith("train-"), summary
    files = sorted(run.glob("checkpoints/*=*.ckpt"), key=lambda p: p.stat().st_mtime_ns)
    assert not files[-1].name.startswith("train-"), [p.name for p in files]  # precondition: the newest is val_mse's
    caplog.set_level("INFO")
    cli_in_process("validate", *REGRESS, "--ckpt_path", "best", root=tmp_path / "runs")
    # Lightning's info logger writes to the stderr it found when a test before this one in the process set it up
    assert f"--ckpt_path best: {best} (best train_mse" in caplog.text, (caplog.text[-2000:], best)


@pytest.mark.long  # CI and make test-all
def test_two_monitors_that_disagree_are_named_and_run_monitor_judges(tmp_path):
    config = tmp_path / "own.yaml"
    config.write_text("trainer:\n  callbacks:\n    - class_path: lightning.pytorch.callbacks.ModelCheckpoint\n"
                      "      init_args: {monitor: train_mse, mode: min}\n")  # fmt: skip
    proc = cli("fit", *REGRESS, "--config", str(config), "--run.monitor", "val_mse", "--run.mode", "min",
               cwd=tmp_path)  # fmt: skip
    out = proc.stdout + proc.stderr
    assert "two monitors: run.monitor 'val_mse' picks the best checkpoint, the summary and a sweep's objective; a " \
           "ModelCheckpoint of trainer.callbacks also keeps files by 'train_mse'" in out, out[-3000:]  # fmt: skip
    assert "Run summary: best val_mse" in out


@pytest.mark.long  # CI and make test-all
def test_a_module_without_validation_is_judged_by_a_training_metric_or_stopped_in_one_line(tmp_path):
    no_val = [*REGRESS, "--model", "tests.fixtures.no_validation.NoValidation"]
    proc = cli("fit", *no_val, cwd=tmp_path, check=False)  # the base config's val/acc can never be logged
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "run.monitor is 'val/acc', which the module did not log by the end of the first training epoch (it " \
           "logs: train_mse)" in proc.stderr, proc.stderr[-3000:]  # fmt: skip
    proc = cli("fit", *no_val, "--run.monitor", "train_mse", "--run.mode", "min", cwd=tmp_path)
    (summary,) = [line for line in proc.stdout.splitlines() if line.startswith("Run summary:")]
    assert "best train_mse" in summary and "best-epoch" in summary, summary


def test_a_checkpoint_linking_last_to_its_newest_file_saves_in_the_background_and_resumes_exactly(tmp_path):
    """``ModelCheckpoint(save_last="link")``: Lightning links last.ckpt to the file it has just saved, which the
    engine writes in the background into a folder it made with the file: the link failed, and the run stopped at its
    first save (``No such file or directory``). Now the folder is there at once: the run trains, and its last.ckpt,
    killed after step 8, resumes to the uninterrupted run's weights."""
    from tests.helpers import RUN_NAME, cli_in_process, crash_in_process, max_abs_diff

    flags = [*QUIET, "--trainer.max_epochs", "2", "--trainer.limit_train_batches", "6", "--trainer.limit_val_batches",
             "1", "--trainer.callbacks+=ModelCheckpoint", "--trainer.callbacks.every_n_train_steps=4",
             "--trainer.callbacks.save_top_k=-1", "--trainer.callbacks.save_last=link"]  # fmt: skip
    cli_in_process("fit", *flags, root=tmp_path / "reference")
    last = crash_in_process(10, *flags, root=tmp_path / "resumed")
    assert torch.load(last, weights_only=True)["global_step"] == 8
    cli_in_process("fit", *flags, "--ckpt_path", "last", root=tmp_path / "resumed")
    ref, got = (torch.load(tmp_path / name / RUN_NAME / "version_0" / "checkpoints" / "last.ckpt", weights_only=True)
                for name in ("reference", "resumed"))  # fmt: skip
    assert got["global_step"] == ref["global_step"] == 12
    assert max_abs_diff(got["state_dict"], ref["state_dict"]) == 0.0


def test_an_early_stop_on_a_training_epoch_value_runs_and_a_misspelt_one_stops_in_one_line(tmp_path):
    """``EarlyStopping(monitor="train/loss_epoch", check_on_train_epoch_end=True)`` on a module with validation: the
    engine refused it at the first validation's end, where an epoch value of training is not logged yet (Lightning
    computes it after that validation). Now it runs and stops as configured (no gain of 10 after epoch 0: stopped
    after epoch 1, step 12); a misspelt monitor still stops the fit in one line, Lightning's, naming the keys."""
    from tests.helpers import cli_in_process

    flags = [*QUIET, "--trainer.max_epochs", "4", "--trainer.limit_train_batches", "6", "--trainer.limit_val_batches",
             "1", "--trainer.callbacks+=EarlyStopping", "--trainer.callbacks.check_on_train_epoch_end=true",
             "--trainer.callbacks.patience=1", "--trainer.callbacks.min_delta=10"]  # fmt: skip
    run = cli_in_process("fit", *flags, "--trainer.callbacks.monitor=train/loss_epoch", root=tmp_path / "kept")
    assert run.trainer.global_step == 12
    with pytest.raises(SystemExit, match=r"error: Early stopping conditioned on metric `train/loss_epochs` which is "
                                         r"not available\. Pass in .* `train/loss_epoch`"):  # fmt: skip
        cli_in_process("fit", *flags, "--trainer.callbacks.monitor=train/loss_epochs", root=tmp_path / "typo")
