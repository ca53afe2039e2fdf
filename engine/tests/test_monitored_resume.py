"""What a run's callbacks judge by survives a kill: a ``ModelCheckpoint`` of the user's that saves every few steps by
a validation metric, and a ``ReduceLROnPlateau`` on it, after ``fit --ckpt_path last`` from a mid-epoch checkpoint,
keep the files, scores and LR of the uninterrupted run (``steadfast.monitored_values``; real CLI processes)."""

import pytest
import torch

from tests.faults import kill_at
from tests.helpers import QUIET, cli, run_dirs

pytestmark = pytest.mark.slow

# 6 steps an epoch, 4 epochs; validation after steps 6, 12, 18, 24; a file by val_mse every 3 steps, all kept
BASE = [*QUIET, "--model", "tests.fixtures.kinds.PlateauRegress", "--data", "tests.fixtures.kinds.KindData",
        "--data.as_dict", "true", "--trainer.max_epochs", "4", "--run.monitor", "null",
        "--trainer.callbacks+=ModelCheckpoint", "--trainer.callbacks.monitor=val_mse",
        "--trainer.callbacks.save_top_k=-1", "--trainer.callbacks.filename={step}"]  # fmt: skip
ARGS = [*BASE, "--trainer.callbacks.every_n_train_steps=3"]


def scored(run) -> dict[str, float]:
    """The user's ModelCheckpoint's files and the val_mse each was saved with, as the final last.ckpt holds them."""
    states = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["callbacks"]
    (state,) = [s for k, s in states.items() if k.startswith("ModelCheckpoint{'monitor': 'val_mse'")]
    return {path.rsplit("/", 1)[-1]: float(score) for path, score in state["best_k_models"].items()}


def test_a_resume_keeps_the_files_scores_and_plateau_lr_of_a_monitor_between_validations(tmp_path):
    reference, resumed = tmp_path / "reference", tmp_path / "resumed"
    reference.mkdir(), resumed.mkdir()
    cli("fit", *ARGS, cwd=reference)
    (ref_run,) = run_dirs(reference, "kind")
    want = torch.load(ref_run / "checkpoints" / "last.ckpt", weights_only=True)

    killed = cli("fit", *ARGS, *kill_at(17, settle=True), cwd=resumed, check=False)
    assert killed.returncode == -9, killed.stderr[-2000:]
    (run,) = run_dirs(resumed, "kind")
    saved = torch.load(run / "checkpoints" / "step=15.ckpt", weights_only=True)
    progress = saved["loops"]["fit_loop"]["epoch_loop.batch_progress"]["current"]["completed"]
    assert saved["epoch"] == 2 and 0 < progress < 6, "precondition: the newest checkpoint is mid-epoch 2"
    proc = cli("fit", *ARGS, "--ckpt_path", "last", cwd=resumed)
    assert "from step=15.ckpt" in proc.stdout or "step 15" in proc.stdout, proc.stdout[-2000:]
    got = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)

    # step=18.ckpt is saved before epoch 2's validation, by the val_mse of epoch 1's: a resume at step 15 had none
    assert scored(run) == scored(ref_run), (scored(run), scored(ref_run))
    lr = [g["lr"] for g in got["optimizer_states"][0]["param_groups"]]
    want_lr = [g["lr"] for g in want["optimizer_states"][0]["param_groups"]]
    assert lr == want_lr == [0.05 / 2**4], (lr, want_lr)  # halved at each of the 4 epochs' ends, also the resumed one
    delta = max((got["state_dict"][k] - v).abs().max().item() for k, v in want["state_dict"].items())
    print(f"files {sorted(scored(run))} | lr {lr} | max |delta| {delta}")
    assert delta == 0.0


def test_a_resume_from_an_epoch_end_checkpoint_takes_the_plateau_step_its_run_took_after_saving_it(tmp_path):
    """A ModelCheckpoint by val_mse saves at each train epoch's end (Lightning's default with validation every
    epoch), before Lightning's plateau step of that epoch: resumed from it, the LR is the uninterrupted run's."""
    every_epoch = [*BASE, "--trainer.callbacks.save_last=true"]
    reference, resumed = tmp_path / "reference", tmp_path / "resumed"
    reference.mkdir(), resumed.mkdir()
    cli("fit", *every_epoch, cwd=reference)
    (ref_run,) = run_dirs(reference, "kind")
    want = torch.load(ref_run / "checkpoints" / "last.ckpt", weights_only=True)

    killed = cli("fit", *every_epoch, *kill_at(8, settle=True), cwd=resumed, check=False)
    assert killed.returncode == -9, killed.stderr[-2000:]
    (run,) = run_dirs(resumed, "kind")
    saved = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)
    epochs = saved["loops"]["fit_loop"]["epoch_progress"]["current"]
    assert saved["global_step"] == 6 and epochs["processed"] == epochs["completed"] + 1, (
        "precondition: last.ckpt was saved at epoch 0's end, before its plateau step",
        saved["global_step"],
        epochs,
    )
    cli("fit", *every_epoch, "--ckpt_path", "last", cwd=resumed)
    got = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)
    lr = [g["lr"] for g in got["optimizer_states"][0]["param_groups"]]
    assert lr == [g["lr"] for g in want["optimizer_states"][0]["param_groups"]] == [0.05 / 2**4], lr
    delta = max((got["state_dict"][k] - v).abs().max().item() for k, v in want["state_dict"].items())
    assert delta == 0.0 and scored(run) == scored(ref_run), (delta, scored(run), scored(ref_run))
