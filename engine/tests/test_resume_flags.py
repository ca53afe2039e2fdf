"""Resume stays exact off the default path: a crashed run resumed from an epoch-end and from a mid-epoch checkpoint
ends bitwise equal to the uninterrupted run (weights, per-step loss and LR) under flags that move where epochs end,
when optimizer steps happen and when validation saves: single process in this process, and the flags together
under 2-rank DDP in subprocesses."""

import signal
from pathlib import Path

import pytest
import torch

from tests.faults import kill_at
from tests.helpers import DDP2, QUIET, RUN_NAME, cli, cli_in_process, newest_checkpoint, scalars

pytestmark = pytest.mark.slow

# A last.ckpt writer every 5 optimizer steps besides the default ones, so that a mid-epoch checkpoint exists at
# every flag's step count.
EVERY_5 = ["--trainer.callbacks+=ModelCheckpoint", "--trainer.callbacks.every_n_train_steps=5",
           "--trainer.callbacks.save_top_k=0", "--trainer.callbacks.save_last=true",
           "--trainer.callbacks.enable_version_counter=false"]  # fmt: skip
# Logged every step (default.yaml logs every 50): the per-step loss and LR are compared, not one point a run.
BASE = [*QUIET, "--trainer.max_epochs", "3", "--trainer.limit_val_batches", "2", "--model.warmup", "1",
        "--trainer.log_every_n_steps", "1", *EVERY_5]  # fmt: skip

# flag -> (args, crash step resuming from an epoch end, crash step resuming mid-epoch)
CASES = {
    "limit_train_batches 0.5": (["--trainer.limit_train_batches", "0.5"], 20, 27),  # 10 steps an epoch
    "accumulate_grad_batches 3": (["--trainer.accumulate_grad_batches", "3"], 14, 17),  # 7 steps an epoch
    "val_check_interval 0.5": (["--trainer.val_check_interval", "0.5"], 20, 33),  # 30: the mid-epoch validation's
    "check_val_every_n_epoch 2": (["--trainer.check_val_every_n_epoch", "2"], 20, 47),
}  # loader workers: tests/test_resume.py::test_resume_with_loader_workers_is_exact


def final(root):
    run = root / RUN_NAME / "version_0"
    return torch.load(run / "checkpoints" / "last.ckpt", weights_only=True), scalars(run)


def resumed_from_mid_epoch(root) -> bool:
    """Whether the newest checkpoint (what --ckpt_path last resumes from) was taken in the middle of an epoch."""
    ckpt = torch.load(newest_checkpoint(root / RUN_NAME / "version_0"), weights_only=True)
    batches = ckpt["loops"]["fit_loop"]["epoch_loop.batch_progress"]["current"]["completed"]
    return not ckpt["loops"]["fit_loop"]["epoch_loop.batch_progress"]["is_last_batch"] and batches > 0


@pytest.mark.parametrize(  # one in make test, the others in CI and make test-all
    "flag", [f if f == "val_check_interval 0.5" else pytest.param(f, marks=pytest.mark.long) for f in CASES]
)
def test_resume_is_exact_at_an_epoch_end_and_mid_epoch(flag, tmp_path):
    args, epoch_end_step, mid_epoch_step = CASES[flag]
    cli_in_process("fit", *BASE, *args, root=tmp_path / "reference")
    ref, ref_logged = final(tmp_path / "reference")
    for where, step in (("epoch end", epoch_end_step), ("mid-epoch", mid_epoch_step)):
        root = tmp_path / where.replace(" ", "_")
        with pytest.raises(RuntimeError, match="injected crash"):
            cli_in_process("fit", *BASE, *args, "--trainer.callbacks+=tests.faults.CrashAt",
                           f"--trainer.callbacks.step={step}", root=root)  # fmt: skip
        assert resumed_from_mid_epoch(root) == (where == "mid-epoch"), where  # the precondition of this case
        cli_in_process("fit", *BASE, *args, "--ckpt_path", "last", root=root)
        got, logged = final(root)
        assert got["global_step"] == ref["global_step"]
        weights = {k: v for k, v in ref["state_dict"].items() if k.startswith("net.")}
        diffs = {k: (got["state_dict"][k] - v).abs().max().item() for k, v in weights.items()}
        assert all(d == 0.0 for d in diffs.values()), (where, diffs)
        for tag in ("train/loss", "lr", "val/acc", "train/acc", "train/loss_epoch"):
            assert logged[tag] == ref_logged[tag], (where, tag)


@pytest.mark.long  # CI and make test-all; DDP resume: test_resume.py checks it in make test
def test_two_rank_ddp_resume_with_the_flags_together_is_exact(tmp_path):
    # batch 16 on 2 ranks: 40 batches a rank, limited to 20, 3 to a step: 7 steps an epoch (the 7th on 2 batches),
    # validation also after batch 10; last.ckpt every 5 steps, so step 15 (epoch 2, batch 3) is mid-epoch.
    args = [*BASE, *DDP2, "--data.batch_size", "16", "--trainer.limit_train_batches", "0.5",
            "--trainer.accumulate_grad_batches", "3", "--trainer.val_check_interval", "0.5"]  # fmt: skip
    for name in ("reference", "resumed"):
        (tmp_path / name).mkdir()
    cli("fit", *args, cwd=tmp_path / "reference")
    # settle: the mid-epoch save on disk whatever the load, for the precondition
    proc = cli("fit", *args, *kill_at(17, settle=True), cwd=tmp_path / "resumed", check=False)
    assert proc.returncode == -9, proc.stderr[-2000:]
    assert resumed_from_mid_epoch(tmp_path / "resumed" / "runs")  # the precondition: a mid-epoch resume
    cli("fit", *args, "--ckpt_path", "last", cwd=tmp_path / "resumed")
    (ref, ref_logged), (got, logged) = final(tmp_path / "reference" / "runs"), final(tmp_path / "resumed" / "runs")
    assert got["global_step"] == ref["global_step"] == 21
    weights = {k: v for k, v in ref["state_dict"].items() if k.startswith("net.")}
    diffs = {k: (got["state_dict"][k] - v).abs().max().item() for k, v in weights.items()}
    assert all(d == 0.0 for d in diffs.values()), diffs
    # the epoch-level train metrics too: the checkpoint keeps each rank's metric states, each rank restores its own
    for tag in ("train/loss", "lr", "val/acc", "val/loss", "train/acc", "train/loss_epoch"):
        assert logged[tag] == ref_logged[tag], tag


def test_a_fit_stopped_mid_epoch_then_continued_is_exact(tmp_path):
    """max_time (or any clean stop mid-epoch) ends fit with last.ckpt at that step; `--ckpt_path last` continues the
    same epoch, in its data order, and ends where the uninterrupted run ends. (Lightning counts the interrupted epoch
    as done when fit ends, and a resume would start the next epoch's order at the same batch.)"""
    cli_in_process("fit", *BASE, root=tmp_path / "reference")
    ref, ref_logged = final(tmp_path / "reference")
    assert len(ref_logged["train/loss"]) == ref["global_step"] == 60  # the precondition: a loss point every step
    root = tmp_path / "stopped"
    cli_in_process("fit", *BASE, "--trainer.callbacks+=tests.faults.StopAt", "--trainer.callbacks.step=27", root=root)
    stopped = torch.load(root / RUN_NAME / "version_0" / "checkpoints" / "last.ckpt", weights_only=True)
    assert stopped["global_step"] == 27 and stopped["epoch"] == 1  # 20 steps an epoch: step 27 is in epoch 1
    cli_in_process("fit", *BASE, "--ckpt_path", "last", root=root)
    got, logged = final(root)
    assert got["global_step"] == ref["global_step"]
    diffs = {k: (got["state_dict"][k] - v).abs().max().item() for k, v in ref["state_dict"].items()}
    assert all(d == 0.0 for d in diffs.values()), diffs
    for tag in ("train/loss", "lr"):
        assert logged[tag] == ref_logged[tag], tag
    # Lightning validates when a fit stops mid-epoch: one more val/acc point, logged at step 26 (after step 27, as
    # epoch 0's is at 19); the others are the same
    assert [p for p in logged["val/acc"] if p[0] != 26] == ref_logged["val/acc"]


ACCUMULATE = ["--trainer.accumulate_grad_batches", "3"]  # 20 batches an epoch: steps after batch 3, 6, ..., 18, 20


@pytest.mark.parametrize(  # the timer's save in make test; a signal's and a stop's in CI and make test-all
    "how",
    [pytest.param("sigterm", marks=pytest.mark.long), "timer", pytest.param("should_stop", marks=pytest.mark.long)],
)
def test_a_save_mid_accumulation_waits_for_the_step_and_the_resume_is_exact(tmp_path, how):
    """The gradients of an accumulating step's first batches are in .grad, which no checkpoint holds: a SIGTERM in
    step 18's first batch, a last.ckpt timer due there, or a stop (max_time's) in its second saved mid-step, and the
    resume took step 18 on its last batches only (weights off by 7e-3, 'resume verified'). The save or stop now waits
    for the batch that steps: the resumed run ends bitwise equal to the uninterrupted one."""
    cli_in_process("fit", *BASE, *ACCUMULATE, root=tmp_path / "reference")
    ref, ref_logged = final(tmp_path / "reference")
    if how == "sigterm":  # sent at each of step 18's batches: saved after the third (Lightning's own: the first)
        proc = cli("fit", *BASE, *ACCUMULATE, *kill_at(17, signal.SIGTERM), cwd=tmp_path, check=False)
        assert proc.returncode == 143, proc.stderr[-2000:]
    elif how == "should_stop":  # as max_time's Timer stops, in step 18's second batch: the fit's end saves
        stop = ["--trainer.callbacks+=tests.faults.StopAt", "--trainer.callbacks.step=17",
                "--trainer.callbacks.after=1"]  # fmt: skip
        cli("fit", *BASE, *ACCUMULATE, *stop, cwd=tmp_path)
    else:  # killed in step 18's third batch, the last.ckpt timer due in its first
        due = ["--trainer.callbacks+=tests.faults.LastDueAt", "--trainer.callbacks.step=17"]
        cli("fit", *BASE, *ACCUMULATE, *due, *kill_at(17, settle=True, after=2), cwd=tmp_path, check=False)
    saved = torch.load(newest_checkpoint(tmp_path / "runs" / RUN_NAME / "version_0"), weights_only=True)
    batches = saved["loops"]["fit_loop"]["epoch_loop.batch_progress"]["current"]["processed"]
    print(f"{how}: the newest checkpoint is of step {saved['global_step']}, epoch {saved['epoch']} batch {batches}")
    assert batches % 3 == 0, "saved mid-accumulation"
    cli("fit", *BASE, *ACCUMULATE, "--ckpt_path", "last", cwd=tmp_path)
    got, logged = final(tmp_path / "runs")
    assert got["global_step"] == ref["global_step"] == 21
    diffs = {k: (got["state_dict"][k] - v).abs().max().item() for k, v in ref["state_dict"].items()}
    assert all(d == 0.0 for d in diffs.values()), diffs
    assert logged["train/loss"] == ref_logged["train/loss"]


JUDGES = ["--trainer.callbacks+=EarlyStopping", "--trainer.callbacks.monitor=val/loss",
          "--trainer.callbacks.patience=2", "--trainer.callbacks.min_delta=10",
          "--trainer.callbacks+=ModelCheckpoint", "--trainer.callbacks.monitor=val/acc",
          "--trainer.callbacks.mode=max", "--trainer.callbacks.save_top_k=1",
          "--trainer.callbacks.filename={step}"]  # fmt: skip


# 20 steps an epoch in one process, 10 on 2 ranks: each stops mid-epoch 1
@pytest.mark.parametrize("how", ["should_stop", "max_steps"])
@pytest.mark.parametrize("ranks, stop_at, steps", [(1, 27, 60), pytest.param(2, 17, 30, marks=pytest.mark.long)])
def test_what_judges_a_run_stopped_mid_epoch_judges_it_as_the_uninterrupted_run(tmp_path, ranks, stop_at, steps, how):
    """Lightning validates where a fit stops mid-epoch by ``should_stop`` (max_time, a callback) and runs the epoch's
    end hooks there; at a ``max_steps`` mid-epoch it runs them without validating. An EarlyStopping (patience 2;
    after the first, no val/loss improves by 10) and a top-1 ModelCheckpoint by val/acc judged there (the stop's
    validation, or the last one's values again): continued, the run stopped after epoch 1 (40 steps of 60), and a
    save at the stop could delete the file the uninterrupted run keeps. Now neither judges at the stop: the
    continued run (``max_steps`` left at its default) ends as the uninterrupted one (steps, weights, EarlyStopping's
    state, the kept file), in one process and on 2 ranks."""
    args = [*BASE, *JUDGES, *(DDP2 if ranks == 2 else [])]
    if how == "max_steps":  # the schedule's horizon said (3 epochs), not fitted to the fit's max_steps
        args += ["--model.max_schedule", "3"]
        stop = ["--trainer.max_steps", str(stop_at)]
    else:
        stop = ["--trainer.callbacks+=tests.faults.StopAt", f"--trainer.callbacks.step={stop_at}"]
    if ranks == 1:
        cli_in_process("fit", *args, root=tmp_path / "reference" / "runs")
        cli_in_process("fit", *args, *stop, root=tmp_path / "stopped" / "runs")
    else:
        for name in ("reference", "stopped"):
            (tmp_path / name).mkdir()
        cli("fit", *args, cwd=tmp_path / "reference")
        cli("fit", *args, *stop, cwd=tmp_path / "stopped")
    ref, _ = final(tmp_path / "reference" / "runs")
    stopped, _ = final(tmp_path / "stopped" / "runs")
    assert stopped["global_step"] == stop_at, "precondition: stopped mid-epoch 1"
    if ranks == 1:
        cli_in_process("fit", *args, "--ckpt_path", "last", root=tmp_path / "stopped" / "runs")
    else:
        cli("fit", *args, "--ckpt_path", "last", cwd=tmp_path / "stopped")
    got, _ = final(tmp_path / "stopped" / "runs")

    def judged(checkpoint) -> tuple[dict, list[str]]:
        states = checkpoint["callbacks"]
        (stop,) = [s for k, s in states.items() if k.startswith("EarlyStopping")]
        (best,) = [s for k, s in states.items() if k.startswith("ModelCheckpoint{'monitor': 'val/acc'")]
        return stop, [Path(p).name for p in best["best_k_models"]]

    (ref_stop, ref_files), (stop, files) = judged(ref), judged(got)
    print(f"steps {got['global_step']} / {ref['global_step']} | EarlyStopping {stop} | files {files} / {ref_files}")
    assert got["global_step"] == ref["global_step"] == steps
    assert stop == ref_stop and files == ref_files, (stop, ref_stop, files, ref_files)
    assert (tmp_path / "stopped" / "runs" / RUN_NAME / "version_0" / "checkpoints" / files[0]).exists()
    diffs = {k: (got["state_dict"][k] - v).abs().max().item() for k, v in ref["state_dict"].items()}
    assert all(d == 0.0 for d in diffs.values()), diffs
