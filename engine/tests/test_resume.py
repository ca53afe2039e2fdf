"""Killed and resumed runs end bit-for-bit where uninterrupted runs end (weights, per-step loss and LR)."""

import os
import random
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightkeep.run_checkpoints import is_loadable, read_global_step
from tests.faults import kill_at
from tests.helpers import (
    DDP2,
    PYTHONPATH,
    QUIET,
    REPO,
    RUN_NAME,
    STAND_IN,
    cli,
    cli_in_process,
    free_port,
    max_abs_diff,
    newest_checkpoint,
    run_dirs,
    saved_steps,
    scalars,
)

pytestmark = pytest.mark.slow

# A last.ckpt writer every 50 optimizer steps besides the default ones (the best 3 and every 2 epochs at epoch ends,
# last.ckpt every 10 minutes, which these runs never reach, and at the end), so that a mid-epoch checkpoint exists.
EVERY_50 = ["--trainer.callbacks+=ModelCheckpoint", "--trainer.callbacks.every_n_train_steps=50",
            "--trainer.callbacks.save_top_k=0", "--trainer.callbacks.save_last=true",
            "--trainer.callbacks.enable_version_counter=false"]  # fmt: skip
# 3 epochs of 20 steps; checkpoints at epoch ends (steps 20, 40, 60) and last.ckpt at step 50.
BASE = [*QUIET, "--trainer.max_epochs", "3", "--trainer.limit_val_batches", "3", "--model.warmup", "1", *EVERY_50]
# The same run with two loader workers, kept between epochs.
WORKERS = [*BASE, "--data.num_workers", "2", "--data.persistent_workers", "true"]
# 2 ranks x batch 48: 14 steps per epoch, so step 50 is mid-epoch (epoch 3, batch 8).
DDP = [*QUIET, *DDP2, "--trainer.max_epochs", "4", "--trainer.limit_val_batches", "3", "--model.warmup", "1",
       "--data.batch_size", "48", *EVERY_50]  # fmt: skip


def seeded_random(what: str) -> random.Random:
    """A new draw each run, printed (pytest shows it when the test fails) and repeatable with TEST_SEED=<seed>."""
    seed = int(os.environ.get("TEST_SEED", random.SystemRandom().randrange(2**32)))
    print(f"{what} drawn with TEST_SEED={seed}")
    return random.Random(seed)


def final_state(cwd):
    (run,) = run_dirs(cwd)
    return run, torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)


EPOCH_TRAIN_METRICS = ("train/acc", "train/loss_epoch")


def assert_same_run(reference_dir, resumed_dir, tags=("train/loss", "lr", "val/acc", "val/loss", *EPOCH_TRAIN_METRICS)):
    ref_run, ref = final_state(reference_dir)
    run, got = final_state(resumed_dir)
    assert got["global_step"] == ref["global_step"]
    weights = {k: v for k, v in ref["state_dict"].items() if k.startswith("net.")}
    diffs = {k: (got["state_dict"][k] - v).abs().max().item() for k, v in weights.items()}
    assert all(torch.equal(got["state_dict"][k], v) for k, v in weights.items()), f"max |dw|: {diffs}"
    ref_logged, logged = scalars(ref_run), scalars(run)
    for tag in tags:
        assert logged[tag] == ref_logged[tag], tag  # same steps, same float values


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("uninterrupted")
    cli_in_process("fit", *BASE, root=cwd / "runs")  # the oracle: the real CLI in this process, no interpreter start
    return cwd


def interrupted_then_resumed(cwd, args, step, sig=9, settle=False) -> str:
    proc = cli("fit", *args, *kill_at(step, sig, settle=settle), cwd=cwd, check=False)
    assert proc.returncode == -sig, proc.stderr[-2000:]
    return cli("fit", *args, "--ckpt_path", "last", cwd=cwd).stdout


@pytest.mark.long  # CI and make test-all; epoch-end resumes: test_resume_flags.py's case in make test
def test_resume_from_epoch_end_checkpoint_is_exact(uninterrupted, tmp_path):
    interrupted_then_resumed(tmp_path, BASE, step=45)  # the newest checkpoint: the end of epoch 2 (step 40)
    assert_same_run(uninterrupted, tmp_path)


def killed_mid_epoch_then_resumed(cwd, args) -> str:
    # settle: the test names the newest checkpoint; without it a loaded machine may still be writing it when the kill
    # comes, leaving an older one (which a resume handles, as the random-step test checks)
    proc = cli("fit", *args, *kill_at(55, settle=True), cwd=cwd, check=False)
    assert proc.returncode == -9, proc.stderr[-2000:]
    last = torch.load(run_dirs(cwd)[0] / "checkpoints" / "last.ckpt", weights_only=True)
    progress = last["loops"]["fit_loop"]["epoch_loop.batch_progress"]
    assert last["global_step"] == 50 and 0 < progress["current"]["completed"] < 20  # mid-epoch (epoch 3 of 20)
    # the resume is a process too: its TensorBoard file is read after the killed run's (names sort by second, then
    # pid; one in this process, started in the killed run's second, would sort first and hide its points)
    return cli("fit", *args, "--ckpt_path", "last", cwd=cwd).stdout


def start_line(out: str) -> str:
    return next(line for line in out.splitlines() if line.startswith("Run "))


def test_resume_from_mid_epoch_checkpoint_is_exact_and_says_it_verified_its_first_batch(uninterrupted, tmp_path):
    out = killed_mid_epoch_then_resumed(tmp_path, BASE)
    assert_same_run(uninterrupted, tmp_path)
    # step 50: epoch 2's batch 10 (the epochs count from 0), as the checkpoint recorded it
    verified = "exact resume: resume verified (epoch 2, batch 10: 64 samples on 1 rank(s), those the checkpoint's run"
    assert verified in start_line(out), start_line(out)


@pytest.mark.long  # CI and make test-all; the mid-epoch resume again, with workers
def test_resume_with_loader_workers_is_exact(uninterrupted, tmp_path):
    reference, resumed = tmp_path / "reference", tmp_path / "resumed"
    reference.mkdir()
    resumed.mkdir()
    cli("fit", *WORKERS, cwd=reference)
    killed_mid_epoch_then_resumed(resumed, WORKERS)
    assert_same_run(reference, resumed)  # the same run with workers, uninterrupted
    assert_same_run(uninterrupted, resumed)  # and without them: workers change nothing


@pytest.mark.long  # CI and make test-all; epoch-end and mid-epoch resumes are in make test
def test_resume_at_a_random_step_is_exact(uninterrupted, tmp_path):
    step = seeded_random("kill step").randint(21, 59)
    interrupted_then_resumed(tmp_path, BASE, step=step)
    assert_same_run(uninterrupted, tmp_path)


@pytest.fixture(scope="module")
def ddp_uninterrupted(tmp_path_factory) -> Path:
    cwd = tmp_path_factory.mktemp("ddp_uninterrupted")
    cli("fit", *DDP, cwd=cwd)  # Lightning's launcher starts the 2 ranks
    return cwd


def test_two_rank_ddp_resume_mid_epoch_is_exact(ddp_uninterrupted, tmp_path):
    reference, resumed = ddp_uninterrupted, tmp_path / "resumed"
    resumed.mkdir()
    # settle: the test names the newest checkpoint (step 50's); a kill 3 steps after it, on a loaded machine, came
    # while it was still being written, and the resume took step 42's best file (measured once in 2 runs of the suite)
    out = interrupted_then_resumed(resumed, DDP, step=53, settle=True)
    # step 50: epoch 3's batch 8 of 14; each rank's 48 samples compared, in the epoch's order over both
    verified = "exact resume: resume verified (epoch 3, batch 8: 96 samples on 2 rank(s), those the checkpoint's run"
    assert verified in start_line(out), start_line(out)
    # Weights, per-step loss, LR, validation, and the epoch-level train metrics of every epoch, the resumed one (3)
    # too: the checkpoint keeps each rank's metric states of the epoch so far, and each rank restores its own
    assert_same_run(reference, resumed)
    (ref_run, _), (run, _) = final_state(reference), final_state(resumed)
    for tag in EPOCH_TRAIN_METRICS:
        ref_points, points = scalars(ref_run)[tag], scalars(run)[tag]
        assert len(points) == 4, points  # one point an epoch: the resumed epoch's is the last
        print(f"2 ranks, epoch 3 (resumed at its batch 8): {tag} at step {points[-1][0]}: {points[-1][1]!r} resumed, "
              f"{ref_points[-1][1]!r} uninterrupted")  # fmt: skip


# CI and make test-all. A SIGTERM's save of the batch in flight, exit 143 and bitwise resume are make test's in
# test_own_callbacks.py::test_a_callbacks_list_of_ones_own_keeps_last_ckpt_sigterm_saves_and_an_exact_resume (one
# process, mid-epoch) and test_signal_syncs.py [sigterm-read-at-the-epoch-end] (2 ranks); the logged curves after a
# resume, in test_resume_from_mid_epoch_checkpoint_is_exact_and_says_it_verified_its_first_batch above
@pytest.mark.long
def test_sigterm_saves_last_and_exits_143_and_the_resume_is_exact(uninterrupted, tmp_path):
    proc = cli("fit", *BASE, *kill_at(33, signal.SIGTERM), cwd=tmp_path, check=False)
    assert proc.returncode == 143, proc.stderr[-2000:]
    (run,) = run_dirs(tmp_path)
    assert torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] in (
        33,
        34,
    )  # stops after the batch in flight
    cli("fit", *BASE, "--ckpt_path", "last", cwd=tmp_path)
    assert_same_run(uninterrupted, tmp_path)


@pytest.mark.long  # CI and make test-all; SIGTERM's save and resume: make test's are named above
def test_sigusr1_outside_slurm_saves_last_and_exits_as_sigterm_and_the_resume_is_exact(uninterrupted, tmp_path):
    # SIGUSR1 is what a scheduler sends ahead of a time limit (SLURM's --signal, others'); outside SLURM the engine
    # takes it as a SIGTERM (lightkeep.signals.Preemption.setup). Under SLURM it is Lightning's requeue: test_launch.py
    from lightning.pytorch.plugins.environments import SLURMEnvironment

    assert not SLURMEnvironment.detect()  # the precondition: the run (which inherits this environment) is not SLURM's
    proc = cli("fit", *BASE, *kill_at(33, signal.SIGUSR1), cwd=tmp_path, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 143, out[-2000:]  # as SIGTERM's, not -10 (killed by SIGUSR1's default action)
    assert "Preempted: saved" in out and "Traceback" not in out, out[-2000:]
    (run,) = run_dirs(tmp_path)
    saved = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)
    progress = saved["loops"]["fit_loop"]["epoch_loop.batch_progress"]["current"]["completed"]
    print(f"SIGUSR1 before step 34's batch: exit {proc.returncode}, last.ckpt of step {saved['global_step']}, "
          f"epoch {saved['epoch']} batch {progress}")  # fmt: skip
    # the signal comes as step 34's batch starts; the run stops after it: epoch 1's batch 14 of 20, mid-epoch
    assert saved["global_step"] == 34 and saved["epoch"] == 1 and progress == 14, (saved["global_step"], progress)
    cli("fit", *BASE, "--ckpt_path", "last", cwd=tmp_path)
    assert_same_run(uninterrupted, tmp_path)
    (_, ref), (_, got) = final_state(uninterrupted), final_state(tmp_path)
    weights = max_abs_diff(ref["state_dict"], got["state_dict"])
    optimizer = max_abs_diff(ref["optimizer_states"], got["optimizer_states"])
    print(f"resumed after SIGUSR1 vs uninterrupted: max |dw| {weights}, max |d optimizer state| {optimizer}")
    assert weights == optimizer == 0.0


@pytest.mark.long  # CI and make test-all; a signal's save and resume: make test's are named at the SIGTERM test
def test_ctrl_c_saves_last_and_exits_130_and_the_resume_is_exact(uninterrupted, tmp_path):
    proc = cli("fit", *BASE, *kill_at(27, signal.SIGINT), cwd=tmp_path, check=False)
    assert proc.returncode == 130, proc.stderr[-2000:]
    assert "Interrupted: saved" in proc.stdout + proc.stderr and "Traceback" not in proc.stderr
    (run,) = run_dirs(tmp_path)
    assert torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] in (27, 28)
    cli("fit", *BASE, "--ckpt_path", "last", cwd=tmp_path)
    assert_same_run(uninterrupted, tmp_path)


@pytest.mark.long  # CI and make test-all; Ctrl-C at an epoch's last batch: validation would cut it short
def test_ctrl_c_at_an_epochs_last_batch_finishes_its_validation_then_saves_last(uninterrupted, tmp_path):
    # Step 39 is epoch 1's last batch: Lightning's stop would land after the first batch of the validation that
    # follows, where no checkpoint resumes exactly. (CI saw this as a Ctrl-C under DDP that left no last.ckpt.)
    proc = cli("fit", *BASE, *kill_at(39, signal.SIGINT), cwd=tmp_path, check=False)
    assert proc.returncode == 130, proc.stderr[-2000:]
    assert "Interrupted: saved" in proc.stdout + proc.stderr and "Traceback" not in proc.stderr
    (run,) = run_dirs(tmp_path)
    assert torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 40
    assert [step for step, _ in scalars(run)["val/acc"]] == [19, 39]  # epoch 1's validation ran, whole
    cli("fit", *BASE, "--ckpt_path", "last", cwd=tmp_path)
    assert_same_run(uninterrupted, tmp_path)


@pytest.mark.long  # CI and make test-all; SIGTERM again, in validation
def test_sigterm_during_validation_keeps_the_last_checkpoint_and_the_resume_is_exact(uninterrupted, tmp_path):
    fault = ["--trainer.callbacks+=tests.faults.SignalInValidation", "--trainer.callbacks.epoch=1"]
    proc = cli("fit", *BASE, *fault, cwd=tmp_path, check=False)
    assert proc.returncode == 143 and "Preempted during validation" in proc.stdout + proc.stderr
    (run,) = run_dirs(tmp_path)
    assert max(saved_steps(run).values()) == 20  # nothing saved after epoch 0's end
    cli("fit", *BASE, "--ckpt_path", "last", cwd=tmp_path)
    assert_same_run(uninterrupted, tmp_path)  # epoch 1's validation point is there, once


@pytest.mark.long  # CI and make test-all; unreadable checkpoints: tests/test_bad_input.py
def test_truncated_checkpoint_names_the_file_and_last_picks_a_good_one(uninterrupted, tmp_path):
    proc = cli("fit", *BASE, *kill_at(45, settle=True), cwd=tmp_path, check=False)
    (run,) = run_dirs(tmp_path)
    last = newest_checkpoint(run)  # step 40 (the end of epoch 2): best 3 and every 2 epochs, one file, two names
    data = last.read_bytes()
    last.write_bytes(data[: seeded_random("truncation length").randint(1, len(data) - 1)])  # in place: both names
    intact = [read_global_step(p) for p in (run / "checkpoints").glob("*.ckpt") if is_loadable(p)]
    assert max(intact) == 20  # the oracle: what is left readable (the linked name of step 40 is damaged too)
    proc = cli("fit", *BASE, "--ckpt_path", str(last), cwd=tmp_path, check=False)
    assert proc.returncode == 2
    assert f"{last} is not a readable checkpoint" in proc.stderr and "newest other checkpoint" in proc.stderr
    assert "Traceback" not in proc.stderr
    proc = cli("fit", *BASE, "--ckpt_path", "last", cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert "resuming from" in out and f"global step {max(intact)}" in out  # the truncated files were skipped
    assert_same_run(uninterrupted, tmp_path)


@pytest.mark.long  # CI and make test-all; torchrun restarts: ~60 s
def test_restart_launcher_recovers_from_a_worker_crash_exactly(ddp_uninterrupted, tmp_path):
    """The restart loop starts both ranks again after rank 1 dies; they resume from last.ckpt."""
    reference, crashed = ddp_uninterrupted, tmp_path / "crashed"
    crashed.mkdir()
    fault = kill_at(33, rank=1, once_marker=tmp_path / "crashed-once")
    env = {**os.environ, "PYTHONPATH": PYTHONPATH, "PYTHON": sys.executable, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(
        [str(REPO / "scripts" / "train_resilient.sh"), "--max-restarts", "2", *STAND_IN, *DDP, *fault],
        cwd=crashed, env=env, capture_output=True, text=True, timeout=400,
    )  # fmt: skip
    (tmp_path / "launcher.log").write_text(proc.stdout + proc.stderr)
    assert proc.returncode == 0, f"see {tmp_path / 'launcher.log'}: {proc.stderr[-2000:]}"
    assert (tmp_path / "crashed-once").exists()  # the fault did fire
    # the restart says which rank died and from what it resumes, in one line, and resumes from exactly that
    restart = re.search(
        r"train_resilient: exit code 1: rank 1 was killed by SIGKILL \(kill -9, or out of memory\); newest complete"
        r" checkpoint, intact: (\S+) \(step (\d+)\); restart 1 of 2 from the newest checkpoint",
        proc.stderr,
    )
    assert restart, proc.stderr[-3000:]
    assert f"resuming from {restart[1]} (global step {restart[2]})" in proc.stdout + proc.stderr
    assert_same_run(reference, crashed)  # the epoch-level train metrics of the resumed epoch too


@pytest.mark.long  # CI and make test-all; ~40 s
def test_workers_torchrun_restarts_continue_their_run_exactly_without_a_ckpt_path(ddp_uninterrupted, tmp_path):
    """A torchrun command of one's own, ``--max-restarts`` and no ``--ckpt_path``: after rank 1 dies torchrun starts
    both workers again with the same arguments, and they continue the run they started (not a fresh version_1),
    from its newest checkpoint, bit-equal to the uninterrupted run that Lightning's launcher ran."""
    fault = kill_at(33, rank=1, once_marker=tmp_path / "crashed-once", settle=True)
    # the variable scripts/train_resilient.sh --torchrun sets: without it a restarted rank connected to its peer's
    # address of the previous attempt in 2 of 4 jobs, and torchrun restarted again (pytorch issue 135712)
    env = {**os.environ, "PYTHONPATH": PYTHONPATH, "PYTHONWARNINGS": "ignore"}
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", "2"]
    torchrun += ["--max-restarts", "3", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}"]
    proc = subprocess.run(
        [*torchrun, "-m", "project", "fit", *STAND_IN, *DDP, "--trainer.num_nodes", "1", *fault],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    (tmp_path / "torchrun.log").write_text(out)
    assert proc.returncode == 0, f"see {tmp_path / 'torchrun.log'}: {out[-3000:]}"
    assert (tmp_path / "crashed-once").exists()  # the fault did fire
    restarts = re.findall(r"torchrun restarted the workers \(restart (\d+)\): resuming the run from (\S+) \(", out)
    assert len(restarts) == 1 and restarts[0][0] == "1", restarts  # one restart, in its own run's folder
    assert restarts[0][1].startswith(f"runs/{RUN_NAME}/version_0/checkpoints/"), restarts
    assert_same_run(ddp_uninterrupted, tmp_path)  # one run folder (final_state), the same weights and curves
