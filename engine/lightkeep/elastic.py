"""Elastic determinism (MosaicML's term): a checkpoint of N ranks continues on M ranks with the same samples in the
same global batches, the same optimizer steps and the same LR schedule.

The epoch's order is drawn over the whole data set from ``(seed, epoch)`` and padded to a multiple of the global
batch, never to the number of ranks (``loaders.ResumableSampler``); rank ``r`` of ``W`` takes ``order[r::W]``, so
optimizer step ``s`` trains on ``order[s*G:(s+1)*G]`` on any number of ranks that keeps ``G`` = per-device batch x
ranks x ``accumulate_grad_batches``. On such a resume the engine keeps ``G`` by changing the accumulation (one
segment of the start line says so), and rewrites Lightning's loop counters, which count each rank's micro-batches,
to the new shape (``compat_loops.rescale_batch_progress``). What cannot follow a change of shape is said in the start
line: the random streams of each rank (dropout), BatchNorm statistics over another number of samples, and an epoch that
``limit_train_batches`` (a count of micro-batches) now ends at other samples (``epoch_note``).
"""

import math
from dataclasses import dataclass
from typing import Any

import lightning as L
from torch import nn


@dataclass(frozen=True)
class Shape:
    """How a run splits its global batch: ``world`` data-parallel ranks x ``batch_size`` per device x ``accumulate``."""

    world: int
    batch_size: int
    accumulate: int

    @property
    def global_batch(self) -> int:
        return self.world * self.batch_size * self.accumulate

    def __str__(self) -> str:
        return (
            f"{self.global_batch} samples ({self.batch_size} per device x {self.world} rank(s) x {self.accumulate} "
            "accumulated)"
        )


def data_parallel_world(trainer: L.Trainer) -> int:
    """The ranks the training data is split over (under sharding with tensor parallelism, not every rank)."""
    return (trainer.distributed_sampler_kwargs or {}).get("num_replicas", 1)


class GlobalBatch:
    """The run's split of its global batch, and on a resume from a checkpoint of another shape how it keeps the
    checkpoint's. One per run: the CLI hands the same instance to the part that builds the train loader
    (``user_loaders``, which plans it) and to the one that saves and restores it (``resume.ExactResume``)."""

    def __init__(self) -> None:
        self.shape: Shape | None = None  # this run's, planned where its train loader is built
        self.saved: Shape | None = None  # the checkpoint's
        self.note: str | None = None  # the start line's ``elastic:`` segment
        self.resized: tuple[int, int] | None = None  # samples of one micro-batch over all ranks: checkpoint's, now

    def plan(self, trainer: L.Trainer, batch_size: int) -> int:
        """Samples per optimizer step over all ranks, for a train loader of ``batch_size`` per device.

        On a resume from a checkpoint of another shape it keeps the checkpoint's global batch: it sets
        ``trainer.accumulate_grad_batches`` to the value that does (here, where the loader is built: Lightning reads
        the accumulation next, for the schedule's step count, with no hook in between; the fix proposed to Lightning
        is in docs/upstream.md), or raises ``ValueError`` naming the per-device batch and accumulation that would
        when no integer accumulation does.
        """
        now = Shape(data_parallel_world(trainer), batch_size, trainer.accumulate_grad_batches)
        saved = self.saved
        if saved is not None and saved != now:
            now = _keep(saved, now)
            if now.accumulate != trainer.accumulate_grad_batches:
                how = f"accumulate_grad_batches {trainer.accumulate_grad_batches} -> {now.accumulate} keeps the"
                trainer.accumulate_grad_batches = now.accumulate
            else:
                how = "the same"
            self.note = f"{saved.world} -> {now.world} rank(s): {how} global batch of {now}"
            self.resized = (saved.world * saved.batch_size, now.world * now.batch_size)
        self.shape = now
        return now.global_batch


def _keep(saved: Shape, now: Shape) -> Shape:
    """``now`` with the accumulation that keeps ``saved``'s global batch; ``ValueError`` when none does."""
    per_step = now.world * now.batch_size
    if saved.global_batch % per_step == 0:
        return Shape(now.world, now.batch_size, saved.global_batch // per_step)
    if saved.global_batch % now.world:
        fits = [w for w in range(1, saved.global_batch + 1) if saved.global_batch % w == 0]
        how = f"run it on a number of devices that divides {saved.global_batch} ({', '.join(map(str, fits[:8]))})"
    else:
        per_rank = saved.global_batch // now.world
        pairs = [(b, per_rank // b) for b in range(per_rank, 0, -1) if per_rank % b == 0][:4]
        how = "set a per-device batch size and --trainer.accumulate_grad_batches whose product is " + (
            f"{per_rank}: " + ", ".join(f"{b} x {a}" for b, a in pairs)
        )
    raise ValueError(
        f"the checkpoint trained with a global batch of {saved}; on {now.world} rank(s) with {now.batch_size} per "
        f"device no integer accumulate_grad_batches keeps it, and the same global batches are what make the resumed "
        f"run continue the original one: {how}"
    )


def epoch_note(limit: int | float, samples: float, saved_samples: int, now: Shape) -> str | None:
    """The start line's note when an epoch now runs ``samples`` over all ranks, not the ``saved_samples`` of the
    checkpoint's run; ``None`` when they are the same.

    Lightning's ``limit_train_batches`` counts each rank's micro-batches (an int: that many, a float: that share of
    them), not samples: on a shape whose micro-batch holds other samples, the flag the checkpoint's run was given ends
    the epoch elsewhere, and the global batches from that epoch's end on are not the original run's (nor, under
    ``max_epochs``, is the last step). The engine leaves the flag as given, since the user may mean another limit;
    the note names the one that keeps the checkpoint's epochs.
    """
    if samples == saved_samples:
        return None
    micro = now.world * now.batch_size
    if saved_samples % micro == 0:
        keeps = f"--trainer.limit_train_batches {saved_samples // micro} keeps them"
    else:
        keeps = f"no limit on micro-batches of {micro} samples over all ranks keeps them"
    ran = "the whole loader"
    if samples < math.inf:
        ran = f"{int(samples)} samples ({math.ceil(samples / now.global_batch)} steps)"
    return (
        f"limit_train_batches {limit} counts each rank's micro-batches: an epoch now runs {ran}, the checkpoint's run "
        f"{saved_samples} ({math.ceil(saved_samples / now.global_batch)}), so the global batches from this epoch's "
        f"end on differ from the original run's ({keeps})"
    )


def has_batch_norm(module: Any) -> bool:
    kinds = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)  # the Lazy ones subclass these
    return any(isinstance(m, kinds) for m in module.modules())
