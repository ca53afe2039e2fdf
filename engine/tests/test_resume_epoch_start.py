"""What Lightning's own callbacks set at an epoch's start, on a resume that Lightning starts without calling
``on_train_epoch_start`` (mid-epoch): a ``GradientAccumulationScheduler``'s accumulation; and at an epoch's start
after a checkpoint of the previous epoch's last batch end, which was exact already and stays so. And a checkpoint
saved while a batch was under way (an exception's save: ``OnExceptionCheckpoint``), whose resume cannot be exact
and says so; Lightning's ``SpikeDetection``, which cannot load its own state. Oracle: the uninterrupted run."""

import pytest
import torch

from tests.faults import kill_at
from tests.helpers import DDP2, QUIET, RUN_NAME, cli, cli_in_process, crash_in_process, max_abs_diff, run_dirs

pytestmark = pytest.mark.slow  # each test fits three times (the reference, the crash, the resume)

BASE = [*QUIET, "--trainer.max_epochs", "4", "--trainer.limit_train_batches", "6", "--trainer.limit_val_batches", "1",
        "--model.warmup", "1"]  # fmt: skip
SCHEDULED = [
    *BASE,
    "--trainer.callbacks+=GradientAccumulationScheduler",
    '--trainer.callbacks.scheduling={"0": 1, "2": 2}',
]


def saving_every(steps: int) -> list[str]:
    return ["--trainer.callbacks+=ModelCheckpoint", f"--trainer.callbacks.every_n_train_steps={steps}",
            "--trainer.callbacks.save_top_k=0", "--trainer.callbacks.save_last=true",
            "--trainer.callbacks.enable_version_counter=false"]  # fmt: skip


def _last(root):
    return root / RUN_NAME / "version_0" / "checkpoints" / "last.ckpt"


@pytest.mark.parametrize(
    ("every", "crash", "where"),
    [(13, 14, "mid-epoch: epoch 2, after its first optimizer step of 2 batches"),
     (12, 13, "at epoch 1's last batch end: epoch 2 starts on the resume, with the scheduler's hook")],
    ids=["mid-epoch", "epoch-end"],
)  # fmt: skip
def test_a_scheduled_accumulation_is_the_schedules_after_a_resume_lightning_starts_without_its_hook(
    every, crash, where, tmp_path, capsys
):
    """Accumulation 1 in epochs 0-1 and 2 from epoch 2 (6 batches an epoch: 18 optimizer steps). Resumed mid-epoch,
    Lightning does not call the scheduler's ``on_train_epoch_start``, so the resumed run accumulated 1 (20 steps,
    weights 5.0e-3 off, measured). Now 18 steps, bit-equal to the uninterrupted run; from the epoch's end too."""
    cli_in_process("fit", *SCHEDULED, *saving_every(every), root=tmp_path / "reference")
    crash_in_process(crash, *SCHEDULED, *saving_every(every), root=tmp_path / "resumed")
    assert torch.load(_last(tmp_path / "resumed"), weights_only=True)["global_step"] == every, where
    cli_in_process("fit", *SCHEDULED, *saving_every(every), "--ckpt_path", "last", root=tmp_path / "resumed")
    ref = torch.load(_last(tmp_path / "reference"), weights_only=True)
    got = torch.load(_last(tmp_path / "resumed"), weights_only=True)
    assert (got["global_step"], ref["global_step"]) == (18, 18)
    assert max_abs_diff(got["state_dict"], ref["state_dict"]) == 0.0


@pytest.mark.long
def test_a_scheduled_accumulation_on_2_ranks_resumed_mid_epoch_is_the_schedules(tmp_path):
    """The same on 2 DDP ranks (6 batches an epoch on each), killed at step 14 after last.ckpt of step 13: 18 steps,
    bit-equal (measured before: 20, weights 5.1e-3 off)."""
    flags = [*DDP2, *SCHEDULED, *saving_every(13)]
    for name in ("reference", "resumed"):
        (tmp_path / name).mkdir()
    cli("fit", *flags, cwd=tmp_path / "reference")
    cli("fit", *flags, *kill_at(14, settle=True), cwd=tmp_path / "resumed", check=False)
    last = run_dirs(tmp_path / "resumed")[-1] / "checkpoints" / "last.ckpt"
    assert torch.load(last, weights_only=True)["global_step"] == 13
    cli("fit", *flags, "--ckpt_path", "last", cwd=tmp_path / "resumed")
    ref, got = (torch.load(run_dirs(tmp_path / n)[-1] / "checkpoints" / "last.ckpt", weights_only=True)
                for n in ("reference", "resumed"))  # fmt: skip
    assert (got["global_step"], ref["global_step"]) == (18, 18)
    assert max_abs_diff(got["state_dict"], ref["state_dict"]) == 0.0


def test_a_checkpoint_saved_while_a_batch_was_under_way_says_so_on_its_resume(tmp_path, capsys):
    """``OnExceptionCheckpoint`` saves when the crash comes, at the start of step 10's batch (epoch 1, batch 4),
    fetched and never trained. The engine's record counted it as trained: the resume went on from batch 5 under
    ``resume verified`` (weights 1.6e-2 off the uninterrupted run, measured). The resume now says it is not exact."""
    exc = tmp_path / "exc"
    flags = [*BASE, "--trainer.callbacks+=OnExceptionCheckpoint", f"--trainer.callbacks.dirpath={exc}"]
    crash_in_process(10, *flags, root=tmp_path)
    saved = torch.load(exc / "on_exception.ckpt", weights_only=True)
    progress = saved["loops"]["fit_loop"]["epoch_loop.batch_progress"]["current"]
    assert (progress["ready"], progress["processed"]) == (5, 4)
    capsys.readouterr()
    cli_in_process("fit", *flags, "--ckpt_path", str(exc / "on_exception.ckpt"), root=tmp_path)
    start = [x for x in capsys.readouterr().out.splitlines() if x.startswith("Run /")][-1]
    assert "exact resume: no: the checkpoint was saved while training batch 4 of epoch 1 was under way" in start, start


@pytest.mark.parametrize(  # the epoch's end: CI and make test-all
    ("every", "crash"), [(4, 10), pytest.param(6, 7, marks=pytest.mark.long)], ids=["mid-epoch", "epoch-end"]
)
def test_lightnings_spike_detection_resumes_exactly_and_its_window_left_out_of_the_checkpoint_is_named(
    every, crash, tmp_path, capsys
):
    """Lightning 2.6's ``SpikeDetection`` cannot load its own state (``self.running``, which it lacks): every resume
    ended in a 35-line ``AttributeError`` traceback, after a start line that promised an exact resume (measured).
    The engine gives its load the name it reads: the resume is bit-equal, and both start lines name the window of
    recent losses that Lightning leaves out of the checkpoint."""
    flags = [*BASE, *saving_every(every), "--trainer.callbacks+=SpikeDetection"]
    cli_in_process("fit", *flags, root=tmp_path / "reference")
    crash_in_process(crash, *flags, root=tmp_path / "resumed")
    capsys.readouterr()
    cli_in_process("fit", *flags, "--ckpt_path", "last", root=tmp_path / "resumed")
    start = [x for x in capsys.readouterr().out.splitlines() if x.startswith("Run /")][-1]
    assert "exact resume: resume verified" in start, start
    assert "SpikeDetection: its window of recent losses is in no checkpoint" in start, start
    ref = torch.load(_last(tmp_path / "reference"), weights_only=True)
    got = torch.load(_last(tmp_path / "resumed"), weights_only=True)
    assert max_abs_diff(got["state_dict"], ref["state_dict"]) == 0.0
    assert max_abs_diff(got["optimizer_states"], ref["optimizer_states"]) == 0.0


def test_the_modules_own_epoch_start_runs_on_a_resume_inside_an_epoch_and_a_callbacks_is_named(tmp_path, capsys):
    """The module sets its loss weight (1 + epoch) in ``on_train_epoch_start``, which Lightning does not call on a
    resume inside epoch 2: the resumed run trained that epoch's rest at weight 1.0 where the uninterrupted run had
    3.0. The engine calls the module's hook there: bit-equal. A callback of the user's own with that hook is named."""
    flags = [*BASE, "--model", "tests.fixtures.epoch_start.EpochWeighted", *saving_every(13),
             "--trainer.callbacks+=tests.fixtures.epoch_start.EpochNoted"]  # fmt: skip
    cli_in_process("fit", *flags, root=tmp_path / "reference")
    crash_in_process(14, *flags, root=tmp_path / "resumed")
    capsys.readouterr()
    cli_in_process("fit", *flags, "--ckpt_path", "last", root=tmp_path / "resumed")
    ref = torch.load(_last(tmp_path / "reference"), weights_only=True)
    got = torch.load(_last(tmp_path / "resumed"), weights_only=True)
    assert max_abs_diff(got["state_dict"], ref["state_dict"]) == 0.0
    start = [x for x in capsys.readouterr().out.splitlines() if x.startswith("Run /")][-1]
    named = (
        "on_train_epoch_start of EpochNoted: Lightning does not call a callback's epoch start on a resume "
        "inside an epoch"
    )
    assert "exact resume: resume verified" in start and named in start, start
    assert "epoch (2 saved, None now) of EpochNoted: a plain attribute" in start, start  # what it set, not set again
    assert "on_train_epoch_start of EpochWeighted: called again on this resume inside an epoch" in start, start


def test_a_modules_own_batch_end_is_in_the_checkpoints_saved_there_and_resumes_exactly(tmp_path, capsys):
    """Lightning calls the callbacks' ``on_train_batch_end`` (where checkpoints are saved) before the module's: an
    average the module updates there was one update short in each such checkpoint, and a resume from step 8's ended
    with another average (the weights equal). The engine calls the module's hook before the checkpoint callbacks':
    the average too is bit-equal to the uninterrupted run's, under ``resume verified``."""
    flags = [*BASE, "--model", "tests.fixtures.epoch_start.EmaAtBatchEnd", *saving_every(4)]
    cli_in_process("fit", *flags, root=tmp_path / "reference")
    last = crash_in_process(10, *flags, root=tmp_path / "resumed")
    assert torch.load(last, weights_only=True)["global_step"] == 8  # saved at a batch end, mid-epoch 1
    capsys.readouterr()
    cli_in_process("fit", *flags, "--ckpt_path", "last", root=tmp_path / "resumed")
    start = [x for x in capsys.readouterr().out.splitlines() if x.startswith("Run /")][-1]
    assert "exact resume: resume verified" in start and "opts out" not in start, start
    ref = torch.load(_last(tmp_path / "reference"), weights_only=True)["state_dict"]
    got = torch.load(last, weights_only=True)["state_dict"]
    assert max_abs_diff(got, ref) == 0.0


def test_an_average_swapped_in_for_validation_is_swapped_back_in_the_checkpoints_saved_at_its_end(tmp_path, capsys):
    """The module evaluates an EMA of its weights in their place, swapped in at ``on_validation_start`` and back at
    ``on_validation_end``; Lightning calls the module's ``on_validation_end`` after the callbacks', and with
    ``val_check_interval`` 0.5 the checkpoints are saved at the validation's end: they held the average as the
    weights, and a resume from step 12's trained on from the average (2e-2 off the uninterrupted run under
    ``resume verified``, measured). Now bit-equal, and the best score is the uninterrupted run's."""
    flags = [*BASE, "--model", "tests.fixtures.epoch_start.EmaSwappedForValidation", "--trainer.val_check_interval",
             "0.5"]  # fmt: skip
    reference = cli_in_process("fit", *flags, root=tmp_path / "reference")
    crash_in_process(14, *flags, root=tmp_path / "resumed")
    folder = _last(tmp_path / "resumed").parent
    saved = torch.load(folder / "best-epoch001-step12.ckpt", weights_only=True)
    assert saved["global_step"] == 12  # the best file of epoch 1's second validation, saved at its end
    capsys.readouterr()
    resumed = cli_in_process("fit", *flags, "--ckpt_path", "last", root=tmp_path / "resumed")
    start = [x for x in capsys.readouterr().out.splitlines() if x.startswith("Run /")][-1]
    assert "(continues from step 12 of" in start and "exact resume: resume verified" in start, start
    ref = torch.load(_last(tmp_path / "reference"), weights_only=True)["state_dict"]
    got = torch.load(_last(tmp_path / "resumed"), weights_only=True)["state_dict"]
    assert max_abs_diff(got, ref) == 0.0
    assert resumed.judge.best_model_score == reference.judge.best_model_score


def test_a_resume_from_an_epochs_last_batch_end_counts_the_next_epoch_and_its_checkpoints_resume_again(tmp_path):
    """Validation every 2 epochs, a save at epoch 0's last batch end (no validation there) and a crash after it.
    Lightning starts epoch 1 of the resume without counting it ready and started, so each later checkpoint's
    ``epoch_progress`` was one epoch short (3 of 4): the weights were bit-equal, but that run's last.ckpt, extended to
    5 epochs, trained 1 more step where the uninterrupted run's trained 6 (another restart path). Now both counts and
    the extension are the uninterrupted run's."""
    flags = [*BASE, "--model.max_schedule", "5", "--trainer.check_val_every_n_epoch", "2", *saving_every(6)]
    cli_in_process("fit", *flags, root=tmp_path / "reference")
    last = crash_in_process(7, *flags, root=tmp_path / "resumed")
    saved = torch.load(last, weights_only=True)
    epochs = saved["loops"]["fit_loop"]["epoch_progress"]["current"]
    assert (saved["global_step"], epochs["started"], epochs["processed"]) == (6, 1, 0)  # epoch 0's last batch end
    cli_in_process("fit", *flags, "--ckpt_path", "last", root=tmp_path / "resumed")
    ref, got = (torch.load(_last(tmp_path / name), weights_only=True) for name in ("reference", "resumed"))
    assert got["loops"]["fit_loop"]["epoch_progress"] == ref["loops"]["fit_loop"]["epoch_progress"]
    for name in ("reference", "resumed"):
        cli_in_process("fit", *flags, "--trainer.max_epochs", "5", "--ckpt_path", "last", root=tmp_path / name)
    ref, got = (torch.load(_last(tmp_path / name), weights_only=True) for name in ("reference", "resumed"))
    assert got["global_step"] == ref["global_step"] == 30
    assert max_abs_diff(got["state_dict"], ref["state_dict"]) == 0.0


def test_a_data_modules_state_changed_again_on_the_resume_says_no_naming_the_key(tmp_path, capsys):
    """The data module advances a stage kept in its ``state_dict`` at each ``train_dataloader`` call; Lightning
    restores the state and calls the hook again for the epoch the resume lands in, so the resumed run is a stage
    ahead (2.7e-2 off, measured). The first batch alone looked the same, and the start line said ``resume verified``;
    it now compares the data module's state with the checkpoint's and says ``no``, naming the key."""
    flags = [*BASE, "--data", "tests.fixtures.curriculum.StagedByCalls", "--trainer.reload_dataloaders_every_n_epochs",
             "1", *saving_every(4)]  # fmt: skip
    cli_in_process("fit", *flags, root=tmp_path / "reference")
    with pytest.raises(RuntimeError, match="injected crash"):
        cli_in_process("fit", *flags, "--trainer.callbacks+=tests.faults.CrashAt", "--trainer.callbacks.step=5",
                       root=tmp_path / "resumed")  # fmt: skip
    capsys.readouterr()
    cli_in_process("fit", *flags, "--ckpt_path", "last", root=tmp_path / "resumed")
    start = [x for x in capsys.readouterr().out.splitlines() if x.startswith("Run /")][-1]
    assert "exact resume: no: StagedByCalls.state_dict()['stage'] (2 where the checkpoint held 1) at this " \
           "resume's first batch is not the checkpoint's" in start, start  # fmt: skip
    ref, got = (torch.load(tmp_path / name / "staged_by_calls" / "version_0" / "checkpoints" / "last.ckpt",
                           weights_only=True)["state_dict"] for name in ("reference", "resumed"))  # fmt: skip
    assert max_abs_diff(got, ref) > 0.0  # the difference it names is real


def test_a_list_the_module_fills_in_training_is_named_on_a_resume_mid_epoch(tmp_path, capsys):
    """``self.training_step_outputs``, appended each step and averaged in ``on_train_epoch_end`` (Lightning 2's
    docs): plain state, in no checkpoint, so the resumed epoch's mean covers the batches after the resume (2.1647
    for 2.1877, measured) under ``resume verified``. The start line names the list, its length at the save, and what
    keeps such a value."""
    flags = [*BASE, "--model", "tests.fixtures.epoch_start.OutputsKept", *saving_every(4)]
    crash_in_process(10, *flags, root=tmp_path)
    capsys.readouterr()
    cli_in_process("fit", *flags, "--ckpt_path", "last", root=tmp_path)
    start = [x for x in capsys.readouterr().out.splitlines() if x.startswith("Run /")][-1]
    assert "opts out: training_step_outputs (2 items) of OutputsKept: a list the module filled in training, which " \
           "no checkpoint holds" in start, start  # fmt: skip


@pytest.mark.parametrize(
    "model",
    [
        "Counting",
        "CountingOnTheDevice",
        "CountingInASubmodule",
        pytest.param("CountingInAnUnsavedBuffer", marks=pytest.mark.long),  # test_plain_state checks it in make test
        "CountingKept",
    ],
)
def test_a_count_the_module_keeps_in_a_plain_attribute_is_named_on_a_resume_unless_its_checkpoint_holds_it(
    model, tmp_path, capsys
):
    """``self.seen``, the samples trained on, warms the loss up: a plain attribute (an int, or a tensor that is no
    buffer, or one in a submodule of the user's own) or a buffer registered with ``persistent=False``, in no
    checkpoint, so a resume restarts it at 0 and trains on another curve under ``resume verified`` (1.28e-2 off,
    measured). The start line names it with both values. Kept by the module's ``on_save_checkpoint`` /
    ``on_load_checkpoint``, it resumes bit-equal and is not named."""
    kept = model == "CountingKept"
    flags = [*BASE, "--model", f"tests.fixtures.epoch_start.{model}", *saving_every(13)]
    cli_in_process("fit", *flags, root=tmp_path / "reference")
    crash_in_process(16, *flags, root=tmp_path / "resumed")
    capsys.readouterr()
    cli_in_process("fit", *flags, "--ckpt_path", "last", root=tmp_path / "resumed")
    start = [x for x in capsys.readouterr().out.splitlines() if x.startswith("Run /")][-1]
    ref = torch.load(_last(tmp_path / "reference"), weights_only=True)
    got = torch.load(_last(tmp_path / "resumed"), weights_only=True)
    diff = max_abs_diff(got["state_dict"], ref["state_dict"])
    whose = "self.warmup (SampleWarmup)" if model == "CountingInASubmodule" else model
    what = "a buffer registered with persistent=False" if model == "CountingInAnUnsavedBuffer" else "a plain attribute"
    named = f"seen (832 saved, 0 now) of {whose}: {what}, in no checkpoint, differs"
    if kept:
        assert diff == 0.0 and "seen (" not in start, (diff, start)
    else:  # the precondition: the resumed run really differs
        assert diff > 0.0 and named in start, (diff, start)
    assert "exact resume: resume verified" in start, start


def test_a_count_a_callback_of_ones_own_keeps_in_a_plain_attribute_is_named_unless_its_state_dict_holds_it(
    tmp_path, capsys
):
    """Two callbacks count the batches trained: one in a plain attribute, named at the resume with both values (13
    at the save, 0 on the resume); one whose ``state_dict`` holds its count, restored by Lightning and not named."""
    flags = [*BASE, *saving_every(13), "--trainer.callbacks+=tests.fixtures.epoch_start.BatchesCounted",
             "--trainer.callbacks+=tests.fixtures.epoch_start.BatchesCountedKept"]  # fmt: skip
    crash_in_process(16, *flags, root=tmp_path)
    capsys.readouterr()
    cli = cli_in_process("fit", *flags, "--ckpt_path", "last", root=tmp_path)
    start = [x for x in capsys.readouterr().out.splitlines() if x.startswith("Run /")][-1]
    assert "batches (13 saved, 0 now) of BatchesCounted: a plain attribute" in start, start
    assert "of BatchesCountedKept" not in start, start
    kept = next(c for c in cli.trainer.callbacks if type(c).__name__ == "BatchesCountedKept")
    assert kept.batches == 24  # 4 epochs of 6: the count went on from the checkpoint's 13
