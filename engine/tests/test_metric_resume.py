"""An epoch's torchmetrics state, and the running sums of tensors logged with ``on_epoch=True``, survive a mid-epoch
resume (lightkeep.resume), for a module that does nothing for them; the metric states stay out of the weights."""

import pytest
import torch

from tests.faults import kill_at
from tests.helpers import DDP2, QUIET, cli, cli_in_process, scalars


def test_a_mid_epoch_resume_logs_the_uninterrupted_runs_epoch_metric(tmp_path):
    reference, run, saved = _killed_at_step_18_and_resumed(_config(tmp_path, "MetricModel"), tmp_path)
    done = saved["loops"]["fit_loop"]["epoch_loop.batch_progress"]["current"]["completed"]
    assert 0 < done < 12  # mid-epoch: epoch 1, 4 of its 12 batches
    assert not any("train_acc" in key for key in saved["state_dict"])  # the weights alone
    expected, got = scalars(reference)["train/acc"], scalars(run)["train/acc"]
    print(f"train/acc uninterrupted {expected}, resumed {got}")
    assert len(expected) == 2 and got[-1] == expected[-1]  # epoch 1's value, over all 12 batches


@pytest.mark.parametrize("world_size", [1, 2])
def test_the_start_line_names_metrics_with_list_states_that_ddp_checkpoints_leave_out(world_size):
    """Under DDP the epoch's metric states are gathered as tensors of one shape, so a metric with list states
    (``CatMetric``, ``AUROC``'s) is not kept: the start line says so (one process keeps every state)."""
    from types import SimpleNamespace

    from torchmetrics import CatMetric, MeanMetric

    from lightkeep.resume import ExactResume

    resume = ExactResume()
    resume._metrics = {"train_mean": MeanMetric(), "train_scores": CatMetric()}
    notes = resume.notes(SimpleNamespace(ckpt_path=None, world_size=world_size, strategy=None), None)
    named = [n for n in notes if "list states (train_scores)" in n and "not kept in checkpoints under DDP" in n]
    assert len(named) == (world_size > 1), notes


LOGGED = ("train/loss_epoch", "train/max_logit", "train/samples", "train/late", "train/acc")


def _config(tmp_path, model: str) -> list[str]:
    """``fit`` arguments: ``tests.fixtures.metric_module.MODEL`` on its data, 2 epochs of 12 batches of 8, a
    last.ckpt every 4 steps."""
    path = tmp_path / "metric.yaml"
    path.write_text(
        "trainer:\n  callbacks:\n    - class_path: lightning.pytorch.callbacks.ModelCheckpoint\n      init_args:\n"
        "        save_top_k: 0\n        save_last: true\n        enable_version_counter: false\n"
        "        every_n_train_steps: 4\n"
        f"model:\n  class_path: tests.fixtures.metric_module.{model}\n"
        "data:\n  class_path: tests.fixtures.metric_module.MetricData\n"
    )
    # batch_size too: the base config's data.init_args.batch_size (64) carries over to any data class that has one
    return ["--config", str(path), *QUIET, "--data.batch_size", "8", "--run.monitor", "null", "--trainer.max_epochs",
            "2"]  # fmt: skip


def _killed_at_step_18_and_resumed(args: list[str], tmp_path):
    """The uninterrupted run, and a run crashed at step 18 and resumed from its last.ckpt of step 16: their run
    folders and that checkpoint."""
    cli_in_process("fit", *args, root=tmp_path / "reference")
    with pytest.raises(RuntimeError, match="injected crash"):
        cli_in_process("fit", *args, "--trainer.callbacks+=tests.faults.CrashAt", "--trainer.callbacks.step=18",
                       root=tmp_path / "resumed")  # fmt: skip
    (run,) = (tmp_path / "resumed" / "metric").glob("version_*")
    saved = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)
    assert saved["global_step"] == 16
    cli_in_process("fit", *args, "--ckpt_path", "last", root=tmp_path / "resumed")
    (reference,) = (tmp_path / "reference" / "metric").glob("version_*")
    return reference, run, saved


def test_values_logged_on_epoch_are_the_uninterrupted_runs_after_a_mid_epoch_resume(tmp_path):
    """``self.log(name, tensor, on_epoch=True)``, the plain habit: Lightning sums the epoch's values in the loop and
    saves none of it, so epoch 1's ``train/loss_epoch`` after a resume at its 4th batch was the mean of the 8 batches
    after it (measured: 0.8664 where the uninterrupted run logged 0.8724). Now each value, mean, max and sum, is the
    uninterrupted run's, bit for bit."""
    reference, run, _ = _killed_at_step_18_and_resumed(_config(tmp_path, "LoggedModel"), tmp_path)
    expected, got = scalars(reference), scalars(run)
    for tag in LOGGED:
        assert len(expected[tag]) == 2 and got[tag][-1] == expected[tag][-1], (tag, expected[tag], got[tag])
    assert got["train/samples"][-1][1] == 96.0  # every sample of epoch 1, the 32 before the resume too


@pytest.mark.long
def test_values_logged_on_epoch_with_sync_dist_on_2_ranks_are_the_uninterrupted_runs_after_a_kill(tmp_path):
    """The same on 2 DDP ranks, killed after the save at step 8 (epoch 1, 2 of its 6 batches on each rank): each
    rank's running sums are in the checkpoint and each rank gets its own back (rank 1 none of ``train/late``, which
    it had not logged yet that epoch), so the synced epoch means, the max and the sum are the uninterrupted run's."""
    args = _config(tmp_path, "LoggedModel")
    for name in ("reference", "resumed"):
        (tmp_path / name).mkdir()
    cli("fit", *DDP2, *args, cwd=tmp_path / "reference")
    cli("fit", *DDP2, *args, *kill_at(11, settle=True), cwd=tmp_path / "resumed", check=False)
    (run,) = (tmp_path / "resumed" / "runs" / "metric").glob("version_*")
    assert torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 8
    cli("fit", *DDP2, *args, "--ckpt_path", "last", cwd=tmp_path / "resumed")
    (reference,) = (tmp_path / "reference" / "runs" / "metric").glob("version_*")
    expected, got = scalars(reference), scalars(run)
    for tag in LOGGED:
        assert len(expected[tag]) == 2 and got[tag][-1] == expected[tag][-1], (tag, expected[tag], got[tag])
