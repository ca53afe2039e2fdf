"""A resumed run compares its first batch with the checkpoint's record of the batch its run would have trained next,
and its start line says what that showed: ``resume verified`` (tests/test_resume*.py, test_elastic.py,
test_sample_seeds.py, against uninterrupted runs), or the first difference, or why nothing could be compared.
The differences here are made on purpose; the oracles are the engine's documented order (a permutation drawn from
``seed + epoch``), computed here, and the final weights of an uninterrupted run."""

from types import SimpleNamespace

import pytest
import torch

from lightkeep.batch_fingerprint import hashes
from lightkeep.next_batch import _own_position_checked
from lightkeep.stream_positions import Made, Position
from tests.helpers import QUIET, cli_in_process

SEED = 42  # configs/default.yaml's seed_everything: the engine's samplers draw each epoch's order from seed + epoch
TRAIN = 1797 - 2 * int(1797 * 0.15)  # the stand-in's training samples
# 6 batches of 64 an epoch; last.ckpt every 4 steps: a crash at step 10 resumes from step 8, epoch 1's batch 2
ARGS = [*QUIET, "--trainer.max_epochs", "2", "--trainer.limit_train_batches", "6", "--trainer.limit_val_batches", "1",
        "--model.warmup", "1", "--trainer.callbacks+=ModelCheckpoint", "--trainer.callbacks.every_n_train_steps=4",
        "--trainer.callbacks.save_top_k=0", "--trainer.callbacks.save_last=true",
        "--trainer.callbacks.enable_version_counter=false"]  # fmt: skip
CRASH_AT = ["--trainer.callbacks+=tests.faults.CrashAt", "--trainer.callbacks.step"]


def crashed_then_resumed(root, args: list[str], step: int, resume_args: tuple[str, ...] = ()) -> None:
    with pytest.raises(RuntimeError, match="injected crash"):
        cli_in_process("fit", *args, *CRASH_AT, str(step), root=root)
    cli_in_process("fit", *args, *resume_args, "--ckpt_path", "last", root=root)


def resumed_start_line(out: str) -> str:
    return [line for line in out.splitlines() if line.startswith("Run /")][-1]


def net_weights(root, name: str) -> dict[str, torch.Tensor]:
    (last,) = root.glob(f"{name}/version_*/checkpoints/last.ckpt")
    return {k: v for k, v in torch.load(last, weights_only=True)["state_dict"].items() if k.startswith("net.")}


@pytest.mark.slow  # several real fits: make test runs it, make test-fast leaves it out
def test_a_dataset_drawing_from_os_urandom_is_named_at_the_first_sample_whose_values_differ(tmp_path, capsys):
    args = [*ARGS, "--data", "tests.fixtures.unseeded.UnseededBlobs"]
    cli_in_process("fit", *args, root=tmp_path / "reference")
    crashed_then_resumed(tmp_path / "resumed", args, step=10)
    line = resumed_start_line(capsys.readouterr().out)
    order = torch.randperm(TRAIN, generator=torch.Generator().manual_seed(SEED + 1))  # epoch 1's
    first = 2 * 64  # the resume continues after epoch 1's 2 batches of 64
    expected = (
        f"exact resume: no, data: sample {order[first]} (epoch 1, place {first} in its order) holds other values than "
        "in the checkpoint's run: the dataset draws from a source the engine does not seed (os.urandom, time, a "
        "generator of its own), or its data changed since the save | logs:"
    )
    assert expected in line, line
    # what it says is so: the resumed run does not end where the uninterrupted one does
    want, got = (
        net_weights(tmp_path / "reference", "unseeded_blobs"),
        net_weights(tmp_path / "resumed", "unseeded_blobs"),
    )
    assert not all(torch.equal(got[k], v) for k, v in want.items())


BYO = [*QUIET, "--model", "tests.fixtures.byo.MyModel", "--data", "tests.fixtures.byo.MyData", "--run.monitor", "null",
       "--data.n_train", "96", "--data.batch_size", "8", "--trainer.max_epochs", "1",
       "--trainer.callbacks+=ModelCheckpoint", "--trainer.callbacks.every_n_train_steps=4",
       "--trainer.callbacks.save_top_k=0", "--trainer.callbacks.save_last=true",
       "--trainer.callbacks.enable_version_counter=false"]  # fmt: skip


def test_a_loader_order_changed_between_save_and_resume_is_named_at_the_first_place_that_differs(tmp_path, capsys):
    # saved with shuffle=True after 4 batches of 8 (place 32 of epoch 0), resumed with a WeightedRandomSampler
    crashed_then_resumed(tmp_path, BYO, step=6, resume_args=("--data.train_sampler", "weighted"))
    line = resumed_start_line(capsys.readouterr().out)
    shuffled = torch.randperm(96, generator=torch.Generator().manual_seed(SEED))
    weights = torch.linspace(0.5, 2.0, 96, dtype=torch.double)  # the fixture's, as WeightedRandomSampler keeps them
    weighted = torch.multinomial(weights, 96, True, generator=torch.Generator().manual_seed(SEED))
    place = next(k for k in range(32, 96) if shuffled[k] != weighted[k])
    expected = (
        f"exact resume: no, data order: epoch 0, place {place} in its order is sample {weighted[place]}, the "
        f"checkpoint's run had sample {shuffled[place]} there (the loader's order changed since the save: its "
        "sampler, shuffle, batch size or data) | logs:"
    )
    assert expected in line, line


def test_a_loader_with_its_own_sampler_is_verified_by_its_indices_or_named_unverified_under_restart(tmp_path, capsys):
    crashed_then_resumed(tmp_path, [*BYO, "--data.train_sampler", "own"], step=5)
    line = resumed_start_line(capsys.readouterr().out)
    assert (
        "exact resume: resume verified (train loader 0 (EveryOtherSampler): its first batch's indices are those the "
        "checkpoint's run drew next, its order drawn again and fast-forwarded past the batches trained on) |" in line
    ), line
    (tmp_path / "restart").mkdir()
    crashed_then_resumed(tmp_path / "restart", [*BYO, "--data.train_sampler", "own", "--run.stream_resume", "restart"],
                         step=5)  # fmt: skip
    line = resumed_start_line(capsys.readouterr().out)
    assert (
        "exact resume: not verified: train loader 0: its EveryOtherSampler is the user's own, whose order the engine "
        "cannot replay; see opts out |" in line
    ), line


def test_a_samples_hash_is_its_own_whatever_batch_holds_it():
    a, b, c = (torch.randn(3, 4, generator=torch.Generator().manual_seed(s)) for s in range(3))
    rows, whole = hashes({"x": torch.stack([a, b, c]), "name": ["a", "b", "c"]}, 3)
    other_rows, other_whole = hashes({"x": torch.stack([c, a]), "name": ["c", "a"]}, 2)
    assert other_rows == [rows[2], rows[0]] and len(set(rows)) == 3 and other_whole != whole
    changed = a.clone()
    changed[1, 2] = torch.nextafter(changed[1, 2], torch.tensor(1.0))  # one bit of one value
    assert hashes({"x": torch.stack([changed, b, c]), "name": ["a", "b", "c"]}, 3)[0][1:] == rows[1:]
    assert hashes({"x": torch.stack([changed, b, c]), "name": ["a", "b", "c"]}, 3)[0][0] != rows[0]


# A stream's position as engine 1.4.0 saved it (its ``_fresh`` layout): no ``ahead``, the fingerprint of the batch
# fetched ahead, which 1.5.0 added
POSITION_1_4_0 = {"epoch": 0, "batches": [3], "samples": [12], "fingerprints": [7], "states": [{"at": 3}], "next": 0}


@pytest.mark.parametrize("ahead", ["absent (engine 1.4.0)", None])
def test_a_stream_resumed_without_a_fingerprint_of_the_batch_fetched_ahead_says_why_it_is_not_verified(ahead):
    """A stream with its own state resumed mid-epoch from a position that holds no fingerprint of the batch fetched
    ahead: one an engine before 1.5.0 recorded (no ``ahead`` at all) is named as such, not as a run that fetched no
    batch ahead, which a 1.5.0 position says with ``ahead`` ``None`` (a loader with a length, a save at an epoch's
    end)."""
    saved = dict(POSITION_1_4_0) if ahead is not None else {**POSITION_1_4_0, "ahead": None}
    position = Position("train loader 0 (Stream)", 0, True, True, lambda: 0)
    position.restore = saved
    restore = position.start_epoch()
    assert restore is saved and position.resumed is saved  # resumed mid-epoch at the saved position
    batches = position.hand_out(iter([Made("b", 0, 4, 101, {"at": 4})]), restore)
    assert next(batches) == "b" and position.first == 101 and position.problem is None
    kind, words = _own_position_checked(SimpleNamespace(world_size=1), SimpleNamespace(position=position))
    assert kind == "unverified" and words.startswith("not verified: train loader 0 (Stream): "), words
    if ahead is None:
        assert "the checkpoint's run had fetched no batch ahead of training (a loader with a length" in words, words
    else:
        assert words.endswith(
            "its position in the checkpoint was recorded by an engine before 1.5.0, which kept no fingerprint of the "
            "batch fetched ahead, so there is none to compare its first batch with"
        ), words
        assert "had fetched no batch ahead" not in words, words


def test_a_shorter_cycled_train_loader_that_ran_out_at_the_save_is_verified_at_its_epochs_first_batch(tmp_path, capsys):
    """Two train loaders (a dict: Lightning's ``max_size_cycle``), the shorter of 3 batches out at the save of step 3
    while the epoch goes on: Lightning iterates it again in the same epoch's order, so its next batch is its epoch's
    first, not the next epoch's (which a resume once called ``no, data order``); the resume is exact."""
    args = [*QUIET, "--model", "tests.fixtures.kinds.TwoTrainRegress", "--data", "tests.fixtures.kinds.TwoTrainData",
            "--trainer.max_epochs", "2", "--run.monitor", "null", "--trainer.callbacks+=ModelCheckpoint",
            "--trainer.callbacks.every_n_train_steps=3", "--trainer.callbacks.save_top_k=0",
            "--trainer.callbacks.save_last=true", "--trainer.callbacks.enable_version_counter=false"]  # fmt: skip
    cli_in_process("fit", *args, root=tmp_path / "reference")
    crashed_then_resumed(tmp_path / "resumed", args, step=4)
    line = resumed_start_line(capsys.readouterr().out)
    assert "(continues from step 3 of" in line, line  # precondition: loader b had yielded its 3 batches
    assert (
        "exact resume: resume verified (epoch 0, batch 3: 8 samples on 1 rank(s), those the checkpoint's run would "
        "have trained next); resume verified (epoch 0, batch 0: 8 samples on 1 rank(s), those the checkpoint's run "
        "would have trained next) | logs:" in line
    ), line
    (want,) = (tmp_path / "reference").glob("two_train/version_*/checkpoints/last.ckpt")
    (got,) = (tmp_path / "resumed").glob("two_train/version_*/checkpoints/last.ckpt")
    want, got = torch.load(want, weights_only=True), torch.load(got, weights_only=True)
    assert got["global_step"] == want["global_step"] == 12
    assert all(torch.equal(got["state_dict"][k], v) for k, v in want["state_dict"].items())
