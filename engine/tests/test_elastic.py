"""Elastic determinism: a checkpoint of N ranks continues on M ranks with the same samples in the same global batches,
the same optimizer steps and LR, and ends within float-reduction noise of the uninterrupted run.

The oracle is an uninterrupted run of the same global batch on one process (2 micro-batches accumulated), run in
this process: the killed runs start on 2 ranks or on 1, so both shapes are held to it. Every micro-batch's sample
indices, noise and LR are recorded per rank by ``tests.fixtures.elastic`` (no dropout: the random streams of ranks are
what cannot follow)."""

import json
import math
import shutil
from collections import Counter
from pathlib import Path

import pytest
import torch

from lightkeep.elastic import Shape, _keep, epoch_note
from lightkeep.loaders import ResumableSampler
from lightkeep.sharded.folders import full_state_dict, read_meta
from tests.faults import kill_at
from tests.helpers import DDP2, QUIET, REPO, cli, cli_in_process, run_dirs

# 90 samples padded to 96: 12 optimizer steps of 8 samples an epoch (4 per device x 2 ranks, or x 2 accumulated)
ARGS = [*QUIET, "--model", "tests.fixtures.elastic.RecordedRegression", "--data", "tests.fixtures.elastic.ElasticData",
        "--run.monitor", "null", "--trainer.max_steps", "30", "--trainer.limit_val_batches", "0",
        "--trainer.callbacks+=ModelCheckpoint", "--trainer.callbacks.every_n_train_steps=1",
        "--trainer.callbacks.save_top_k=0", "--trainer.callbacks.save_last=true",
        "--trainer.callbacks.enable_version_counter=false"]  # fmt: skip
ONE = ["--trainer.accelerator", "cpu", "--trainer.devices", "1", "--trainer.strategy", "auto"]
ONE_ACCUMULATING = [*ONE, "--trainer.accumulate_grad_batches", "2"]  # DDP2's global batch of 8 on one process
SHARDED = ["--config", str(REPO / "configs" / "fsdp.yaml"), "--trainer.accelerator", "cpu"]  # FSDP2 over gloo
STEPS_PER_EPOCH = 12


def record(folder: Path) -> dict[int, dict]:
    """Per optimizer step: the multiset of sample indices over all ranks and micro-batches, the LRs, and the noise
    each (epoch, index) drew."""
    steps: dict[int, dict] = {}
    for path in sorted(folder.glob("rank*.jsonl")):
        for line in path.read_text().splitlines():
            r = json.loads(line)
            step = steps.setdefault(r["step"], {"index": Counter(), "lr": set(), "noise": {}})
            step["index"].update(r["index"])
            step["lr"].add(r["lr"])
            step["noise"].update({(r["epoch"], i): v for i, v in zip(r["index"], r["noise"], strict=True)})
    return steps


def last(cwd: Path) -> dict:
    """The run's last.ckpt as ``global_step``, ``loops`` and ``tensors``: its weights and every tensor of its optimizer
    state by name (a sharded folder consolidated on this process from every rank's shard)."""
    (run,) = run_dirs(cwd, "elastic")
    path = run / "checkpoints" / "last.ckpt"
    if path.is_dir():
        saved = read_meta(path)
        weights, optimizer = full_state_dict(path, "state_dict."), full_state_dict(path, "optimizer_0.")
        tensors = {
            **{f"weights.{k}": v for k, v in weights.items()},
            **{f"optimizer0.{k}": v for k, v in optimizer.items()},
        }
        return {"global_step": saved["global_step"], "loops": saved["loops"], "tensors": tensors}
    saved = torch.load(path, weights_only=True)
    tensors = {f"weights.{k}": v for k, v in saved["state_dict"].items()}
    for i, optimizer in enumerate(saved["optimizer_states"]):
        for p, state in optimizer["state"].items():
            tensors |= {f"optimizer{i}.{p}.{k}": v for k, v in state.items() if isinstance(v, torch.Tensor)}
    return {"global_step": saved["global_step"], "loops": saved["loops"], "tensors": tensors}


def max_difference(a: dict, b: dict) -> float:
    """max |Δ| over the weights and every tensor of the optimizer state."""
    assert a["tensors"].keys() == b["tensors"].keys() and a["tensors"]
    return max((v.double() - b["tensors"][k].double()).abs().max().item() for k, v in a["tensors"].items())


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> tuple[dict[int, dict], dict]:
    cwd = tmp_path_factory.mktemp("uninterrupted")
    cli_in_process("fit", *ARGS, *ONE_ACCUMULATING, "--model.record", str(cwd / "rec"), root=cwd / "runs")
    return record(cwd / "rec"), last(cwd)


def killed(cwd: Path, first: list[str], kill: int, per_epoch: int = STEPS_PER_EPOCH) -> dict:
    """Runs ``first`` until it is killed before step ``kill`` (of epochs of ``per_epoch`` steps); returns the steps it
    recorded."""
    recording = ["--model.record", str(cwd / "a")]
    proc = cli("fit", *ARGS, *first, *kill_at(kill, settle=True), *recording, cwd=cwd, check=False)
    assert proc.returncode != 0, proc.stderr[-2000:]
    saved = last(cwd)
    assert saved["global_step"] == kill, "precondition: the checkpoint of the step before the kill"
    at_end = saved["loops"]["fit_loop"]["epoch_loop.batch_progress"]["is_last_batch"]
    assert at_end == (kill % per_epoch == 0), "precondition: mid-epoch, or at an epoch's last batch end"
    before = record(cwd / "a")
    assert sorted(before) == list(range(kill)), sorted(before)
    return before


def resumed(cwd: Path, then: list[str]) -> tuple[dict, dict, str]:
    """Resumes the run in ``cwd`` with ``then``; returns the steps it recorded, its final checkpoint and its output."""
    kill = last(cwd)["global_step"]
    proc = cli("fit", *ARGS, *then, "--ckpt_path", "last", "--model.record", str(cwd / "b"), cwd=cwd)
    after = record(cwd / "b")
    assert min(after) == kill, sorted(after)
    return after, last(cwd), proc.stdout


def resumed_on_other_ranks(cwd: Path, first: list[str], then: list[str], kill: int) -> tuple[dict, dict, str, Path]:
    """Runs ``first`` until it is killed before step ``kill``, resumes it with ``then``; returns the steps recorded
    (the first run's before ``kill``, the resumed run's from it), the final checkpoint and the resumed run's output."""
    before = killed(cwd, first, kill)
    after, final, out = resumed(cwd, then)
    return {**before, **after}, final, out, cwd


def start_line(out: str) -> str:
    return next(x for x in out.splitlines() if x.startswith("Run "))


def assert_same_run(steps: dict, final: dict, reference: tuple[dict, dict], total: int = 30) -> None:
    ref_steps, ref_final = reference
    assert sorted(steps) == sorted(ref_steps) == list(range(total))
    for step in ref_steps:
        assert steps[step]["index"] == ref_steps[step]["index"], f"step {step}: other samples"
        assert steps[step]["lr"] == ref_steps[step]["lr"] and len(steps[step]["lr"]) == 1, f"step {step}: LR"
    assert final["global_step"] == ref_final["global_step"] == total
    difference = max_difference(final, ref_final)
    print(f"max |Δ| over weights and optimizer state after {total} steps: {difference:.3g}")
    assert difference <= 1e-5


@pytest.fixture(scope="module")
def uninterrupted_sharded(tmp_path_factory) -> tuple[dict[int, dict], dict]:
    cwd = tmp_path_factory.mktemp("uninterrupted_sharded")
    cli("fit", *ARGS, *SHARDED, "--trainer.devices", "2", "--model.record", str(cwd / "rec"), cwd=cwd)
    return record(cwd / "rec"), last(cwd)


@pytest.fixture(scope="module")
def shrunk(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("shrunk")
    return resumed_on_other_ranks(cwd, DDP2, ONE, kill=17)  # epoch 1, step 5 of 12


@pytest.fixture(scope="module")
def grown(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("grown")
    return resumed_on_other_ranks(cwd, ONE_ACCUMULATING, DDP2, kill=7)


@pytest.mark.slow
def test_a_two_rank_run_killed_mid_epoch_continues_on_one_rank_with_the_same_global_batches(shrunk, uninterrupted):
    steps, final, out, _ = shrunk
    assert_same_run(steps, final, uninterrupted)
    line = next(x for x in out.splitlines() if x.startswith("Run "))
    assert "elastic: 2 -> 1 rank(s): accumulate_grad_batches 1 -> 2 keeps the global batch of 8 samples" in line
    assert "random streams of 2 rank(s)" in line, line
    # step 17: epoch 1's place 40 (5 steps of 8), the 1 rank's micro-batch 10 of 4 samples: the first 4 of the 8 the
    # 2 ranks' batch held, interleaved in the epoch's order
    verified = "exact resume: resume verified (epoch 1, batch 10: its 4 samples, the first of the checkpoint's 8 on 1"
    assert verified in line, line


@pytest.mark.slow
@pytest.mark.long
def test_a_two_rank_run_killed_at_an_epoch_end_continues_on_one_rank_with_the_same_global_batches(
    uninterrupted, tmp_path
):
    steps, final, _, _ = resumed_on_other_ranks(tmp_path, DDP2, ONE, kill=STEPS_PER_EPOCH)
    assert_same_run(steps, final, uninterrupted)


@pytest.mark.slow
@pytest.mark.long  # CI and make test-all; make test changes the ranks 2 -> 1 above (and both ways in process)
def test_a_one_rank_run_killed_mid_epoch_continues_on_two_ranks_with_the_same_global_batches(grown, uninterrupted):
    steps, final, out, _ = grown
    assert_same_run(steps, final, uninterrupted)
    line = next(x for x in out.splitlines() if x.startswith("Run "))
    assert "elastic: 1 -> 2 rank(s): the same global batch of 8 samples" in line, line
    verified = "exact resume: resume verified (epoch 0, batch 7: the first 4 of its 8 samples, all the checkpoint's"
    assert verified in line, line


@pytest.mark.slow
@pytest.mark.long  # make test: DDP 2 -> 1 above, and a sharded kill and resume in tests/test_sharded.py
def test_a_sharded_two_rank_run_killed_mid_epoch_continues_on_one_rank_with_the_same_global_batches(
    uninterrupted_sharded, tmp_path
):
    # the shards of the 2 ranks' DCP folder are resharded onto 1 rank, which accumulates 2 micro-batches a step
    two, one = [*SHARDED, "--trainer.devices", "2"], [*SHARDED, "--trainer.devices", "1"]
    steps, final, out, _ = resumed_on_other_ranks(tmp_path, two, one, kill=17)
    assert_same_run(steps, final, uninterrupted_sharded)
    line = next(x for x in out.splitlines() if x.startswith("Run "))
    assert "elastic: 2 -> 1 rank(s): accumulate_grad_batches 1 -> 2 keeps the global batch of 8 samples" in line


@pytest.mark.slow
@pytest.mark.long  # ~30 s; the epoch note it ends in is checked in this process below
def test_a_limit_on_micro_batches_ends_epochs_elsewhere_on_other_ranks_and_the_start_line_names_the_one_that_keeps_them(
    tmp_path,
):
    # limit_train_batches counts each rank's micro-batches: 8 of 4 samples on 2 ranks is 64 samples (8 steps) an epoch;
    # on 1 rank accumulating 2 the same flag is 32 samples (4 steps), and 16 keeps 64
    epochs = ["--trainer.max_epochs", "3"]  # 3 x 8 = 24 steps, before ARGS' max_steps of 30
    cli("fit", *ARGS, *DDP2, *epochs, "--trainer.limit_train_batches", "8", "--model.record", str(tmp_path / "rec"),
        cwd=tmp_path)  # fmt: skip
    reference = record(tmp_path / "rec"), last(tmp_path)
    assert reference[1]["global_step"] == 24, "precondition: the limit, not max_steps, shapes the reference"
    kill = 10  # epoch 1, 2 steps in
    original = tmp_path / "original"
    original.mkdir()
    before = killed(original, [*DDP2, *epochs, "--trainer.limit_train_batches", "8"], kill, per_epoch=8)
    same_flag = tmp_path / "same_flag"
    shutil.copytree(original, same_flag)

    _, final, out = resumed(same_flag, [*ONE, *epochs, "--trainer.limit_train_batches", "8"])
    line = start_line(out)
    assert (
        "limit_train_batches 8 counts each rank's micro-batches: an epoch now runs 32 samples (4 steps), the "
        "checkpoint's run 64 (8), so the global batches from this epoch's end on differ from the original run's "
        "(--trainer.limit_train_batches 16 keeps them)"
    ) in line, line
    assert final["global_step"] == 16, "the flag as given: epoch 1 ends 2 steps on (at 12), epoch 2 is 4 steps"

    after, final, out = resumed(original, [*ONE, *epochs, "--trainer.limit_train_batches", "16"])
    assert "limit_train_batches" not in start_line(out)
    assert_same_run({**before, **after}, final, reference, total=24)


def test_the_epoch_note_says_when_an_epoch_runs_other_samples_than_the_checkpoints_and_which_limit_keeps_them():
    one = Shape(1, 4, 2)  # micro-batches of 4 samples, global batch 8
    assert epoch_note(1.0, 96, 96, one) is None
    assert epoch_note(8, 32, 64, one) == (
        "limit_train_batches 8 counts each rank's micro-batches: an epoch now runs 32 samples (4 steps), the "
        "checkpoint's run 64 (8), so the global batches from this epoch's end on differ from the original run's "
        "(--trainer.limit_train_batches 16 keeps them)"
    )
    assert "runs the whole loader, the checkpoint's run 64 (8)" in epoch_note(1.0, math.inf, 64, one)
    wide = Shape(1, 16, 1)
    assert "no limit on micro-batches of 16 samples over all ranks keeps them" in epoch_note(0.3, 32, 24, wide)


@pytest.mark.slow
@pytest.mark.long  # with the test above (its fixture); make test's 2 -> 1 resume ends bit-near with this noise
def test_noise_seeded_per_sample_from_seed_epoch_and_index_follows_a_change_of_ranks(shrunk, grown, uninterrupted):
    reference = {k: v for step in uninterrupted[0].values() for k, v in step["noise"].items()}
    for steps, *_ in (shrunk, grown):
        drawn = {k: v for step in steps.values() for k, v in step["noise"].items()}
        assert drawn == reference


@pytest.mark.slow
def test_a_global_batch_no_integer_accumulation_keeps_stops_in_one_line(shrunk):
    cwd = shrunk[3]  # its last.ckpt: 1 rank x 4 per device x 2 accumulated
    proc = cli("fit", *ARGS, *ONE, "--data.batch_size", "3", "--ckpt_path", "last", cwd=cwd, check=False)
    assert proc.returncode != 0
    errors = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
    assert len(errors) == 1 and "8 samples (4 per device x 1 rank(s) x 2 accumulated)" in errors[0], proc.stderr


def test_the_accumulation_that_keeps_the_global_batch_or_the_settings_that_would():
    assert _keep(Shape(2, 4, 1), Shape(1, 4, 1)) == Shape(1, 4, 2)
    assert _keep(Shape(1, 4, 2), Shape(2, 4, 2)) == Shape(2, 4, 1)
    assert _keep(Shape(2, 4, 1), Shape(1, 8, 1)) == Shape(1, 8, 1)
    with pytest.raises(ValueError, match=r"product is 8: 8 x 1, 4 x 2, 2 x 4, 1 x 8"):
        _keep(Shape(2, 4, 1), Shape(1, 3, 1))
    with pytest.raises(ValueError, match=r"divides 8 \(1, 2, 4, 8\)"):
        _keep(Shape(2, 4, 1), Shape(3, 4, 1))


@pytest.mark.parametrize("n", [90, 96, 5])
def test_each_global_batch_holds_the_same_samples_on_any_number_of_ranks(n):
    def global_batches(world: int, batch: int, accumulate: int) -> list[Counter]:
        ranks = [ResumableSampler(range(n), world, r, True, 3, True, global_batch=8) for r in range(world)]
        orders = [list(s) for s in ranks]
        assert len({len(o) for o in orders}) == 1 and len(orders[0]) % (batch * accumulate) == 0
        per_step = batch * accumulate
        return [Counter(i for o in orders for i in o[k : k + per_step]) for k in range(0, len(orders[0]), per_step)]

    assert global_batches(1, 4, 2) == global_batches(2, 4, 1) == global_batches(4, 2, 1) == global_batches(8, 1, 1)
