"""Loaders that resume mid-epoch exactly and evaluate every sample exactly once across ranks: ``ResumableSampler``
and ``ResumableDataLoader`` (``user_loaders`` puts them into plain loaders)."""

import itertools
import math
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import (
    DataLoader,
    Dataset,
    DistributedSampler,
    RandomSampler,
    Sampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
)


class ResumableSampler(DistributedSampler):
    """Indices of one rank, in an order that is a pure function of ``(seed, epoch)``.

    The epoch's order is drawn over the whole data set whatever the number of ranks, and rank ``r`` of ``W`` takes
    ``order[r::W]``: the samples of the ``k``-th global batch of ``G`` samples are ``order[k*G:(k+1)*G]`` on any
    number of ranks that keeps ``G`` (elastic determinism, ``lightkeep.elastic``).
    ``pad=True`` (training) repeats the first indices of the order until its length is a multiple of
    ``global_batch`` (samples per optimizer step over all ranks; default ``num_replicas``), so all ranks get the
    same number of full batches and the padding does not depend on the number of ranks; ``cut=True`` (a train
    loader's ``drop_last``) drops the order's last short global batch instead. ``pad=False`` (evaluation)
    gives each index to exactly one rank, so metrics reduced across ranks equal the single-process value; ranks may
    then run different numbers of batches.
    ``epoch_in_keys``: hand out ``epoch * len(dataset) + index``, the key of a dataset seeded per sample
    (``lightkeep.sample_seeds``).
    ``source``: a sampler whose kind of draw is kept (``RandomSampler`` with or without replacement,
    ``SubsetRandomSampler``, ``WeightedRandomSampler``), drawn from a generator seeded with ``seed + epoch`` instead
    of its own; ``None``: a permutation of the dataset when ``shuffle``, else its order.
    Subclassing ``DistributedSampler`` tells Lightning to leave it alone instead of wrapping it.
    """

    def __init__(
        self,
        dataset: Dataset,
        num_replicas: int,
        rank: int,
        shuffle: bool,
        seed: int,
        pad: bool,
        *,
        source: Sampler | None = None,
        drop_last: bool = False,
        cut: bool = False,
        global_batch: int | None = None,
        epoch_in_keys: bool = False,
    ) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed, drop_last=drop_last)
        self.epoch_in_keys = epoch_in_keys
        multiple = global_batch or num_replicas
        if multiple % num_replicas:
            raise ValueError(f"global_batch ({multiple}) must be a multiple of the number of ranks ({num_replicas})")
        self.pad, self.cut, self.source, self.multiple = pad, cut, source, multiple
        total = len(source) if isinstance(source, _DRAWS) else len(dataset)  # type: ignore[arg-type]
        self.total = total  # the samples of one epoch's order before padding
        if drop_last:
            self.num_samples = total // num_replicas
        elif cut:
            self.num_samples = total // multiple * multiple // num_replicas
        else:
            padded = math.ceil(total / multiple) * multiple
            self.num_samples = padded // num_replicas if pad else len(range(rank, total, num_replicas))
        self.skip = 0  # samples of the current epoch already consumed before a resume

    def __iter__(self) -> Iterator[int]:
        # A generator: the order is drawn and ``skip`` used at the first draw, not at ``iter()``. A loader with
        # workers makes an iterator of its batch sampler and drops it for a second one (torch's ``_reset``), and
        # torchdata's ``BatchSampler`` calls ``iter()`` on this sampler as soon as it is itself iterated.
        order = _epoch_order(self, torch.Generator().manual_seed(self.seed + self.epoch))
        total, world = len(order), self.num_replicas
        if self.drop_last or self.cut:  # the user's DistributedSampler's drop_last evens the ranks; a loader's, steps
            unit = world if self.drop_last else self.multiple
            order = order[: total - total % unit]
        elif self.pad and total % self.multiple:
            short = self.multiple - total % self.multiple  # may exceed the order's length on a tiny data set
            order = torch.cat([order, order.repeat(-(-short // total))[:short]])
        mine = order[self.rank :: world][self.skip :]
        self.skip = 0
        if self.epoch_in_keys:  # the key a dataset seeded per sample decodes (lightkeep.sample_seeds)
            mine = mine + self.epoch * len(self.dataset)  # type: ignore[arg-type]
        yield from mine.tolist()


_DRAWS = (RandomSampler, SubsetRandomSampler, WeightedRandomSampler)  # samplers whose draw ResumableSampler redoes


def _epoch_order(sampler: ResumableSampler, generator: torch.Generator) -> torch.Tensor:
    """All ranks' indices of one epoch, drawn as ``sampler.source`` would draw them, from ``generator``."""
    source, n = sampler.source, len(sampler.dataset)  # type: ignore[arg-type]
    if isinstance(source, SubsetRandomSampler):
        indices = torch.as_tensor(list(source.indices))
        return indices[torch.randperm(len(indices), generator=generator)]
    if isinstance(source, WeightedRandomSampler):
        return torch.multinomial(source.weights, source.num_samples, source.replacement, generator=generator)
    if isinstance(source, RandomSampler) and source.replacement:
        return torch.randint(n, (source.num_samples,), generator=generator)
    if isinstance(source, RandomSampler):  # num_samples may exceed n: permutation after permutation
        return torch.cat([torch.randperm(n, generator=generator) for _ in range(-(-source.num_samples // n))])[
            : source.num_samples
        ]
    return torch.randperm(n, generator=generator) if sampler.shuffle else torch.arange(n)


class ResumableDataLoader(DataLoader):
    """A DataLoader whose position in the epoch goes into Lightning checkpoints.

    Lightning saves ``state_dict()`` of any train loader that has one: the epoch and how many batches were handed
    out. For a loader with a length, its fetcher prefetches nothing, so those are exactly the batches the training
    loop consumed. On resume the batches already consumed are skipped, but only in that same epoch: Lightning
    sets the sampler's epoch before iterating, and a checkpoint taken at an epoch's end (whether the epoch ran
    out or was cut short by ``limit_train_batches``) resumes with the next epoch. With a ``ResumableSampler`` the
    skipped samples are never loaded; with another sampler (``overfit_batches`` swaps in a ``SequentialSampler``)
    they are loaded and dropped. The ``generator`` is re-seeded per epoch so that the workers' base seed never draws
    from, and never shifts, the global RNG that dropout uses. Under a ``ResumableSampler`` the position is also saved
    as ``samples``, what all ranks consumed of the epoch: a resume on another number of ranks continues from it.
    """

    _restore: tuple[int, int] | None = None  # (epoch, batches) from a checkpoint, applied when that epoch starts
    # ``next_batch``'s: whether to record the next batch yielded (a resumed run's first), that record, and the record
    # of the batch after the last save with its (epoch, batches)
    watch_first_batch: Callable[[Any, Any], torch.Tensor | None] | None = None  # next_batch.observe, once watched
    first_batch: torch.Tensor | None = None
    next_batch: tuple[tuple[int, int], torch.Tensor] | None = None

    def __iter__(self) -> Iterator[Any]:
        sampler = self.sampler
        epoch = getattr(sampler, "epoch", 0)
        skip = self._restore[1] if self._restore is not None and self._restore[0] == epoch else 0
        self._restore = None
        self._epoch, self._yielded = epoch, skip
        if isinstance(sampler, ResumableSampler):
            sampler.skip = skip * (self.batch_size or 1)
            self.generator = torch.Generator().manual_seed(sampler.seed + 7919 * (epoch + 1))
            batches = super().__iter__()
        else:
            batches = itertools.islice(super().__iter__(), skip, None)
        for batch in batches:
            if self.watch_first_batch is not None:  # a resume's first: for the start line to compare with the record
                self.first_batch, self.watch_first_batch = self.watch_first_batch(self, batch), None
            self._yielded += 1
            yield batch

    def state_dict(self) -> dict[str, int]:
        state = {"epoch": getattr(self, "_epoch", 0), "batches": getattr(self, "_yielded", 0)}
        if isinstance(self.sampler, ResumableSampler):
            state["seed"] = self.sampler.seed
            state["samples"] = state["batches"] * (self.batch_size or 1) * self.sampler.num_replicas
        return state

    def load_state_dict(self, state: dict[str, int]) -> None:
        batches = state["batches"]
        if isinstance(self.sampler, ResumableSampler) and "samples" in state:
            per_step = (self.batch_size or 1) * self.sampler.num_replicas  # samples of one batch over all ranks
            if state["samples"] % per_step:
                raise ValueError(
                    f"the checkpoint was taken after {state['samples']} samples of epoch {state['epoch']}, not a "
                    f"whole number of batches of {self.batch_size or 1} on {self.sampler.num_replicas} rank(s): resume "
                    "it with a batch size and number of ranks whose product divides that count"
                )
            batches = state["samples"] // per_step
        self._restore = (state["epoch"], batches)
        if isinstance(self.sampler, ResumableSampler):
            self.sampler.set_epoch(state["epoch"])  # Lightning sets the epoch it resumes in before iterating
            # the run's seed may be another one now (``seed_everything: true`` draws one per run): keep the order
            self.sampler.seed = state.get("seed", self.sampler.seed)


def seed_the_workers(loader: Any, epoch: int) -> None:
    """Gives ``loader`` (whose user gave no generator) a generator of its own, seeded by the run's seed and ``epoch``:
    torch draws each iterator's worker base seed from ``generator``, else from the global generator that dropout
    uses, which a resume restores and would draw from again (a loader with a length starts its iterator after the
    restore), shifting every draw after it; as ``ResumableDataLoader`` does. Call it as its iterator starts."""
    if loader.generator is None or loader.own_generator:
        seed = int(os.environ.get("PL_GLOBAL_SEED", 0))
        loader.generator = torch.Generator().manual_seed(seed + 7919 * (epoch + 1))
        loader.own_generator = True


_IN_FRONT: dict[tuple[type, type], type] = {}


def in_front_of(cls: type, mixin: type, **attributes: Any) -> type:
    """``cls`` (``DataLoader`` or the user's subclass of it, whose name it keeps) with ``mixin``'s methods in front:
    the user's class still iterates, collates and holds its attributes. With class ``attributes``, a new class at each
    call; without, one per pair (``cls`` itself where it has ``mixin`` already, ``mixin`` for a plain ``DataLoader``).
    """
    if attributes:
        return type(cls.__name__, (mixin, cls), {"__module__": cls.__module__, **attributes})
    if issubclass(cls, mixin):
        return cls
    if cls is DataLoader:
        return mixin
    if (cls, mixin) not in _IN_FRONT:
        _IN_FRONT[cls, mixin] = type(cls.__name__, (mixin, cls), {"__module__": cls.__module__})
    return _IN_FRONT[cls, mixin]


def check_train_batch(batch_size: int, sampler: ResumableSampler) -> None:
    """Raises when one batch of ``batch_size`` is larger than this rank's share of the training set (before the
    padding to the global batch, which would otherwise fill the one short batch with repeats of the same samples)."""
    world = sampler.num_replicas
    share = sampler.total // world if sampler.drop_last or sampler.cut else math.ceil(sampler.total / world)
    if sampler.cut and sampler.num_samples == 0 and batch_size <= share:  # accumulated steps longer than an epoch
        raise ValueError(
            f"drop_last leaves no optimizer step: the training set ({sampler.total} samples) is smaller than one "
            f"step's {sampler.multiple} over all ranks. Lower --trainer.accumulate_grad_batches or the batch size."
        )
    if batch_size > share:
        where = f"{share} samples" + (f" per rank on {world} ranks" if world > 1 else "")
        raise ValueError(
            f"batch_size ({batch_size}) is larger than the training set ({where}): every epoch would be one short "
            f"batch. Lower --data.batch_size to {share} or less."
        )


def check_eval_share(size: int, world: int) -> None:
    """Raises on every rank alike when an evaluation set of ``size`` samples leaves some of ``world`` ranks none:
    Lightning would stop that rank alone with a traceback and the others would then fail in their next collective."""
    if size < world:
        raise ValueError(
            f"the evaluation/predict set has {size} sample(s), fewer than the {world} ranks, and each rank needs "
            f"one. Run it on {max(size, 1)} device(s) or fewer (--trainer.devices), or on more samples."
        )
