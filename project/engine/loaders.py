"""Loaders that resume mid-epoch exactly and evaluate every sample exactly once across ranks: ``make_loader``."""

import itertools
import math
from collections.abc import Iterator
from typing import Any

import lightning as L
import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Subset


class ResumableSampler(DistributedSampler):
    """Indices of one rank, in an order that is a pure function of ``(seed, epoch)``.

    ``pad=True`` (training) repeats a few indices so all ranks get the same number of samples, as
    ``DistributedSampler`` does. ``pad=False`` (evaluation) gives each index to exactly one rank, so metrics
    reduced across ranks equal the single-process value; ranks may then run different numbers of batches.
    Subclassing ``DistributedSampler`` tells Lightning to leave it alone instead of wrapping it.
    """

    def __init__(self, dataset: Dataset, num_replicas: int, rank: int, shuffle: bool, seed: int, pad: bool) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed)
        self.pad = pad
        n = len(dataset)  # type: ignore[arg-type]
        self.num_samples = math.ceil(n / num_replicas) if pad else len(range(rank, n, num_replicas))
        self.skip = 0  # samples of the current epoch already consumed before a resume

    def __iter__(self) -> Iterator[int]:
        n = len(self.dataset)  # type: ignore[arg-type]
        if self.shuffle:
            order = torch.randperm(n, generator=torch.Generator().manual_seed(self.seed + self.epoch))
        else:
            order = torch.arange(n)
        if self.pad and n % self.num_replicas:
            order = torch.cat([order, order[: self.num_replicas - n % self.num_replicas]])
        mine = order[self.rank :: self.num_replicas][self.skip :]
        self.skip = 0
        return iter(mine.tolist())


class ResumableDataLoader(DataLoader):
    """A DataLoader whose position in the epoch goes into Lightning checkpoints.

    Lightning saves ``state_dict()`` of any train loader that has one: the epoch and how many batches were handed
    out. For a loader with a length, its fetcher prefetches nothing, so those are exactly the batches the training
    loop consumed. On resume the batches already consumed are skipped, but only in that same epoch: Lightning
    sets the sampler's epoch before iterating, and a checkpoint taken at an epoch's end (whether the epoch ran
    out or was cut short by ``limit_train_batches``) resumes with the next epoch. With a ``ResumableSampler`` the
    skipped samples are never loaded; with another sampler (``overfit_batches`` swaps in a ``SequentialSampler``)
    they are loaded and dropped. The ``generator`` is re-seeded per epoch so that the workers' base seed never draws
    from, and never shifts, the global RNG that dropout uses.
    """

    _restore: tuple[int, int] | None = None  # (epoch, batches) from a checkpoint, applied when that epoch starts

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
            self._yielded += 1
            yield batch

    def state_dict(self) -> dict[str, int]:
        return {"epoch": getattr(self, "_epoch", 0), "batches": getattr(self, "_yielded", 0)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self._restore = (state["epoch"], state["batches"])
        if isinstance(self.sampler, ResumableSampler):
            self.sampler.set_epoch(state["epoch"])  # Lightning sets the epoch it resumes in before iterating


class TensorBatchDataset(Dataset):
    """In-memory tensors that yield a whole batch by one indexing op instead of collating samples one by one."""

    def __init__(self, *tensors: torch.Tensor) -> None:
        self.tensors = tensors

    def __len__(self) -> int:
        return len(self.tensors[0])

    def __getitem__(self, index: int) -> tuple[torch.Tensor, ...]:
        return tuple(t[index] for t in self.tensors)

    def __getitems__(self, indices: list[int]) -> tuple[torch.Tensor, ...]:
        index = torch.tensor(indices)
        return tuple(t[index] for t in self.tensors)


def _batch_as_is(batch: Any) -> Any:  # module level, so that worker processes can unpickle it
    return batch


def make_loader(
    dataset: Dataset, trainer: "L.Trainer | None", train: bool, seed: int, collate_fn: Any = None, **kwargs: Any
) -> DataLoader:
    """A loader over this rank's share of ``dataset``: shuffled, padded and resumable when ``train``.

    Evaluation loaders give each sample to exactly one rank; if the LightningModule sets
    ``evaluates_on_rank_zero``, rank 0 gets the whole set and the others one placeholder sample, which the module
    skips (with no batch at all, Lightning would skip their epoch-end hooks, where they receive rank 0's result).
    """
    if collate_fn is None and isinstance(dataset, TensorBatchDataset):
        collate_fn = _batch_as_is
    world, rank = (trainer.world_size, trainer.global_rank) if trainer is not None else (1, 0)
    if not train and world > 1 and getattr(trainer.lightning_module, "evaluates_on_rank_zero", False):
        if rank != 0:
            dataset = Subset(dataset, [0])
        world, rank = 1, 0
    size = len(dataset)  # type: ignore[arg-type]
    if not train and size < world:
        # Some rank would get no batch: Lightning stops that rank alone with a traceback and the others then fail
        # in their next collective. Every rank raises this alike instead.
        raise ValueError(
            f"the evaluation/predict set has {size} sample(s), fewer than the {world} ranks, and each rank needs "
            f"one. Run it on {max(size, 1)} device(s) or fewer (--trainer.devices), or on more samples."
        )
    # Under sharding every forward gathers each layer's weights from all ranks, so every rank must run as many
    # evaluation batches as the others: the set is padded like the training set (a few samples count twice).
    sharded = trainer is not None and isinstance(trainer.strategy, ModelParallelStrategy)
    sampler = ResumableSampler(dataset, world, rank, shuffle=train, seed=seed, pad=train or sharded)
    batch_size = kwargs.get("batch_size", 1)
    if train and batch_size is not None and batch_size > sampler.num_samples:
        share = f"{sampler.num_samples} samples" + (f" per rank on {world} ranks" if world > 1 else "")
        raise ValueError(
            f"batch_size ({batch_size}) is larger than the training set ({share}): every epoch would be one short "
            f"batch. Lower --data.batch_size to {sampler.num_samples} or less."
        )
    if train:
        return ResumableDataLoader(dataset, sampler=sampler, collate_fn=collate_fn, **kwargs)
    # A generator of its own: creating an eval iterator must not draw from the global RNG that training uses.
    generator = torch.Generator().manual_seed(seed)
    return DataLoader(dataset, sampler=sampler, collate_fn=collate_fn, generator=generator, **kwargs)
