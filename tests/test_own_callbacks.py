"""A config with its own ``trainer.callbacks`` and ``trainer.plugins`` lists, the Lightning way, keeps every
guarantee: ``last.ckpt`` on the timer, at the end and on SIGTERM, the periodic files, the LR curve, the run summary,
an exact resume; what it switches off is said in the start line (real CLI processes)."""

import pytest
import torch

from tests.helpers import QUIET, cli, run_dirs, scalars

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


def test_a_callbacks_list_of_ones_own_keeps_last_ckpt_sigterm_saves_and_an_exact_resume(tmp_path):
    reference, resumed = tmp_path / "reference", tmp_path / "resumed"
    reference.mkdir(), resumed.mkdir()
    proc = cli("fit", *ARGS, "--config", own_config(tmp_path, "own.yaml"), cwd=reference)
    (run,) = run_dirs(reference)
    files = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert "last.ckpt" in files and "epoch001.ckpt" in files and "epoch=1-step=7.ckpt" in files, files
    assert torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 12
    out = proc.stdout + proc.stderr
    assert "exact resume: yes" in out and "Run summary: best val/acc" in out, out[-2000:]
    assert any(tag.startswith("lr") for tag in scalars(run)), scalars(run).keys()  # LearningRateMonitor's curve

    # SIGTERM as step 6 begins: Lightning stops at that batch's end, last.ckpt holds step 7
    killed = cli("fit", *ARGS, "--config", own_config(tmp_path, "term.yaml", TERM_AT_6), cwd=resumed, check=False)
    assert killed.returncode == 143, killed.stderr[-2000:]  # preempted: saved, then a failure for the launcher
    (run2,) = run_dirs(resumed)
    saved = torch.load(run2 / "checkpoints" / "last.ckpt", weights_only=True)
    assert saved["global_step"] == 7 and 0 < saved["loops"]["fit_loop"]["epoch_loop.batch_progress"]["current"][
        "completed"] < 4  # fmt: skip  # mid-epoch: the resume below must continue inside epoch 1
    cli("fit", *ARGS, "--config", own_config(tmp_path, "own.yaml"), "--ckpt_path", "last", cwd=resumed)
    want = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)
    got = torch.load(run2 / "checkpoints" / "last.ckpt", weights_only=True)
    assert got["global_step"] == 12
    diffs = {k: (got["state_dict"][k] - v).abs().max().item() for k, v in want["state_dict"].items()}
    assert all(torch.equal(got["state_dict"][k], v) for k, v in want["state_dict"].items()), diffs


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
