"""The engine's samplers in the user's own loaders: a plain ``DataLoader(ds, batch_size=..., shuffle=True)`` resumes
mid-epoch exactly and evaluates each sample on one rank, as Lightning puts its ``DistributedSampler`` in."""

import os
from collections.abc import Callable
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.utilities import CombinedLoader
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
)

from lightkeep.compat import loader_with_sampler, uses_distributed_sampler
from lightkeep.compat_torch import sampler_of_its_batch_sampler
from lightkeep.elastic import GlobalBatch
from lightkeep.loaders import ResumableDataLoader, ResumableSampler, check_eval_share, check_train_batch, in_front_of
from lightkeep.own_orders import replay_own_order
from lightkeep.own_positions import keep_own
from lightkeep.sample_seeds import can_seed, worker_init
from lightkeep.stream_resume import StreamResume, saves_its_state

HOOKS = {f"{split}_dataloader": split for split in ("train", "val", "test", "predict")}
# The samplers whose order the engine redraws from (seed, epoch); any other is the user's own and left alone.
REPLACED = (RandomSampler, SequentialSampler, SubsetRandomSampler, WeightedRandomSampler, DistributedSampler)


class UserLoaders(Callback):
    """Puts a ``ResumableSampler`` into each loader the LightningModule's or DataModule's ``*_dataloader`` hooks
    return, whatever the loader's class.

    Train loaders become resumable: their order a pure function of ``(seed, epoch)``, split over ranks and padded,
    their position in the epoch saved in checkpoints, the consumed samples skipped on a mid-epoch resume.
    Validation/test/predict loaders give each sample to exactly one rank (padded under sharding). The seed is the
    run's (``seed_everything``, which Lightning's ``DistributedSampler`` takes too; 0 without one): a generator the
    user gave the loader cannot be read back, and each checkpoint keeps the seed its run used.

    A train loader over an ``IterableDataset`` resumes at its position instead (``streams``, ``stream_resume``).
    Left alone: a loader that saves its own state (torchdata's ``StatefulDataLoader``: Lightning saves and restores
    it), and what the engine cannot rebuild (an evaluation ``IterableDataset``, a sampler or batch sampler of the
    user's own); ``notes`` says, per split, which guarantee those give up, for the run's start line. The hooks are
    wrapped on the instances in ``setup`` and restored in ``teardown``.
    """

    def __init__(
        self, seed_per_sample: bool = True, streams: StreamResume | None = None, batches: GlobalBatch | None = None
    ) -> None:
        self.seed_per_sample = seed_per_sample  # run.seed_per_sample (lightkeep.sample_seeds)
        self.streams = streams  # keeps the train streams' positions (lightkeep.stream_resume)
        self.batches = batches if batches is not None else GlobalBatch()  # the run's shape, which ExactResume saves
        self.notes: dict[str, list[str]] = {}
        self._wrapped: list[tuple[Any, str]] = []

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        for owner in (trainer.datamodule, pl_module):
            for hook, split in HOOKS.items():
                if owner is not None and is_overridden(hook, owner) and hook not in vars(owner):
                    setattr(owner, hook, self._wrap(getattr(owner, hook), trainer, split))
                    self._wrapped.append((owner, hook))

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        for owner, hook in self._wrapped:
            delattr(owner, hook)
        self._wrapped = []

    def _wrap(self, hook: Callable[[], Any], trainer: L.Trainer, split: str) -> Callable[[], Any]:
        def with_engine_samplers() -> Any:
            loaders = hook()
            combined = loaders if isinstance(loaders, CombinedLoader) else CombinedLoader(loaders)
            if split == "train" and self.streams is not None:
                self.streams.rebuilding()
            rebuilt = [self._engine_loader(loader, trainer, split) for loader in combined.flattened]
            combined.flattened = [loader for loader, _ in rebuilt]
            self.notes[split] = [f"{split} loader {i}: {note}" for i, (_, note) in enumerate(rebuilt) if note]
            return loaders if isinstance(loaders, CombinedLoader) else combined.iterables

        with_engine_samplers.__wrapped__ = hook  # type: ignore[attr-defined]  # Lightning's is_overridden reads it
        return with_engine_samplers

    def _engine_loader(self, loader: Any, trainer: L.Trainer, split: str) -> tuple[Any, str | None]:
        rebuilt, note = engine_loader(loader, trainer, split, self.seed_per_sample, self.streams, self.batches)
        sampler = getattr(rebuilt, "sampler", None)
        if isinstance(sampler, ResumableSampler) and sampler.epoch_in_keys:
            # each worker seeds its own copy of the dataset as it starts, then runs the user's worker_init_fn
            rebuilt.worker_init_fn = worker_init(sampler.seed, rebuilt.worker_init_fn)
        elif split == "train" and note is None and getattr(loader, "num_workers", 0) and not self.seed_per_sample:
            note = (
                "run.seed_per_sample is off: random draws in the dataset's __getitem__ depend on the loader worker "
                "that fetches each sample, so a resume augments differently"
            )
        return rebuilt, note


def engine_loader(
    loader: Any,
    trainer: L.Trainer,
    split: str,
    seeded: bool = False,
    streams: StreamResume | None = None,
    batches: GlobalBatch | None = None,
) -> tuple[Any, str | None]:
    """``loader`` with the engine's sampler, or ``loader`` itself; and the guarantee it gives up (``None``: none).
    ``seeded``: a train loader's sampler hands out the keys of a dataset seeded per sample (``sample_seeds``);
    ``streams``: what resumes a train loader over an ``IterableDataset`` where it stopped (``stream_resume``);
    ``batches``: the run's global batch, planned here for a train loader (``elastic.GlobalBatch``)."""
    if not isinstance(loader, DataLoader):
        return loader, None  # Lightning takes it as it is
    reason, iterable = _why_not(loader), isinstance(loader.dataset, IterableDataset)
    if saves_its_state(loader) and not (_plain_stateful(loader) and reason is None):
        if split != "train" or streams is None:
            return loader, None  # an evaluation loader starts afresh each time: its own position is not needed
        return keep_own(loader, trainer, streams)  # each rank's own position, as of the batches trained on
    ranks = trainer.distributed_sampler_kwargs or {}  # the data-parallel ranks (under sharding, not every rank)
    world, rank = ranks.get("num_replicas", 1), ranks.get("rank", 0)
    train, sampler, sharded = split == "train", loader.sampler, isinstance(trainer.strategy, ModelParallelStrategy)
    split_by_lightning = uses_distributed_sampler(trainer)
    if reason is not None:
        if train and streams is not None and iterable:
            rebuilt, note = streams.resumable(loader, trainer)
            return rebuilt, None if note is None else f"{reason}: {note}"
        if train and streams is not None and streams.mode != "restart":
            return replay_own_order(loader, trainer, streams, type(own_order(loader)).__name__)
        return loader, _gives_up(reason, split, world, split_by_lightning and not iterable, sharded)
    note = None
    seed = int(os.environ.get("PL_GLOBAL_SEED", 0))  # seed_everything's, as Lightning's DistributedSampler reads it
    own = getattr(sampler, "generator", None) or loader.generator  # a RandomSampler's, or given to the DataLoader
    if own is not None:  # it decides the order, as in torch, whatever seed_everything says
        seed = own.initial_seed() % 2**63
    shuffle, drop_last = not isinstance(sampler, SequentialSampler), False
    if type(sampler) is DistributedSampler:  # the user's own split: kept, with its seed and shuffle
        world, rank = sampler.num_replicas, sampler.rank
        seed, shuffle, drop_last = sampler.seed, sampler.shuffle, sampler.drop_last
    elif not split_by_lightning:  # Trainer(use_distributed_sampler=False): every rank sees all, in the engine's order
        note = _gives_up("use_distributed_sampler is off", split, world, False, sharded)
        world, rank = 1, 0
    if not train:
        check_eval_share(len(loader.dataset), world)  # type: ignore[arg-type]
    source = None if isinstance(sampler, (SequentialSampler, DistributedSampler)) else sampler
    # the samples of one optimizer step over all ranks: the padding's unit, kept on a resume on other ranks
    batches = batches if batches is not None else GlobalBatch()
    per_step = batches.plan(trainer, loader.batch_size or 1) if train and split_by_lightning else None
    resumable = ResumableSampler(
        loader.dataset,
        world,
        rank,
        shuffle,
        seed,
        pad=train or sharded,
        source=source,
        drop_last=drop_last,
        cut=train and bool(loader.drop_last),  # its last short batch dropped, as it asks, not padded to a full one
        global_batch=per_step,
        epoch_in_keys=seeded and train and loader.num_workers > 0 and can_seed(loader.dataset),
    )
    batch_size = loader.batch_size or getattr(loader.batch_sampler, "batch_size", None)
    if train and batch_size is not None:
        check_train_batch(batch_size, resumable)  # before the padding repeats samples to fill the one short batch
    rebuilt = loader_with_sampler(loader, resumable)
    sampler_of_its_batch_sampler(rebuilt)  # a StatefulDataLoader's BatchSampler, rebuilt by Lightning
    if train:
        rebuilt.__class__ = in_front_of(type(rebuilt), ResumableDataLoader)
    elif rebuilt.generator is None:
        # A generator of its own: creating an eval iterator must not draw from the global RNG that training uses.
        rebuilt.generator = torch.Generator().manual_seed(seed)
    return rebuilt, note


def _plain_stateful(loader: DataLoader) -> bool:
    """``loader`` is torchdata's ``StatefulDataLoader`` over a map-style dataset: its position is the sampler's (its
    own ``RandomSampler``/``BatchSampler``), which the engine's sampler takes over, as in a plain ``DataLoader``
    (exact on another number of ranks, each worker's draws seeded per sample, the first batch checked)."""
    cls = next((c for c in type(loader).__mro__ if c.__name__ == "StatefulDataLoader"), None)
    mapped = not isinstance(loader.dataset, IterableDataset)
    return cls is not None and cls.__module__.startswith("torchdata.") and mapped


def _torchdata_plain(part: Any) -> bool:
    """torchdata's stateful ``RandomSampler`` (a permutation, no replacement) or ``BatchSampler``: a plain shuffle or
    batching that keeps a count."""
    cls = type(part)
    if not cls.__module__.startswith("torchdata.stateful_dataloader"):
        return False
    # a RandomSampler drawing one permutation of every sample
    shuffle = cls.__name__ == "RandomSampler" and not part.replacement and part.num_samples == len(part.data_source)
    return shuffle or cls.__name__ == "BatchSampler"


def own_order(loader: DataLoader) -> Any:
    """What draws ``loader``'s order of a map-style dataset: its batch sampler, unless that is torch's own."""
    batches = loader.batch_sampler
    return loader.sampler if batches is None or type(batches) is BatchSampler else batches


def _why_not(loader: DataLoader) -> str | None:
    """Why the engine cannot put its sampler into ``loader`` (``None``: it can)."""
    dataset, sampler, batches = loader.dataset, loader.sampler, loader.batch_sampler
    if isinstance(dataset, IterableDataset):
        if hasattr(dataset, "state_dict"):
            return f"its IterableDataset {type(dataset).__name__} has a state that Lightning saves of a loader only"
        return f"an IterableDataset ({type(dataset).__name__}) without state_dict"
    if batches is not None and type(batches) is not BatchSampler and not _torchdata_plain(batches):
        return f"its batch_sampler {type(batches).__name__} is the user's own"
    if hasattr(sampler, "state_dict"):
        return f"its sampler {type(sampler).__name__} has a state that Lightning saves of a loader only"
    if type(sampler) not in REPLACED and not _torchdata_plain(sampler):
        return f"its sampler {type(sampler).__name__} is the user's own"
    return None


def _gives_up(reason: str, split: str, world: int, split_over_ranks: bool, sharded: bool) -> str | None:
    """What a loader gives up, in the start line's words (``None``: nothing)."""
    if split == "train":
        return f"{reason}: a mid-epoch resume restarts that epoch's data"
    if world == 1 or sharded:
        return None  # one rank sees each sample once; a sharded run pads its evaluation (said apart)
    stage = {"val": "validation", "test": "test", "predict": "predict"}[split]
    if not split_over_ranks:
        return f"{reason}: each of the {world} ranks gets every sample, so {stage} counts samples up to {world} times"
    if split == "predict":
        return None  # Lightning's UnrepeatedDistributedSamplerWrapper: each sample on one rank
    return f"{reason}: Lightning's DistributedSampler pads it over {world} ranks, so {stage} counts a few samples twice"
