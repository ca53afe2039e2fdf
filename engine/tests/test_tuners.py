"""Lightning's tuner callbacks, ``LearningRateFinder`` and ``BatchSizeFinder``, in a run that is killed and resumed
with the same config. Oracle: the uninterrupted run, which searched once at its start."""

import pytest
import torch

from tests.helpers import QUIET, RUN_NAME, cli_in_process, crash_in_process, max_abs_diff

pytestmark = pytest.mark.slow  # each test fits three times (the reference, the crash, the resume)

BASE = [*QUIET, "--trainer.max_epochs", "4", "--trainer.limit_train_batches", "6", "--trainer.limit_val_batches", "1",
        "--model.warmup", "1", "--trainer.callbacks+=ModelCheckpoint", "--trainer.callbacks.every_n_train_steps=4",
        "--trainer.callbacks.save_top_k=0", "--trainer.callbacks.save_last=true",
        "--trainer.callbacks.enable_version_counter=false"]  # fmt: skip
TUNERS = {
    "LearningRateFinder": ["--trainer.callbacks+=LearningRateFinder", "--trainer.callbacks.num_training_steps=20"],
    "BatchSizeFinder": ["--trainer.callbacks+=BatchSizeFinder", "--trainer.callbacks.max_trials=3",
                        "--trainer.callbacks.steps_per_trial=1"],  # 2, 4, 8 per batch: 8 found
}  # fmt: skip


def _start_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("Run /")]


@pytest.mark.parametrize(
    ("tuner", "flags"),
    [("LearningRateFinder", TUNERS["LearningRateFinder"]), ("BatchSizeFinder", TUNERS["BatchSizeFinder"]),
     ("LearningRateFinder", [*TUNERS["LearningRateFinder"], "--model", "tests.fixtures.epoch_start.PlainRate"]),
     ("LearningRateFinder", ["--model", "tests.fixtures.epoch_start.FindsItsRate"])],
    ids=["LearningRateFinder", "BatchSizeFinder", "LearningRateFinder-on-self.lr", "from-configure_callbacks"],
)  # fmt: skip
def test_a_tuners_run_resumes_exactly_with_what_it_found_and_without_searching_again(tuner, flags, tmp_path, capsys):
    """The tuner searches at the fit's start (a rate of 5e-4 where the config says 3e-3; a batch of 8 where it says
    64). It saves, trains on and restores a temporary checkpoint, which Lightning then took for the fit's: a fresh
    run's start line was a resume's, and on a resume that restore consumed the checkpoint, so Lightning restored no
    optimizer, schedule or step (3.7e-2 off the uninterrupted run; a BatchSizeFinder's resume was refused in one line
    as another global batch). Now the fresh run says so, and the resume continues with what the search found,
    without a second search: bit-equal. A module's own ``self.lr``, where the finder wrote its rate, has it again on
    the resume (it had the config's, named as a plain attribute that differs). A tuner the module's
    ``configure_callbacks`` returns, which joins the Trainer's callbacks at the fit's setup, is run once as well (it
    searched again on a resume, under ``exact resume``)."""
    flags = [*BASE, *flags]
    reference = cli_in_process("fit", *flags, root=tmp_path / "reference")
    last = crash_in_process(10, *flags, root=tmp_path / "resumed")
    fresh = _start_lines(capsys.readouterr().out)
    assert len(fresh) == 2 and all("(fresh)" in x and "exact resume: yes, also mid-epoch" in x for x in fresh), fresh
    saved = torch.load(last, weights_only=True)
    assert saved["global_step"] == 8
    group = saved["optimizer_states"][0]["param_groups"][0]
    assert (group["initial_lr"] != 3e-3) == (tuner == "LearningRateFinder")  # the search's result is in use
    resumed = cli_in_process("fit", *flags, "--ckpt_path", "last", root=tmp_path / "resumed")
    (start,) = _start_lines(capsys.readouterr().out)
    assert "a plain attribute" not in start, start
    assert getattr(resumed.model, "lr", None) == getattr(reference.model, "lr", None)
    batch = 8 if tuner == "BatchSizeFinder" else 64
    assert f"exact resume: resume verified (epoch 1, batch 2: {batch} samples on 1 rank(s)" in start, start
    assert f"opts out: {tuner}: not run on this resume" in start, start
    ref, got = (torch.load(r / RUN_NAME / "version_0" / "checkpoints" / "last.ckpt", weights_only=True)
                for r in (tmp_path / "reference", tmp_path / "resumed"))  # fmt: skip
    assert got["global_step"] == ref["global_step"] == 24
    assert max_abs_diff(got["state_dict"], ref["state_dict"]) == 0.0
    assert max_abs_diff(got["optimizer_states"], ref["optimizer_states"]) == 0.0


def test_a_resume_takes_the_configs_tuners_out_before_the_trainer_is_built():
    """A ``BatchSizeFinder``'s own ``setup`` refuses DDP, which a resume may run on (elastic): the config's tuners are
    taken out of the callbacks the Trainer is built with, not at the fit's setup, where only the module's
    ``configure_callbacks``' are (Lightning runs their ``setup`` first, as it would without the engine)."""
    from lightning.pytorch.callbacks import BatchSizeFinder, LearningRateFinder, ModelSummary

    from lightkeep.resume import ExactResume
    from lightkeep.tuners import TunersOnceARun

    other, finders = ModelSummary(), [BatchSizeFinder(batch_arg_name="batch_size"), LearningRateFinder()]
    resuming = TunersOnceARun(resuming=True, resume=ExactResume(None))
    assert resuming.leave_out([finders[0], other, finders[1]]) == [other]
    assert resuming.not_run_again == ["BatchSizeFinder", "LearningRateFinder"]
    assert resuming.batch_size_names == ["batch_size"] and resuming.lr_finders == [finders[1]]
    fresh = TunersOnceARun(resuming=False, resume=ExactResume(None))
    assert fresh.leave_out([finders[0], other]) == [finders[0], other] and fresh.not_run_again == []
