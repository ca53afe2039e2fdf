"""Train loaders that keep their own position (torchdata's ``StatefulDataLoader`` over a stream, LitData's
``StreamingDataLoader``, any loader with ``state_dict``/``load_state_dict`` the engine does not rebuild) resume on
each rank after the last batch that rank trained on.

Lightning saves such a loader's ``state_dict()`` as a checkpoint is written, rank 0's only, and loads it into every
rank's loader on a resume. Two things go wrong: its fetcher has already taken the next batch from a loader without a
length (``_PrefetchDataFetcher`` runs a batch ahead), so the position saved is a batch past the last one trained on
and a resume skips that batch; and under DDP every rank resumes at rank 0's position. Here the loader's state is read
after each batch it yields (a deep copy: a few small dicts); a save keeps, per rank, the state as of the last batch
trained on and a fingerprint of the batch fetched next (``StreamResume`` gathers them into the checkpoint); a resume
loads each rank's own state into its loader as its iterator starts (Lightning's call, which would load rank 0's,
is passed by), and compares its first batch with the fingerprint. What another first batch or another number of
ranks does: docs/engine.md, 'Data pipelines and what a resume gives each'.
"""

import copy
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import lightning as L
from lightning.fabric.utilities.data import has_len
from torch.utils.data import DataLoader

from lightkeep.compat_loops import batches_fetched_ahead
from lightkeep.compat_torch import unstarted_copy
from lightkeep.loaders import in_front_of, seed_the_workers
from lightkeep.stream_positions import Position, fingerprint, loading_its_state
from lightkeep.stream_resume import StreamResume

KEEP = 4  # the states of the last few batches yielded: Lightning's fetcher holds at most one ahead


class OwnPosition:
    """One such loader's position on this rank: the states after its last few batches, what a resume loads."""

    checked = "its first batch"  # what a resume compares (``next_batch``'s verdict)
    can_restart = False

    def __init__(
        self, name: str, workers: int, fetched_ahead: Callable[[], int], epoch_of: Callable[[], int], strict: bool
    ) -> None:
        self.name, self.workers, self.fetched_ahead, self.epoch_of = name, workers, fetched_ahead, epoch_of
        self.strict = strict  # another first batch than the checkpoint's next stops the run (unless as_saved)
        self.recent: deque[tuple[Any, int | None]] = deque(maxlen=KEEP)  # (state after a batch, its fingerprint)
        self.restore: dict[str, Any] | None = None  # this rank's position in the checkpoint, until loaded
        self.resumed: dict[str, Any] | None = None  # the position this run resumed at
        self.first: int | None = None  # the fingerprint of the first batch after the resume
        self.problem: str | None = None  # StreamResume stops the run on it, before the first step

    @property
    def taken(self) -> dict[str, Any] | None:
        """What a save keeps: the loader's state as of the last batch trained on, the batch fetched next."""
        if not self.recent:
            return None  # not iterated yet: Lightning's own state_dict of the loader holds its start
        entries, ahead = list(self.recent), self.fetched_ahead()
        state, _ = entries[max(len(entries) - 1 - ahead, 0)]
        following = entries[len(entries) - ahead][1] if 0 < ahead < len(entries) else None
        return {"state": state, "next": following}

    def take(self, count: int) -> None:
        """``StreamResume``'s per-batch call: the fetcher's lookahead, read at the save, says what was taken."""

    def compare(self, restore: dict[str, Any]) -> None:
        """A first batch after the resume other than the one the checkpoint's run fetched next is a problem."""
        if self.strict and restore["next"] is not None and self.first != restore["next"]:
            self.problem = (
                f"{self.name}: its first batch after the resume differs from the batch the checkpoint's run had "
                "fetched next: its state_dict does not bring back what it gave (a shuffle buffer, random draws in "
                "its workers). Nothing was trained. Resume with --run.stream_resume as_saved to continue from its "
                "own state anyway (not exactly: the start line says so)"
            )

    def verified(self, ranks: str) -> str:
        return (f"{self.name}: its first batch{ranks} is the one the checkpoint's run had fetched next, resumed at "
                "each rank's own state as of the batches trained on")  # fmt: skip

    differs = Position.differs

    def unsaved(self) -> str:
        return (f"{self.name}: the checkpoint holds no position of each rank (plain Lightning wrote it): Lightning "
                "loads rank 0's into every rank, a batch past the last trained on")  # fmt: skip

    def describe(self, ranks: int) -> str:
        """What a resume of it does (or did), for the start line."""
        whose = "each rank's own state_dict" if ranks > 1 else "its own state_dict"
        if self.resumed is not None:
            return f"{self.name}: resumed at {whose} as of the batches trained on"
        return f"{self.name}: a resume loads {whose} as of the batches trained on (not a batch ahead)"


class KeepsOwnPosition(DataLoader):
    """In front of the user's loader class (a ``DataLoader`` subclass, for the instance's layout): records the state
    after each batch, loads this rank's on a resume. ``position`` is a class attribute: Lightning re-creates a loader
    (to put in its ``DistributedSampler``) from its class."""

    position: OwnPosition
    own_generator = False  # the user gave no generator: one is seeded per epoch here

    def __iter__(self) -> Iterator[Any]:
        position = self.position
        seed_the_workers(self, position.epoch_of())
        restore, position.restore = position.restore, None
        if restore is not None:
            position.resumed = restore
            super().load_state_dict(copy.deepcopy(restore["state"]))  # type: ignore[misc]
        batches = super().__iter__()  # type: ignore[misc]
        if restore is not None:
            batches = loading_its_state(batches, position.name, position.workers)
        position.recent.clear()
        position.recent.append((copy.deepcopy(super().state_dict()), None))  # type: ignore[misc]  # its start
        for batch in batches:
            if restore is not None and position.first is None:
                position.first = fingerprint(batch)
                position.compare(restore)
            position.recent.append((copy.deepcopy(super().state_dict()), fingerprint(batch)))  # type: ignore[misc]
            yield batch

    def state_dict(self) -> dict[str, Any]:
        taken = self.position.taken
        return taken["state"] if taken is not None else super().state_dict()  # type: ignore[misc]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.position.restore is None and self.position.resumed is None:
            super().load_state_dict(state)  # type: ignore[misc]  # a checkpoint without this rank's: Lightning's
        # else this rank's own position, loaded as the iterator starts, stands for rank 0's that Lightning saved


def keep_own(loader: Any, trainer: L.Trainer, streams: StreamResume) -> tuple[Any, str | None]:
    """A copy of ``loader`` (the user's is left as it is) resuming each rank at its own position as of the batches
    trained on, its position kept by ``streams``; and what it gives up, for the start line (``None``: nothing)."""
    workers = getattr(loader, "num_workers", 0)
    position = OwnPosition(f"train loader {len(streams.positions)} ({type(loader).__name__})", workers,
                           lambda: batches_fetched_ahead(trainer), lambda: trainer.current_epoch,
                           strict=streams.mode != "as_saved")  # fmt: skip
    streams.attach(position, trainer)
    notes, sized = [], has_len(loader)
    if sized:  # the check needs the batch Lightning fetched ahead, which it does only of a loader without a length
        notes.append(
            f"{type(loader).__name__} has a length, so Lightning fetches no batch of it ahead of training: a resume "
            "at each rank's own position cannot check its first batch against the checkpoint's"
        )
    if workers:
        checked = "" if sized else " (each resume checks its first batch)"
        notes.append(
            f"random draws in its {workers} workers (augmentation) start again from the workers' seeds on a resume: "
            f"{type(loader).__name__}'s state_dict keeps no generator state{checked}"
        )
    note = "; ".join(notes) or None
    rebuilt = unstarted_copy(loader)
    rebuilt.__class__ = in_front_of(type(loader), KeepsOwnPosition, position=position)
    return rebuilt, note
