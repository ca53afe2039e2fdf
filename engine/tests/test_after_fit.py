"""``--run.test_after_fit true``: a finished fit tests its best checkpoint into the same run; the oracle is a separate
``test --ckpt_path FILE`` of the best file, found by the val/acc each ``best-*.ckpt`` was saved with."""

import logging
from pathlib import Path

import pytest
import torch

from tests.faults import kill_at
from tests.helpers import DDP2, QUIET, RUN_NAME, cli, cli_in_process, scalars

SMALL = [*QUIET, "--trainer.limit_train_batches", "4", "--model.net.init_args.hidden_sizes", "[32]",
         "--model.warmup", "0", "--model.lr", "0.01"]  # fmt: skip
AFTER = ["--run.test_after_fit", "true"]


def best_by_record(run) -> tuple[str, float]:
    """The best-*.ckpt with the highest val/acc in the ModelCheckpoint state it carries, and that score."""
    scores = {}
    for path in (run / "checkpoints").glob("best-*.ckpt"):
        (state,) = [s for k, s in torch.load(path, weights_only=True)["callbacks"].items() if "'val/acc'" in k]
        scores[str(path)] = float({Path(k).name: v for k, v in state["best_k_models"].items()}[path.name])
    assert scores, f"no best-*.ckpt in {run}"
    return max(scores.items(), key=lambda item: item[1])


def test_results(run) -> dict[str, list[tuple[int, float]]]:
    return {tag: points for tag, points in scalars(run).items() if tag.startswith("test/")}


test_results.__test__ = False  # a helper, not a test


def said(caplog: pytest.LogCaptureFixture) -> list[str]:
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Test after fit")]
    caplog.clear()
    return lines


def test_a_finished_fit_tests_its_best_checkpoint_into_the_same_run(tmp_path, caplog, capsys):
    caplog.set_level(logging.INFO)
    fit = cli_in_process("fit", *SMALL, *AFTER, "--trainer.max_epochs", "3", root=tmp_path)
    run = tmp_path / RUN_NAME / "version_0"
    best, score = best_by_record(run)
    assert said(caplog) == [f"Test after fit: best val/acc {score:.4f}: {best}"]
    # the test's start line names the file it tests, not "untrained weights"
    assert f"Run {run} (test of {best}) | 1 x cpu" in capsys.readouterr().out
    after = test_results(run)
    assert sorted(after) == ["test/acc", "test/loss"] and all(len(v) == 1 for v in after.values()), after
    assert after["test/acc"][0][0] == fit.trainer.global_step  # at the run's last step, on the same curves
    alone = cli_in_process("test", *SMALL, "--ckpt_path", best, root=tmp_path)
    separate = test_results(tmp_path / RUN_NAME / "version_1")
    assert alone.config["test"]["ckpt_path"] == best
    for tag in ("test/acc", "test/loss"):
        assert after[tag][0][1] == pytest.approx(separate[tag][0][1], abs=1e-6), (tag, after, separate)
    assert len(list((tmp_path / RUN_NAME).glob("version_*"))) == 2  # the test after fit made no folder of its own


def test_without_a_best_checkpoint_the_final_weights_are_tested_and_the_line_says_why(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    one = ["--trainer.max_epochs", "1", "--trainer.limit_val_batches", "2"]
    fit = cli_in_process("fit", *SMALL, *AFTER, *one, "--trainer.enable_checkpointing", "false", root=tmp_path)
    assert said(caplog) == ["Test after fit: no ModelCheckpoint with a monitor: the weights fit ended with"]
    assert sorted(test_results(tmp_path / RUN_NAME / "version_0")) == ["test/acc", "test/loss"]
    assert "test/acc" in fit.trainer.callback_metrics
    fast = cli_in_process("fit", *SMALL, *AFTER, "--trainer.fast_dev_run", "true", root=tmp_path)
    assert said(caplog) == ["Test after fit: fast_dev_run keeps no checkpoint: the weights fit ended with"]
    assert "test/acc" in fast.trainer.callback_metrics  # one batch, as fast_dev_run does for every stage
    off = cli_in_process("fit", *SMALL, *one, root=tmp_path)  # the default: no test
    assert said(caplog) == [] and "test/acc" not in off.trainer.callback_metrics


def test_a_preempted_fit_is_not_tested(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    sigterm = kill_at(6, sig=15)
    with pytest.raises(SystemExit) as stopped:
        cli_in_process("fit", *SMALL, *AFTER, "--trainer.max_epochs", "3", *sigterm, root=tmp_path)
    run = tmp_path / RUN_NAME / "version_0"
    assert stopped.value.code == 143 and (run / "checkpoints" / "last.ckpt").is_file()  # preempted, saved
    assert said(caplog) == [] and test_results(run) == {}
    assert "val/acc" in scalars(run)  # precondition: the run did log (an epoch validated) before it was stopped


@pytest.mark.long  # CI and make test-all; test after fit again, under DDP
@pytest.mark.slow  # DDP: a subprocess
def test_a_2_rank_ddp_fit_tests_its_best_on_both_ranks_equal_to_a_single_process_test(tmp_path):
    proc = cli("fit", *SMALL, *AFTER, *DDP2, "--trainer.max_epochs", "2", cwd=tmp_path, timeout=300)
    run = tmp_path / "runs" / RUN_NAME / "version_0"
    best, _ = best_by_record(run)
    assert (proc.stdout + proc.stderr).count("Test after fit: best val/acc") == 1  # rank 0 says it, once
    after = test_results(run)
    assert all(len(after[tag]) == 1 for tag in ("test/acc", "test/loss")), after
    cli_in_process("test", *SMALL, "--ckpt_path", best, root=tmp_path / "runs")
    separate = test_results(tmp_path / "runs" / RUN_NAME / "version_1")
    for tag in ("test/acc", "test/loss"):  # each test sample on exactly one rank: the single-process value
        assert after[tag][0][1] == pytest.approx(separate[tag][0][1], abs=1e-6), (tag, after, separate)
