"""Data: the bundled scikit-learn digits, split deterministically, in loaders that resume mid-epoch exactly.

To train on your own data, write a LightningDataModule like ``DigitsDataModule`` (``setup`` builds datasets,
``*_dataloader`` wraps them with ``make_loader``) and select it with ``--data my_pkg.data.MyData``. Keep
``make_loader``: it is what makes a resumed run see the same batches, and every validation sample counted
exactly once under DDP.
"""

import math
from collections.abc import Iterator
from typing import Any

import lightning as L
import torch
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

    Lightning saves ``state_dict()`` of any train loader that has one. For a loader with a length, its fetcher
    prefetches nothing, so the batches handed out are exactly the batches the training loop has consumed. The
    loader's ``generator`` is re-seeded per epoch so that the workers' base seed never draws from, and never
    shifts, the global RNG that dropout uses.
    """

    def __iter__(self) -> Iterator[Any]:
        sampler = self.sampler
        assert isinstance(sampler, ResumableSampler), "ResumableDataLoader needs a ResumableSampler"
        self._epoch, self._yielded = sampler.epoch, sampler.skip // self.batch_size
        self.generator = torch.Generator().manual_seed(sampler.seed + 7919 * (sampler.epoch + 1))
        for batch in super().__iter__():
            self._yielded += 1
            yield batch

    def state_dict(self) -> dict[str, int]:
        return {"epoch": getattr(self, "_epoch", 0), "batches": getattr(self, "_yielded", 0)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        sampler = self.sampler
        assert isinstance(sampler, ResumableSampler)
        if state["batches"] >= len(self):  # saved at the end of an epoch: the next one starts fresh
            sampler.set_epoch(state["epoch"] + 1)
        else:
            sampler.set_epoch(state["epoch"])
            sampler.skip = state["batches"] * self.batch_size


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
    sampler = ResumableSampler(dataset, world, rank, shuffle=train, seed=seed, pad=train)
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


class DigitsDataModule(L.LightningDataModule):
    """scikit-learn's 1,797 handwritten digits (8 x 8 images, 10 classes), shipped with the package.

    Args:
        batch_size: Samples per batch on each rank (the global batch is ``batch_size * world_size``).
        val_fraction: Share of the data held out for validation.
        test_fraction: Share of the data held out for testing.
        seed: Seeds the train/val/test split and the shuffle order of every epoch.
        num_workers: Loader worker processes per rank; 0 loads in the main process (best for in-memory data).
        pin_memory: Page-lock batches for faster host-to-GPU copies.
        persistent_workers: Keep workers alive between epochs (needs ``num_workers > 0``).
    """

    num_classes = 10

    def __init__(
        self,
        batch_size: int = 64,
        val_fraction: float = 0.15,
        test_fraction: float = 0.15,
        seed: int = 0,
        num_workers: int = 0,
        pin_memory: bool = False,
        persistent_workers: bool = False,
    ) -> None:
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"batch_size ({batch_size}) must be >= 1")
        if not (0 < val_fraction < 1 and 0 <= test_fraction < 1 and val_fraction + test_fraction < 1):
            raise ValueError(
                f"val_fraction ({val_fraction}) and test_fraction ({test_fraction}) must lie in [0, 1) "
                "and leave some data for training (val_fraction > 0, sum < 1)"
            )
        if num_workers < 0:
            raise ValueError(f"num_workers ({num_workers}) must be >= 0")
        if persistent_workers and num_workers == 0:
            raise ValueError("persistent_workers=True needs num_workers > 0")
        self.save_hyperparameters()
        self.splits: dict[str, TensorBatchDataset] = {}

    def setup(self, stage: str) -> None:
        if self.splits:
            return
        from sklearn.datasets import load_digits  # imported here: it costs ~1 s and only this class needs it

        digits = load_digits()
        images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0  # (N, 1, 8, 8) in [0, 1]
        labels = torch.tensor(digits.target, dtype=torch.long)  # (N,)
        n = len(labels)
        order = torch.randperm(n, generator=torch.Generator().manual_seed(self.hparams.seed))
        n_val, n_test = int(n * self.hparams.val_fraction), int(n * self.hparams.test_fraction)
        parts = {"val": order[:n_val], "test": order[n_val : n_val + n_test], "train": order[n_val + n_test :]}
        self.splits = {name: TensorBatchDataset(images[idx], labels[idx]) for name, idx in parts.items()}

    def _loader(self, split: str, train: bool = False) -> DataLoader:
        hp = self.hparams
        if len(self.splits[split]) == 0:  # the fractions were checked in __init__, the counts only exist now
            n, fraction = sum(len(s) for s in self.splits.values()), f"{split}_fraction"
            raise ValueError(
                f"{fraction} ({hp[fraction]}) leaves no {split} samples: int({hp[fraction]} * {n}) = 0 of the {n} "
                f"digits. Raise --data.{fraction} to at least {math.ceil(1e4 / n) / 1e4}."
            )
        return make_loader(
            self.splits[split],
            self.trainer,
            train=train,
            seed=hp.seed,
            batch_size=hp.batch_size,
            num_workers=hp.num_workers,
            pin_memory=hp.pin_memory,
            persistent_workers=hp.persistent_workers,
        )

    def train_dataloader(self) -> DataLoader:
        return self._loader("train", train=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader("val")

    def test_dataloader(self) -> DataLoader:
        return self._loader("test")

    def predict_dataloader(self) -> DataLoader:
        return self._loader("test")
