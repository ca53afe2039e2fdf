"""The samplers and loaders that make DDP evaluation exact and resumes land on the same batch (lightkeep.loaders).
The example's DataModule: tests/test_data.py."""

import pytest
import torch
from torch.utils.data import TensorDataset

from lightkeep.loaders import ResumableDataLoader, ResumableSampler, check_eval_share


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("n", [13, 17, 24])
def test_eval_sampler_gives_every_index_to_exactly_one_rank(world, n):
    data = TensorDataset(torch.arange(n))
    seen = [i for r in range(world) for i in ResumableSampler(data, world, r, shuffle=False, seed=0, pad=False)]
    assert sorted(seen) == list(range(n))
    assert sum(len(ResumableSampler(data, world, r, False, 0, False)) for r in range(world)) == n


@pytest.mark.parametrize("world", [1, 2, 3])
def test_train_sampler_pads_to_equal_lengths_and_shuffles_per_epoch(world):
    data = TensorDataset(torch.arange(17))
    samplers = [ResumableSampler(data, world, r, shuffle=True, seed=5, pad=True) for r in range(world)]
    lists = [list(s) for s in samplers]
    assert len({len(x) for x in lists}) == 1 and set().union(*map(set, lists)) == set(range(17))
    for s in samplers:
        s.set_epoch(1)
    assert [list(s) for s in samplers] != lists
    for s in samplers:
        s.set_epoch(0)
    assert [list(s) for s in samplers] == lists  # a pure function of (seed, epoch)


def test_loader_state_resumes_on_the_next_batch():
    data = TensorDataset(torch.arange(50), torch.arange(50))

    def loader():
        return ResumableDataLoader(data, sampler=ResumableSampler(data, 1, 0, True, 1, True), batch_size=8)

    full = loader()
    full.sampler.set_epoch(2)
    expected = [x.tolist() for x, _ in full]
    interrupted = loader()
    interrupted.sampler.set_epoch(2)
    it = iter(interrupted)
    head = [next(it)[0].tolist() for _ in range(3)]
    state = interrupted.state_dict()
    # the seed too: a resumed run may have another; the samples all ranks consumed: a resume on other ranks
    assert state == {"epoch": 2, "batches": 3, "seed": 1, "samples": 24}
    resumed = loader()
    resumed.load_state_dict(state)
    assert head + [x.tolist() for x, _ in resumed] == expected
    # saved at an epoch's end (ran out, or cut short by limit_train_batches: 3 of 7 batches): Lightning sets the next
    # epoch before iterating, and that epoch starts from its first batch
    nxt = loader()
    nxt.sampler.set_epoch(3)
    first_of_epoch_3 = [x.tolist() for x, _ in nxt]
    for batches in (len(nxt), 3):
        done = loader()
        done.load_state_dict({"epoch": 2, "batches": batches})
        done.sampler.set_epoch(3)
        assert [x.tolist() for x, _ in done] == first_of_epoch_3


def test_a_loader_with_another_sampler_resumes_by_dropping_the_consumed_batches():
    """overfit_batches: Lightning rebuilds the train loader with a SequentialSampler; it still iterates and resumes."""
    from torch.utils.data import SequentialSampler

    data = TensorDataset(torch.arange(20), torch.arange(20))
    loader = ResumableDataLoader(data, sampler=SequentialSampler(data), batch_size=4)
    expected = [x.tolist() for x, _ in loader]
    assert expected == [list(range(i, i + 4)) for i in range(0, 20, 4)]
    resumed = ResumableDataLoader(data, sampler=SequentialSampler(data), batch_size=4)
    resumed.load_state_dict({"epoch": 0, "batches": 2})
    assert [x.tolist() for x, _ in resumed] == expected[2:]


def test_an_eval_set_smaller_than_the_ranks_is_refused_alike_on_every_rank():
    # Lightning would stop the rank without a batch alone (a traceback) and the others would fail in a collective.
    with pytest.raises(ValueError, match=r"has 2 sample\(s\), fewer than the 3 ranks.*on 2 device"):
        check_eval_share(2, 3)
    check_eval_share(3, 3)  # as many samples as ranks: one each
    data = TensorDataset(torch.zeros(3, 1))
    assert [len(ResumableSampler(data, 3, rank, False, 0, False)) for rank in range(3)] == [1, 1, 1]


@pytest.mark.parametrize("world", [1, 2])
def test_a_train_loaders_drop_last_cuts_the_short_last_global_batch_instead_of_padding_it(world):
    """84 samples, 8 per optimizer step over all ranks: 80 trained, each once, the first 80 of the epoch's order (the
    padded order trains 88, four of them twice)."""
    data = TensorDataset(torch.arange(84))
    cut = [list(ResumableSampler(data, world, r, True, 5, True, cut=True, global_batch=8)) for r in range(world)]
    padded = [list(ResumableSampler(data, world, r, True, 5, True, global_batch=8)) for r in range(world)]
    assert [len(x) for x in cut] == [80 // world] * world and [len(x) for x in padded] == [88 // world] * world
    trained = [i for x in cut for i in x]
    assert len(set(trained)) == 80 and all(x == p[: len(x)] for x, p in zip(cut, padded, strict=True))


@pytest.mark.slow  # real fits
def test_a_train_loader_that_drops_its_last_batch_trains_the_epochs_lightning_does_and_resumes_bit_equal(tmp_path):
    """1,258 samples in batches of 64 with ``drop_last=True``: 19 steps an epoch, as plain Lightning's loader has
    (the engine padded to 20, training 22 samples twice). Killed mid-epoch 1, the resume is bit-equal."""
    from torch.utils.data import DataLoader

    from tests.fixtures.loader_habits import DropsLast
    from tests.helpers import QUIET, cli_in_process, max_abs_diff

    data = DropsLast()
    data.setup("fit")
    per_epoch = len(DataLoader(data.splits["train"], batch_size=64, drop_last=True))  # plain torch: the oracle
    flags = [*QUIET, "--data", "tests.fixtures.loader_habits.DropsLast", "--trainer.max_epochs", "2",
             "--trainer.limit_val_batches", "1"]  # fmt: skip
    reference = cli_in_process("fit", *flags, root=tmp_path / "reference")
    assert per_epoch == 19 and reference.trainer.global_step == 2 * per_epoch
    with pytest.raises(RuntimeError, match="injected crash"):
        cli_in_process("fit", *flags, "--trainer.callbacks+=tests.faults.CrashAt", "--trainer.callbacks.step=25",
                       root=tmp_path / "resumed")  # fmt: skip
    cli_in_process("fit", *flags, "--ckpt_path", "last", root=tmp_path / "resumed")
    ref, got = (torch.load(tmp_path / name / "drops_last" / "version_0" / "checkpoints" / "last.ckpt",
                           weights_only=True) for name in ("reference", "resumed"))  # fmt: skip
    assert got["global_step"] == ref["global_step"] == 38
    assert max_abs_diff(got["state_dict"], ref["state_dict"]) == 0.0


@pytest.mark.slow  # real fits
def test_a_train_loaders_own_generator_decides_its_order_whatever_the_runs_seed(tmp_path):
    """As in torch's ``RandomSampler``: the same generator seed, the same first batch under two run seeds; another
    generator seed, another batch. The engine drew the order from ``seed_everything`` alone."""
    from tests.helpers import QUIET, cli_in_process

    def first_labels(run_seed: int, order_seed: int) -> list[int]:
        cli = cli_in_process("fit", *QUIET, "--data", "tests.fixtures.loader_habits.OwnGenerator",
                             "--data.order_seed", str(order_seed), "--seed_everything", str(run_seed),
                             "--trainer.max_steps", "1", "--trainer.limit_val_batches", "0",
                             "--trainer.callbacks+=tests.fixtures.loader_habits.FirstLabels",
                             root=tmp_path / f"{run_seed}-{order_seed}")  # fmt: skip
        return next(c.labels for c in cli.trainer.callbacks if type(c).__name__ == "FirstLabels")

    assert first_labels(1, 0) == first_labels(2, 0)
    assert first_labels(1, 0) != first_labels(1, 7)
