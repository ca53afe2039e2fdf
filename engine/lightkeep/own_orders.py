"""A train loader over a map-style dataset whose sampler or batch sampler is the user's own (a sampler with or without
``state_dict``, a bucketing batch sampler) resumes mid-epoch after the last batch trained on, in the user's order
(what the start line says of it: docs/engine.md, 'Data pipelines and what a resume gives each').

The engine's sampler cannot stand in for it (that would change the user's order), and Lightning saves nothing of a
plain ``DataLoader``: a resume restarted the epoch. Here the epoch's order is drawn again instead, in index space. As
an epoch's first indices are drawn, the global generators (torch's, numpy's, Python's: what a sampler without a
generator of its own draws from, as torch's ``RandomSampler`` does) are kept; a save keeps, per rank, them, the
number of batches trained on and a fingerprint of the next batch's indices (the indices run ahead of training: loader
workers prefetch, and one more batch is drawn ahead here). A resume puts those generators back while it draws the
epoch's indices again, drops the batches trained on, puts the generators as they were, and compares the next batch's
indices with the fingerprint: a sampler that draws from ``os.urandom`` or the clock, or from the global generators
between batches, gives another order, which stops the run. A sampler's own ``state_dict`` is not used: its order is
drawn again from where the epoch started. Another number of ranks stops in one line (``StreamResume.attach``).
"""

import itertools
from collections.abc import Callable, Iterator
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader

from lightkeep.compat_torch import index_sampler, unstarted_copy
from lightkeep.loaders import in_front_of, seed_the_workers
from lightkeep.sample_seeds import generator_states, set_generator_states
from lightkeep.stream_positions import Position, fingerprint
from lightkeep.stream_resume import StreamResume

_END = object()


class OwnOrder:
    """One such loader's position on this rank: its epoch, the generators its order was drawn from, the batches trained
    on, the fingerprints of the index batches drawn and not yet trained on."""

    checked = "its first batch's indices"  # what a resume compares (``next_batch``'s verdict)
    can_restart = True  # run.stream_resume restart is a way out of a refusal

    def __init__(self, name: str, epoch_of: Callable[[], int], strict: bool) -> None:
        self.name, self.epoch_of, self.strict = name, epoch_of, strict
        self.epoch = 0
        self.generators: dict[str, torch.Tensor] | None = None  # as this epoch's first indices were drawn
        self.drawn: dict[int, int] = {}  # batch number in the epoch -> fingerprint of its indices, not yet trained on
        self.trained = 0
        self.pending: dict[str, Any] | None = None  # the checkpoint's position, for the epoch being drawn
        self.restore: dict[str, Any] | None = None  # this rank's position in the checkpoint, until its epoch starts
        self.resumed: dict[str, Any] | None = None  # the position this run resumed at
        self.first: int | None = None  # the fingerprint of the first index batch after the resume
        self.problem: str | None = None  # StreamResume stops the run on it, before the first step

    @property
    def taken(self) -> dict[str, Any] | None:
        """What a save keeps (``None``: the loader was not iterated yet)."""
        if self.generators is None:
            return None
        return {"epoch": self.epoch, "batches": self.trained, "generators": self.generators,
                "next": self.drawn.get(self.trained)}  # fmt: skip

    def take(self, count: int) -> None:
        """``StreamResume``'s call at each batch: ``count`` batches of the epoch are trained on."""
        self.trained = count
        for number in [n for n in self.drawn if n < count]:
            del self.drawn[number]

    def start_epoch(self) -> None:
        restore, self.restore = self.restore, None
        self.epoch, self.generators, self.trained, self.drawn = self.epoch_of(), None, 0, {}
        mid_epoch = restore is not None and restore["epoch"] == self.epoch and restore["batches"] > 0
        self.pending = restore if mid_epoch else None  # a save at an epoch's end resumes with the next epoch

    def indices(self, sampler: Any) -> Iterator[Any]:
        """``sampler``'s index batches for this epoch, from the resume's position if there is one, one drawn ahead."""
        pending, self.pending = self.pending, None
        if pending is None:
            self.generators = generator_states(cuda=False)
            drawn, number = iter(sampler), 0
        else:
            now = generator_states(cuda=False)
            set_generator_states(pending["generators"])
            try:
                drawn = iter(sampler)
                number = sum(1 for _ in itertools.islice(drawn, pending["batches"]))  # indices only: nothing read
                ahead = next(drawn, _END)
            finally:
                set_generator_states(now)  # the checkpoint's, which dropout and the rest of the step draw from
            self.generators, self.trained, self.resumed = pending["generators"], number, pending
            self.first = fingerprint(ahead) if ahead is not _END else None
            self._compare(pending, number)
            drawn = itertools.chain([] if ahead is _END else [ahead], drawn)
        current = next(drawn, _END)
        if current is not _END:
            self.drawn[number] = fingerprint(current)
        while current is not _END:
            following = next(drawn, _END)  # drawn ahead: a save after this batch knows the next one's indices
            if following is not _END:
                self.drawn[number + 1] = fingerprint(following)
            yield current
            number, current = number + 1, following

    def _compare(self, restore: dict[str, Any], dropped: int) -> None:
        if dropped < restore["batches"]:
            self.problem = (
                f"{self.name}: drawn again, its order ended after {dropped} batches, before the {restore['batches']} "
                "the checkpoint's run trained on in this epoch: the data or the sampler changed since the save. "
                "Resume with --run.stream_resume restart (the epoch's data starts again)"
            )
        elif self.strict and restore["next"] is not None and self.first != restore["next"]:
            self.problem = (
                f"{self.name}: drawn again from the epoch's start, its next batch's indices differ from those the "
                "checkpoint's run drew: its order does not follow from the global generators as the epoch started "
                "(os.urandom, the clock, draws between batches). Nothing was trained. Resume with --run.stream_resume "
                "restart (the epoch's data starts again) or as_saved (continue in the order drawn now: not exactly)"
            )

    def describe(self, ranks: int) -> str:
        """What a resume of it does (or did), for the start line."""
        if self.resumed is not None:
            where = f" on each of {ranks} ranks" if ranks > 1 else ""
            return (
                f"{self.name}: resumed{where} after the {self.resumed['batches']} batches of epoch {self.epoch} "
                "trained on, its order drawn again from the epoch's start (indices only: no sample read)"
            )
        return f"{self.name}: a mid-epoch resume draws its order again, past the batches trained on (no sample read)"

    def verified(self, ranks: str) -> str:
        return (f"{self.name}: its first batch's indices{ranks} are those the checkpoint's run drew next, its order "
                "drawn again and fast-forwarded past the batches trained on")  # fmt: skip

    def differs(self, rank: str) -> str:
        return (
            f"{self.name}: its first batch's indices after the resume{rank} differ from those the checkpoint's "
            "run drew next: its order does not follow from the global generators as the epoch started"
        )

    unsaved = Position.unsaved


class _Indices:
    """In front of a loader's index sampler: its batches, drawn by ``OwnOrder.indices`` (a generator, so the draw
    happens at the first batch's indices: a loader with workers makes an iterator and drops it for a second)."""

    def __init__(self, sampler: Any, position: OwnOrder) -> None:
        self.sampler, self.position = sampler, position

    def __len__(self) -> int:
        return len(self.sampler)

    def __iter__(self) -> Iterator[Any]:
        return self.position.indices(self.sampler)


class ReplaysOwnOrder(DataLoader):
    """In front of the user's loader class. ``position`` is a class attribute: Lightning re-creates a loader (to put
    in its ``DistributedSampler``) from its class."""

    position: OwnOrder
    own_generator = False  # the user gave no generator: one is seeded per epoch here

    def __iter__(self) -> Iterator[Any]:
        position = self.position
        seed_the_workers(self, position.epoch_of())  # not from the global generator the order is drawn from
        position.start_epoch()
        yield from super().__iter__()

    @property
    def _index_sampler(self) -> Any:
        return _Indices(index_sampler(self), self.position)


def replay_own_order(loader: DataLoader, trainer: L.Trainer, streams: StreamResume, own: str) -> tuple[Any, str | None]:
    """A copy of ``loader`` (the user's is left as it is) that resumes in its own order after the batches trained on,
    its position kept by ``streams``; and what it gives up, for the start line (``None``: nothing). ``own``: the
    class name of its own sampler or batch sampler."""
    position = OwnOrder(f"train loader {len(streams.positions)} ({own})", lambda: trainer.current_epoch,
                        strict=streams.mode != "as_saved")  # fmt: skip
    streams.attach(position, trainer)
    note = None
    if loader.num_workers:
        note = (
            f"random draws in its {loader.num_workers} workers (augmentation) start again from the workers' seeds on a "
            f"resume: seeding each sample (run.seed_per_sample) needs the engine's sampler, not {own}"
        )
    rebuilt = unstarted_copy(loader)
    rebuilt.__class__ = in_front_of(type(loader), ReplaysOwnOrder, position=position)
    return rebuilt, note
