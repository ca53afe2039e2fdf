"""What a run's callbacks judge by survives a kill: a ``ModelCheckpoint`` of the user's that saves every few steps by
a validation metric, and a ``ReduceLROnPlateau`` on it, after ``fit --ckpt_path last`` from a mid-epoch checkpoint,
keep the files, scores and LR of the uninterrupted run (``lightkeep.monitored_values``). The kills are real CLI
processes; the uninterrupted references and the resumes run the same CLI in this process (no interpreter start)."""

import pytest
import torch

from tests.faults import kill_at
from tests.helpers import QUIET, cli, cli_in_process, run_dirs

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


def test_a_resume_keeps_the_files_scores_and_plateau_lr_of_a_monitor_between_validations(tmp_path, capsys):
    reference, resumed = tmp_path / "reference", tmp_path / "resumed"
    reference.mkdir(), resumed.mkdir()
    cli_in_process("fit", *ARGS, root=reference / "runs")
    (ref_run,) = run_dirs(reference, "kind")
    want = torch.load(ref_run / "checkpoints" / "last.ckpt", weights_only=True)

    # The killed run names its folder relative to its working directory ("runs", the default), the resume in this
    # process by an absolute --run.root: Lightning restores a ModelCheckpoint's files and scores only where the saved
    # dirpath is the resume's as a string, so the engine writes the saved paths in the resume's spelling
    # (lightkeep.run_folder; without that, the scores below started afresh)
    killed = cli("fit", *ARGS, *kill_at(17, settle=True), cwd=resumed, check=False)
    assert killed.returncode == -9, killed.stderr[-2000:]
    (run,) = run_dirs(resumed, "kind")
    saved = torch.load(run / "checkpoints" / "step=15.ckpt", weights_only=True)
    progress = saved["loops"]["fit_loop"]["epoch_loop.batch_progress"]["current"]["completed"]
    assert saved["epoch"] == 2 and 0 < progress < 6, "precondition: the newest checkpoint is mid-epoch 2"
    capsys.readouterr()
    cli_in_process("fit", *ARGS, "--ckpt_path", "last", root=resumed / "runs")
    out = capsys.readouterr().out
    assert "from step=15.ckpt" in out or "step 15" in out, out[-2000:]
    got = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)

    # step=18.ckpt is saved before epoch 2's validation, by the val_mse of epoch 1's: a resume at step 15 had none
    assert scored(run) == scored(ref_run), (scored(run), scored(ref_run))
    lr = [g["lr"] for g in got["optimizer_states"][0]["param_groups"]]
    want_lr = [g["lr"] for g in want["optimizer_states"][0]["param_groups"]]
    assert lr == want_lr == [0.05 / 2**4], (lr, want_lr)  # halved at each of the 4 epochs' ends, also the resumed one
    delta = max((got["state_dict"][k] - v).abs().max().item() for k, v in want["state_dict"].items())
    print(f"files {sorted(scored(run))} | lr {lr} | max |delta| {delta}")
    assert delta == 0.0


def lr_and_delta(reference, resumed) -> tuple[float, float, float]:
    """The LR of the final last.ckpt of the resumed run and of the reference, and the weights' max |delta|."""
    (ref_run,), (run,) = run_dirs(reference, "kind"), run_dirs(resumed, "kind")
    want, got = [torch.load(r / "checkpoints" / "last.ckpt", weights_only=True) for r in (ref_run, run)]
    lr, want_lr = [c["optimizer_states"][0]["param_groups"][0]["lr"] for c in (got, want)]
    return lr, want_lr, max((got["state_dict"][k] - v).abs().max().item() for k, v in want["state_dict"].items())


@pytest.mark.parametrize("from_engine_1_5", [False, pytest.param(True, marks=pytest.mark.long)])  # True: CI
def test_a_plateau_stepping_every_second_epoch_is_stepped_at_the_resumed_epochs_end(tmp_path, capsys, from_engine_1_5):
    """``"frequency": 2``: Lightning steps the plateau after epochs 1 and 3 (LR 0.05 / 4 after 4 epochs). Resumed in
    epoch 1, the step Lightning skips at its end is due and taken (counted as of epoch 1, not of epoch 2, when the
    engine takes it). From an engine 1.5 checkpoint, which holds no saved values, the step is taken too."""
    args = [*ARGS, "--model.plateau_every", "2"]
    reference, resumed = tmp_path / "reference", tmp_path / "resumed"
    reference.mkdir(), resumed.mkdir()
    cli_in_process("fit", *args, root=reference / "runs")
    killed = cli("fit", *args, *kill_at(11, settle=True), "--run.root", str(resumed / "runs"), cwd=resumed, check=False)
    assert killed.returncode == -9, killed.stderr[-2000:]
    (run,) = run_dirs(resumed, "kind")
    for path in (run / "checkpoints").glob("*.ckpt"):  # step=9.ckpt, mid-epoch 1, is the newest
        checkpoint = torch.load(path, weights_only=True)
        assert checkpoint["global_step"] <= 9 and "MonitoredValues" in checkpoint["callbacks"]
        if from_engine_1_5:  # what engine 1.5 saved: no MonitoredValues
            del checkpoint["callbacks"]["MonitoredValues"]
            torch.save(checkpoint, path)
    capsys.readouterr()
    cli_in_process("fit", *args, "--ckpt_path", "last", root=resumed / "runs")
    out = capsys.readouterr().out
    assert "step 9" in out, out[-2000:]
    lr, want_lr, delta = lr_and_delta(reference, resumed)
    assert lr == want_lr == 0.05 / 4 and delta == 0.0, (lr, want_lr, delta)


@pytest.mark.parametrize("every, kill, saved_step", [(1, 8, 6), pytest.param(2, 14, 12, marks=pytest.mark.long)])
def test_a_resume_from_an_epoch_end_checkpoint_takes_the_plateau_step_its_run_took_after_saving_it(
    tmp_path, capsys, every, kill, saved_step
):
    """A ModelCheckpoint by val_mse saves at each train epoch's end (Lightning's default with validation every
    epoch), before Lightning's plateau step of that epoch: resumed from it, the LR is the uninterrupted run's (a
    plateau stepping every epoch, and every second: epoch 1's end, where it is due)."""
    every_epoch = [*BASE, "--trainer.callbacks.save_last=true", "--model.plateau_every", str(every)]
    reference, resumed = tmp_path / "reference", tmp_path / "resumed"
    reference.mkdir(), resumed.mkdir()
    cli_in_process("fit", *every_epoch, root=reference / "runs")
    (ref_run,) = run_dirs(reference, "kind")

    killed = cli("fit", *every_epoch, *kill_at(kill, settle=True), "--run.root", str(resumed / "runs"), cwd=resumed,
                 check=False)  # fmt: skip
    assert killed.returncode == -9, killed.stderr[-2000:]
    (run,) = run_dirs(resumed, "kind")
    saved = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)
    epochs = saved["loops"]["fit_loop"]["epoch_progress"]["current"]
    assert saved["global_step"] == saved_step and epochs["processed"] == epochs["completed"] + 1, (
        "precondition: last.ckpt was saved at an epoch's end, before its plateau step",
        saved["global_step"],
        epochs,
    )
    capsys.readouterr()
    cli_in_process("fit", *every_epoch, "--ckpt_path", "last", root=resumed / "runs")
    lr, want_lr, delta = lr_and_delta(reference, resumed)
    assert lr == want_lr == 0.05 / 2 ** (4 // every), (lr, want_lr)
    assert delta == 0.0 and scored(run) == scored(ref_run), (delta, scored(run), scored(ref_run))
    # the plateau step taken at the resume's start is the checkpoint's run's: not a rate set again (it said no)
    (start,) = [line for line in capsys.readouterr().out.splitlines() if "exact resume:" in line]
    assert "exact resume: resume verified" in start, start
