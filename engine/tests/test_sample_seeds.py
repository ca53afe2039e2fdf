"""Augmentation drawn in loader workers from the global generators (tests/fixtures/augment.py) resumes exactly:
each training sample's draws are a function of (seed, epoch, index), whatever worker or how many fetch it."""

import pytest
import torch
from torch.utils.data import DataLoader

from lightkeep.loaders import ResumableSampler
from lightkeep.sample_seeds import can_seed, sample_seed, worker_init
from tests.faults import kill_at
from tests.fixtures.augment import Augmented, AugmentedBlobs
from tests.helpers import DDP2, QUIET, cli, cli_in_process, run_dirs


def batches(workers: int, epoch: int, skip: int = 0, persistent: bool = False, seeded: bool = True) -> list:
    data = AugmentedBlobs()
    data.setup("fit")
    dataset = Augmented(data.splits["train"])
    sampler = ResumableSampler(dataset, 1, 0, shuffle=True, seed=7, pad=True, epoch_in_keys=seeded)
    sampler.set_epoch(epoch)
    sampler.skip = skip
    init = worker_init(7, None) if seeded else None
    loader = DataLoader(dataset, batch_size=16, sampler=sampler, num_workers=workers, worker_init_fn=init,
                        persistent_workers=persistent)  # fmt: skip
    out = []
    for i, (x, _) in enumerate(loader):
        out.append(x)
        if i == 5:
            break
    return out


@pytest.mark.slow  # loader worker processes
def test_each_samples_draws_depend_on_seed_epoch_and_index_only():
    one, two = batches(1, epoch=3), batches(2, epoch=3)
    assert all(torch.equal(a, b) for a, b in zip(one, two, strict=True))  # 1 or 2 workers: the same samples
    resumed = batches(2, epoch=3, skip=2 * 16)  # a resume two batches in: fresh workers, the same draws
    assert all(torch.equal(a, b) for a, b in zip(one[2:], resumed, strict=False))
    assert not torch.equal(batches(2, epoch=4)[0], one[0])  # another epoch: other draws
    # the oracle that it matters: without the seeding, 1 and 2 workers augment differently
    plain_one, plain_two = batches(1, epoch=3, seeded=False), batches(2, epoch=3, seeded=False)
    assert not all(torch.equal(a, b) for a, b in zip(plain_one, plain_two, strict=True))


def test_seeds_differ_for_neighbouring_samples_and_epochs_and_datasets_that_cannot_change_class_are_left():
    seeds = {sample_seed(0, e, i) for e in range(20) for i in range(500)}
    assert len(seeds) == 20 * 500
    assert not can_seed([1, 2, 3]) and can_seed(Augmented(list(range(3))))


AUG = [*QUIET, "--data", "tests.fixtures.augment.AugmentedBlobs", "--data.num_workers", "2",
       "--data.persistent_workers", "true", "--trainer.max_epochs", "3", "--trainer.limit_train_batches", "6",
       "--trainer.limit_val_batches", "2", "--model.warmup", "1",
       "--trainer.callbacks+=ModelCheckpoint", "--trainer.callbacks.every_n_train_steps=4",
       "--trainer.callbacks.save_top_k=0", "--trainer.callbacks.save_last=true",
       "--trainer.callbacks.enable_version_counter=false"]  # fmt: skip


def final_weights(cwd):
    (run,) = run_dirs(cwd, "augmented_blobs")
    state = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)
    return state["global_step"], {k: v for k, v in state["state_dict"].items() if k.startswith("net.")}


@pytest.mark.slow
# newest checkpoint: step 8 (mid-epoch 2), step 12 (epoch 2's end: CI and make test-all)
@pytest.mark.parametrize("step", [10, pytest.param(13, marks=pytest.mark.long)])
def test_a_kill_and_resume_with_persistent_augmenting_workers_is_exact(tmp_path, capsys, step):
    reference, resumed = tmp_path / "reference", tmp_path / "resumed"
    reference.mkdir(), resumed.mkdir()
    # the uninterrupted reference and the resume: the real CLI in this process; the SIGKILLed run: a process, naming
    # the resume's absolute root (a ModelCheckpoint restores its state only in its checkpoint's dirpath)
    cli_in_process("fit", *AUG, root=reference / "runs")
    out = capsys.readouterr().out
    assert "exact resume: yes" in out, out[-2000:]
    killed = cli("fit", *AUG, *kill_at(step, settle=True), "--run.root", str(resumed / "runs"), cwd=resumed,
                 check=False)  # fmt: skip
    assert killed.returncode == -9, killed.stderr[-2000:]
    saved = torch.load(run_dirs(resumed, "augmented_blobs")[0] / "checkpoints" / "last.ckpt", weights_only=True)
    assert saved["global_step"] == (8 if step == 10 else 12)  # the precondition: where the resume starts
    cli_in_process("fit", *AUG, "--ckpt_path", "last", root=resumed / "runs")
    out = capsys.readouterr().out
    start = next(line for line in out.splitlines() if line.startswith("Run "))
    assert "exact resume: resume verified (epoch" in start, start  # each worker-augmented sample as recorded
    (ref_step, want), (got_step, got) = final_weights(reference), final_weights(resumed)
    diffs = {k: (got[k] - v).abs().max().item() for k, v in want.items()}
    assert ref_step == got_step == 18 and all(torch.equal(got[k], v) for k, v in want.items()), diffs


@pytest.mark.slow
@pytest.mark.long  # CI and make test-all; the first difference is named in the fast tier (tests/test_next_batch.py)
def test_a_resume_with_unseeded_augmenting_workers_names_the_first_sample_augmented_otherwise(tmp_path):
    unseeded = [*AUG, "--run.seed_per_sample", "false"]
    reference, resumed = tmp_path / "reference", tmp_path / "resumed"
    reference.mkdir(), resumed.mkdir()
    cli("fit", *unseeded, cwd=reference)
    killed = cli("fit", *unseeded, *kill_at(10, settle=True), cwd=resumed, check=False)
    assert killed.returncode == -9, killed.stderr[-2000:]
    out = cli("fit", *unseeded, "--ckpt_path", "last", cwd=resumed).stdout
    start = next(line for line in out.splitlines() if line.startswith("Run "))
    order = torch.randperm(1259, generator=torch.Generator().manual_seed(42 + 1))  # epoch 1's, from seed + epoch
    expected = (
        f"exact resume: no, augmentation: sample {order[128]} (epoch 1, place 128 in its order) holds other values "
        "than in the checkpoint's run: loader workers draw it from streams of their own"
    )
    assert expected in start, start
    (_, want), (_, got) = final_weights(reference), final_weights(resumed)
    assert not all(torch.equal(got[k], v) for k, v in want.items())  # so it is: the resume drifted


# Two DDP ranks, each with 2 persistent augmenting workers: 1259 samples, 2 x 16 a step, 39 steps an epoch
ON_RANKS = [*QUIET, "--data", "tests.fixtures.augment.AugmentedBlobs", "--data.num_workers", "2",
            "--data.persistent_workers", "true", "--trainer.max_steps", "16", "--trainer.limit_val_batches", "2",
            "--model.warmup", "1", "--model.net.dropout", "0",  # the ranks' own streams: no dropout to follow
            "--trainer.callbacks+=ModelCheckpoint", "--trainer.callbacks.every_n_train_steps=4",
            "--trainer.callbacks.save_top_k=0", "--trainer.callbacks.save_last=true",
            "--trainer.callbacks.enable_version_counter=false"]  # fmt: skip
ONE_RANK = ["--trainer.accelerator", "cpu", "--trainer.devices", "1", "--trainer.strategy", "auto"]


@pytest.fixture(scope="module")
def on_two_ranks(tmp_path_factory):
    """The uninterrupted 2-rank run's final weights."""
    cwd = tmp_path_factory.mktemp("two_ranks")
    cli("fit", *ON_RANKS, *DDP2, cwd=cwd)
    return final_weights(cwd)


@pytest.mark.slow
@pytest.mark.long  # CI and make test-all
@pytest.mark.parametrize(
    ("then", "kill", "saved", "where"),
    [
        ("two_ranks", 9, 8, "epoch 0, batch 8"),  # last.ckpt, mid-epoch
        # the best-k file of epoch 0's end (10 steps an epoch on 2 ranks), under max_steps: Lightning alone would
        # train epoch 1 in epoch 2's order (compat_loops.start_the_epoch_after_an_ended_one)
        ("one_rank", 11, 10, "epoch 1, batch 0"),
    ],
)
def test_augmenting_workers_on_two_ranks_resume_exactly_and_on_one_rank_with_the_same_samples(
    tmp_path, then, kill, saved, where, on_two_ranks
):
    """Killed, resumed on 2 ranks: bit for bit; on 1 rank (the engine accumulates 2 micro-batches for the same
    global batch): the same augmented samples, so the weights differ from the uninterrupted 2-rank run's only by the
    order of float sums (unseeded workers: 5.7e-4, issue 36). The model has no dropout: a rank's own random streams
    cannot follow a change of ranks (the start line says so), the per-sample seeds of augmentation do."""
    killed = cli("fit", *ON_RANKS, *DDP2, *kill_at(kill, settle=True), cwd=tmp_path, check=False)
    assert killed.returncode != 0, killed.stderr[-2000:]
    out = cli("fit", *ON_RANKS, *(DDP2 if then == "two_ranks" else ONE_RANK), "--ckpt_path", "last", cwd=tmp_path)
    start = next(line for line in out.stdout.splitlines() if line.startswith("Run "))
    assert f"(continues from step {saved} of " in start, start  # the precondition: where the resume starts
    assert f"exact resume: resume verified ({where}" in start, start  # each augmented sample as recorded
    (ref_step, want), (got_step, got) = on_two_ranks, final_weights(tmp_path)
    delta = max((got[k] - v).abs().max().item() for k, v in want.items())
    print(f"2 ranks -> {then}: max |delta| {delta:.3g} | {start}")
    assert ref_step == got_step == 16
    assert delta == 0.0 if then == "two_ranks" else delta <= 1e-5
