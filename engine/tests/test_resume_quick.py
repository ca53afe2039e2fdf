"""The fast tier's resume check: a crashed single-process fit resumed from its mid-epoch last.ckpt ends bitwise equal
to the uninterrupted fit (the subprocess kills, DDP and the flag matrix are in the slow tier)."""

import pytest
import torch

from tests.helpers import QUIET, RUN_NAME, cli_in_process, crash_in_process

ARGS = [*QUIET, "--trainer.max_epochs", "2", "--trainer.limit_train_batches", "6", "--trainer.limit_val_batches", "1",
        "--model.warmup", "1", "--trainer.callbacks+=ModelCheckpoint", "--trainer.callbacks.every_n_train_steps=4",
        "--trainer.callbacks.save_top_k=0", "--trainer.callbacks.save_last=true",
        "--trainer.callbacks.enable_version_counter=false"]  # fmt: skip


def test_crashed_fit_resumes_mid_epoch_bitwise_equal_and_says_it_verified_its_first_batch(tmp_path, capsys):
    cli_in_process("fit", *ARGS, root=tmp_path / "reference")
    last = crash_in_process(10, *ARGS, root=tmp_path / "resumed")
    saved = torch.load(last, weights_only=True)
    progress = saved["loops"]["fit_loop"]["epoch_loop.batch_progress"]
    assert saved["global_step"] == 8 and 0 < progress["current"]["completed"] < 6  # mid-epoch: epoch 1 of 6 batches
    capsys.readouterr()
    cli_in_process("fit", *ARGS, "--ckpt_path", "last", root=tmp_path / "resumed")
    start = [line for line in capsys.readouterr().out.splitlines() if line.startswith("Run /")][-1]
    expected = "exact resume: resume verified (epoch 1, batch 2: 64 samples on 1 rank(s), those the checkpoint's run"
    assert expected in start, start
    ref = torch.load(str(last).replace("resumed", "reference"), weights_only=True)["state_dict"]
    got = torch.load(last, weights_only=True)["state_dict"]
    assert all(torch.equal(got[k], v) for k, v in ref.items() if k.startswith("net."))


def test_resume_on_another_number_of_threads_says_it_is_not_bit_exact(tmp_path, capsys):
    cli_in_process("fit", *ARGS, root=tmp_path)
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)  # a CPU matmul's sums split differently: not the run that was saved
    try:
        cli_in_process("fit", *ARGS, "--trainer.max_epochs", "3", "--ckpt_path", "last", root=tmp_path)
    finally:
        torch.set_num_threads(threads)
    start = [line for line in capsys.readouterr().out.splitlines() if line.startswith("Run /")][-1]  # the resume's
    assert f"the checkpoint was computed on {threads} CPU thread(s), this run on {threads + 1}" in start, start


@pytest.mark.slow  # several real fits: make test runs it, make test-fast leaves it out
def test_a_net_compiled_in_configure_model_resumes_exactly_validates_and_exports_under_its_own_keys(tmp_path):
    """``torch.compile`` in ``configure_model`` saves the network as ``net._orig_mod.*``. The check before a run
    built the module without ``configure_model`` and refused every resume and validate of such a checkpoint ("a
    different network ... net.layers.1.bias is missing"), naming a --config that did not help; the export wrote
    ``_orig_mod`` keys that ``load_net`` could not load. Now: resumed mid-epoch bitwise equal to the uninterrupted
    run, validated, and exported with the keys of the network as built (``load_net`` gives the checkpoint's)."""
    from lightkeep import load_net
    from lightkeep.export.formats import export

    compiled = [*ARGS, "--model", "tests.fixtures.compiled.CompiledStandIn"]
    cli_in_process("fit", *compiled, root=tmp_path / "reference")
    last = crash_in_process(10, *compiled, root=tmp_path / "resumed")
    assert any("._orig_mod." in k for k in torch.load(last, weights_only=True)["state_dict"])  # the precondition
    cli_in_process("fit", *compiled, "--ckpt_path", "last", root=tmp_path / "resumed")
    ref = torch.load(str(last).replace("resumed", "reference"), weights_only=True)["state_dict"]
    got = torch.load(last, weights_only=True)["state_dict"]
    assert ref.keys() == got.keys() and all(torch.equal(ref[k], got[k]) for k in ref)
    validated = cli_in_process("validate", *compiled, "--ckpt_path", "last", root=tmp_path / "resumed")
    assert "val/acc" in validated.trainer.callback_metrics
    (path,) = export(last, tmp_path / "export", ("safetensors",), say=lambda _: None)
    loaded = load_net(path).state_dict()
    as_built = {k.replace("._orig_mod.", "."): v for k, v in got.items()}
    assert loaded.keys() == as_built.keys() and all(torch.equal(loaded[k], v) for k, v in as_built.items())


def test_a_checkpoint_saved_in_the_middle_of_an_accumulation_says_so_on_its_resume(tmp_path, capsys):
    """A save of the user's own within an optimizer step's batches (here a ModelCheckpoint at a validation every 3
    batches, accumulating 2; a timer's is the same): the first batch's gradients are in no checkpoint, so the resume
    takes that step on its second batch only. It said `resume verified`; it now says no, naming the step, and the
    resumed weights do differ from the uninterrupted run's (the oracle)."""
    args = [*QUIET, "--trainer.max_epochs", "1", "--trainer.limit_train_batches", "6", "--trainer.limit_val_batches",
            "1", "--model.warmup", "1", "--trainer.accumulate_grad_batches", "2", "--trainer.val_check_interval", "3",
            "--trainer.callbacks+=ModelCheckpoint", "--trainer.callbacks.save_top_k=-1",
            "--trainer.callbacks.filename={step}-{epoch}-at-validation"]  # fmt: skip
    cli_in_process("fit", *args, root=tmp_path)
    run = tmp_path / RUN_NAME / "version_0" / "checkpoints"
    mid = run / "step=1-epoch=0-at-validation.ckpt"  # after batch 3: step 2's first batch accumulated
    assert torch.load(mid, weights_only=True)["global_step"] == 1
    capsys.readouterr()
    cli_in_process("fit", *args, "--ckpt_path", str(mid), root=tmp_path)
    start = [line for line in capsys.readouterr().out.splitlines() if line.startswith("Run /")][-1]
    said = "exact resume: no: the checkpoint was saved 1 batch(es) into optimizer step 2's gradient accumulation"
    assert said in start, start
    ref = torch.load(run / "last.ckpt", weights_only=True)["state_dict"]
    got = torch.load(tmp_path / RUN_NAME / "version_1" / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]
    assert any(not torch.equal(ref[k], got[k]) for k in ref)  # what it says: not the uninterrupted run's
