"""Which parameters train (``lightkeep.trainable``), with Lightning's ``BaseFinetuning`` as its docs teach it: a
resume after the unfreeze trains the unfrozen block on, and its BatchNorm tracks its statistics again, as the
uninterrupted run (Lightning #21901); under DDP every rank syncs the block's gradients from the unfreeze on
(Lightning #20340), so that the ranks hold one model. Oracles: the uninterrupted run, and rank 0 against rank 1."""

import pytest
import torch

from tests.faults import kill_at
from tests.helpers import DDP2, QUIET, RUN_NAME, cli, cli_in_process, crash_in_process, max_abs_diff, run_dirs

FINETUNED = [*QUIET, "--trainer.max_epochs", "3", "--trainer.limit_train_batches", "6", "--trainer.limit_val_batches",
             "1", "--model.warmup", "1", "--model.net", "tests.fixtures.finetuning.WithBatchNorm",
             "--trainer.callbacks+=tests.fixtures.finetuning.FreezeFirstLayer",
             "--trainer.callbacks.unfreeze_at=1", "--trainer.callbacks+=ModelCheckpoint",
             "--trainer.callbacks.every_n_train_steps=4", "--trainer.callbacks.save_top_k=0",
             "--trainer.callbacks.save_last=true", "--trainer.callbacks.enable_version_counter=false"]  # fmt: skip


@pytest.mark.slow  # several real fits: make test runs it, make test-fast leaves it out
def test_a_resume_after_the_unfreeze_trains_the_unfrozen_block_as_the_uninterrupted_run(tmp_path, capsys):
    """6 steps an epoch, the block unfrozen at epoch 1; the crash at step 17 leaves last.ckpt of step 16 (epoch 2,
    where Lightning's callback unfreezes nothing): resumed, the block trains and its BatchNorm tracks, bit-equal to the
    uninterrupted run. Lightning alone resumes with the block frozen (its weights and statistics those of step 16)."""
    cli_in_process("fit", *FINETUNED, root=tmp_path / "reference")
    last = crash_in_process(17, *FINETUNED, root=tmp_path / "resumed")
    saved = torch.load(last, weights_only=True)
    assert saved["global_step"] == 16 and saved["epoch"] == 2
    assert saved["callbacks"]["Trainable"] == {"frozen": [], "untracked": []}  # unfrozen at epoch 1
    block = {k: v.clone() for k, v in saved["state_dict"].items() if k.startswith("net.layers.")}
    capsys.readouterr()
    cli_in_process("fit", *FINETUNED, "--ckpt_path", "last", root=tmp_path / "resumed")
    start = [x for x in capsys.readouterr().out.splitlines() if x.startswith("Run /")][-1]
    assert "exact resume: resume verified" in start and "opts out" not in start, start
    ref = torch.load(str(last).replace("resumed", "reference"), weights_only=True)["state_dict"]
    got = torch.load(last, weights_only=True)["state_dict"]
    assert got["net.layers.1.weight"].ne(block["net.layers.1.weight"]).any()  # trained on after the resume
    assert got["net.layers.2.running_mean"].ne(block["net.layers.2.running_mean"]).any()  # and tracked
    assert max_abs_diff({k: got[k] for k in ref}, ref) == 0.0


@pytest.mark.slow  # several real fits: make test runs it, make test-fast leaves it out
def test_a_checkpoint_before_the_unfreeze_keeps_the_block_frozen_until_its_epoch(tmp_path):
    """Frozen at the save (step 4, epoch 0): the record names the block, and the resumed run leaves it to Lightning's
    callback to unfreeze at epoch 1, bit-equal to the uninterrupted run."""
    cli_in_process("fit", *FINETUNED, "--trainer.max_epochs", "2", root=tmp_path / "reference")
    last = crash_in_process(5, *FINETUNED, "--trainer.max_epochs", "2", root=tmp_path / "resumed")
    assert torch.load(last, weights_only=True)["callbacks"]["Trainable"] == {
        "frozen": ["net.layers.1.weight", "net.layers.1.bias", "net.layers.2.weight", "net.layers.2.bias"],
        "untracked": ["net.layers.2"],
    }
    cli_in_process("fit", *FINETUNED, "--trainer.max_epochs", "2", "--ckpt_path", "last", root=tmp_path / "resumed")
    ref = torch.load(str(last).replace("resumed", "reference"), weights_only=True)["state_dict"]
    assert max_abs_diff(torch.load(last, weights_only=True)["state_dict"], ref) == 0.0


@pytest.mark.slow  # several real fits: make test runs it, make test-fast leaves it out
def test_a_resume_from_the_last_batch_end_before_the_unfreeze_unfreezes_at_the_epoch_it_starts(tmp_path):
    """A checkpoint of step 6, epoch 0's last batch end (a ModelCheckpoint every 6 steps keeping each file), taken
    with the block frozen; the block unfreezes at epoch 1, which the resume starts: the record keeps it frozen, and
    the epoch's start hooks (run as on a fresh epoch: the engine counts the saved epoch ended) unfreeze it after the
    record is set. Bit-equal to the uninterrupted run."""
    flags = [a.replace("every_n_train_steps=4", "every_n_train_steps=6").replace("save_top_k=0", "save_top_k=-1")
             for a in FINETUNED]  # fmt: skip
    cli_in_process("fit", *flags, root=tmp_path / "reference")
    cli_in_process("fit", *flags, "--trainer.max_epochs", "1", root=tmp_path / "resumed")
    step6 = tmp_path / "resumed" / RUN_NAME / "version_0" / "checkpoints" / "epoch=0-step=6.ckpt"
    saved = torch.load(step6, weights_only=True)
    assert saved["callbacks"]["Trainable"]["frozen"]  # frozen at the save
    assert saved["loops"]["fit_loop"]["epoch_loop.batch_progress"]["is_last_batch"]  # before the epoch's end
    cli_in_process("fit", *flags, "--ckpt_path", str(step6), root=tmp_path / "resumed")
    runs = sorted((tmp_path / "resumed" / RUN_NAME).glob("version_*"))
    got = torch.load(runs[-1] / "checkpoints" / "last.ckpt", weights_only=True)
    ref = torch.load(tmp_path / "reference" / RUN_NAME / "version_0" / "checkpoints" / "last.ckpt", weights_only=True)
    assert got["global_step"] == ref["global_step"] == 18
    assert max_abs_diff(got["state_dict"], ref["state_dict"]) == 0.0


DDP_FINETUNED = [*DDP2, *FINETUNED, "--trainer.callbacks+=tests.fixtures.finetuning.WeightsPerRank",
                 "--run.monitor", "null"]  # fmt: skip


def _ranks(run_dir):
    return [torch.load(run_dir / f"weights-rank{r}.pt", weights_only=True) for r in (0, 1)]


@pytest.mark.slow
def test_under_ddp_the_ranks_sync_the_block_they_unfreeze_and_hold_one_model(tmp_path):
    """Lightning's DDP syncs the parameters that trained when it wrapped the module: the block unfrozen at epoch 1
    trained on each rank's own gradient, and the ranks parted (0.029 apart after 2 epochs, measured). The engine
    builds DDP again at the unfreeze and says so: the ranks end equal."""
    proc = cli("fit", *DDP_FINETUNED, cwd=tmp_path)
    rank0, rank1 = _ranks(run_dirs(tmp_path)[-1])
    assert max_abs_diff(rank0, rank1) == 0.0
    said = [x for x in proc.stdout.splitlines() if "DistributedDataParallel built again" in x]
    assert said == [
        "Step 6: the parameters that train changed (net.layers.1.weight, net.layers.1.bias, net.layers.2.weight, ... "
        "(4 in all)): DistributedDataParallel built again around the module, so that it syncs their gradients"
    ], proc.stdout


@pytest.mark.long
def test_under_ddp_a_kill_after_the_unfreeze_resumes_exactly_on_both_ranks(tmp_path):
    """2 ranks, killed at step 17 (last.ckpt of step 16, after the unfreeze): resumed, what trains is set as the
    checkpoint is loaded, before DDP wraps the module, and both ranks end equal to the uninterrupted run."""
    for name in ("reference", "resumed"):
        (tmp_path / name).mkdir()
    cli("fit", *DDP_FINETUNED, cwd=tmp_path / "reference")
    cli("fit", *DDP_FINETUNED, *kill_at(17, settle=True), cwd=tmp_path / "resumed", check=False)
    proc = cli("fit", *DDP_FINETUNED, "--ckpt_path", "last", cwd=tmp_path / "resumed")
    ref, got = _ranks(run_dirs(tmp_path / "reference")[-1]), _ranks(run_dirs(tmp_path / "resumed")[-1])
    assert max_abs_diff(got[0], ref[0]) == 0.0
    assert max_abs_diff(got[0], got[1]) == 0.0
    assert "DistributedDataParallel built again" not in proc.stdout  # built around the restored block


@pytest.mark.long
def test_under_ddp_a_block_unfrozen_inside_a_step_is_refused_before_the_optimizer_steps(tmp_path):
    """Unfrozen in the module's own batch-start hook at step 3 (after the engine's check there), the block has
    gradients DDP did not sync: one line, before the optimizer step that would have moved the ranks apart."""
    never = [a.replace("unfreeze_at=1", "unfreeze_at=99") for a in DDP_FINETUNED]
    proc = cli("fit", "--model", "tests.fixtures.finetuning.UnfreezesInItsOwnHook", *never, cwd=tmp_path, check=False)
    assert proc.returncode == 1
    expected = (
        "error: net.layers.1.weight, net.layers.1.bias, net.layers.2.weight, ... began to train during training step 3 "
        "under DDP, which did not sync their gradients: the ranks would part"
    )
    assert expected in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-3000:]
