"""A train stream's position on one rank, per loader worker: what each batch carries from the worker that made it,
what training took of them, and the order a resumed loader hands them out in (``StreamResume`` keeps the positions
in the checkpoint, ``StreamLoader`` resumes at them: ``lightkeep.stream_resume``).

The loader's ``collate_fn`` is wrapped (``Tagging``) so that each batch comes with the worker that made it, its number
of samples, a fingerprint and the dataset's state, read in the worker (each worker's copy holds the position; the
main process's copy never moves); the loader hands on the batch alone. A ``DataLoader`` takes batches from its
workers in turn (0, 1, ..., a worker whose stream ended left out): a resumed one starts again at worker 0, so
``Position.hand_out`` holds its batches back (one round at most) and hands them out in the uninterrupted run's turn,
from the worker after the one that made the last batch trained on. ``fingerprint`` and ``loading_its_state`` serve
the loaders that keep their own position or order too (``own_positions``, ``own_orders``).
"""

import copy
import zlib
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import numpy as np
import torch
from torch.utils.data import get_worker_info

from lightkeep.compat_torch import tree_leaves


def fingerprint(batch: Any) -> int:
    """A CRC-32 of a batch's structure and of up to 256 values of each tensor or array, spread over it: a few
    microseconds whatever the batch's size, and another value for other samples."""
    crc = 0
    for leaf in tree_leaves(batch):
        if isinstance(leaf, torch.Tensor | np.ndarray):
            flat = leaf.reshape(-1)
            part = flat[:: max(1, len(flat) // 256)][:256]
            raw = part.contiguous().view(torch.uint8).numpy() if isinstance(part, torch.Tensor) else part.copy()
            crc = zlib.crc32(raw.tobytes(), zlib.crc32(f"{tuple(leaf.shape)}{leaf.dtype}".encode(), crc))
        else:
            known = isinstance(leaf, int | float | str | bytes | bool) or leaf is None
            crc = zlib.crc32(repr(leaf if known else type(leaf).__name__).encode(), crc)
    return crc


class Made(NamedTuple):
    """A batch as the wrapped ``collate_fn`` returns it (a named tuple, which pin_memory pins field by field).
    ``batch`` is ``None`` for a batch dropped by a fast-forward."""

    batch: Any
    worker: int
    samples: int
    fingerprint: int | None
    state: Any


class Tagging:
    """The loader's ``collate_fn`` with its batch's worker, sample count, fingerprint and the dataset's state (as of
    this batch: the worker's copy, read in the worker). ``skip``: per worker, how many batches a fast-forward drops
    (the last one collated, for its fingerprint); each worker process counts down its own copy."""

    def __init__(self, collate: Callable[[Any], Any], stateful: bool, batched: bool, here: Any) -> None:
        self.collate, self.stateful, self.batched = collate, stateful, batched
        self.here = here  # the dataset when batches are made in this process (num_workers=0), else None
        self.skip: dict[int, int] = {}

    def __call__(self, samples: Any) -> Made:
        info = get_worker_info()
        worker, dataset = (info.id, info.dataset) if info is not None else (0, self.here)
        count = len(samples) if self.batched else 1
        left = self.skip.get(worker, 0)
        if left:
            self.skip[worker] = left - 1
            return Made(None, worker, count, fingerprint(self.collate(samples)) if left == 1 else None, None)
        batch = self.collate(samples)
        state = copy.deepcopy(dataset.state_dict()) if self.stateful else None
        return Made(batch, worker, count, fingerprint(batch), state)


def loading_its_state(batches: Iterator[Any], name: str, workers: int) -> Iterator[Any]:
    """``batches`` of a loader resumed at its own state: an error at its first batches (each worker's first: a
    stream may load the state as it starts, in its worker, as Hugging Face's does) stops the run in one line."""
    for _ in range(max(workers, 1) + 1):
        try:
            batch = next(batches)
        except StopIteration:
            return
        except Exception as error:  # a worker's error comes back as its type, its traceback in the message
            lines = [x.strip() for x in str(error).splitlines() if x.strip()] or [type(error).__name__]
            said = lines[0] if len(lines) == 1 else f"{lines[0]} {lines[-1]}"
            raise ValueError(
                f"{name}: it failed at its first batches after loading the state the checkpoint kept of it ({said}). "
                "Nothing was trained: this checkpoint cannot resume it mid-epoch (one saved at an epoch's end can)"
            ) from error
        yield batch
    yield from batches


def _fresh(epoch: int, workers: int) -> dict[str, Any]:
    """The position at an epoch's start: per worker, the batches and samples trained on, the fingerprint of its
    last one, its dataset's state after it; ``next``: the worker whose batch the loop takes next; ``ahead``: the
    fingerprint of the batch handed out next (``None``: none handed out yet; absent from a position an engine before
    1.5.0 recorded, which kept none)."""
    n = max(workers, 1)
    return {"epoch": epoch, "batches": [0] * n, "samples": [0] * n, "fingerprints": [None] * n,
            "states": [None] * n, "next": 0, "ahead": None}  # fmt: skip


class Position:
    """One train stream's position on this rank: what its loader handed out, and what training took of it."""

    checked = "its first batch"  # what a resume compares (``next_batch``'s verdict)

    def __init__(
        self, name: str, workers: int, stateful: bool, ordered: bool, epoch_of: Callable[[], int], strict: bool = True
    ) -> None:
        self.name, self.workers, self.stateful, self.ordered, self.epoch_of = name, workers, stateful, ordered, epoch_of
        self.strict = strict  # another first batch than the checkpoint's next stops the run (unless as_saved)
        self.can_restart = not stateful  # run.stream_resume restart is a way out of a refusal (it keeps a state)
        self.taken = _fresh(epoch_of(), workers)  # what training took of the current epoch
        self.handed: deque[Made] = deque()  # handed out to Lightning, not yet taken (its fetcher runs ahead)
        self.restore: dict[str, Any] | None = None  # the checkpoint's position, for the epoch it was taken in
        self.resumed: dict[str, Any] | None = None  # the position this run resumed at
        self.first: int | None = None  # the fingerprint of the first batch handed out after the resume
        self.problem: str | None = None  # StreamResume stops the run on it, before the first step

    def unsaved(self) -> str:
        return f"{self.name}: the checkpoint holds no position of it: a mid-epoch resume restarts that epoch's data"

    def take(self, count: int) -> None:
        """Training has taken ``count`` batches of the current epoch."""
        taken = self.taken
        while sum(taken["batches"]) < count and self.handed:
            made = self.handed.popleft()
            w = made.worker
            taken["batches"][w] += 1
            taken["samples"][w] += made.samples
            taken["fingerprints"][w], taken["states"][w] = made.fingerprint, made.state
            taken["next"] = (w + 1) % len(taken["batches"])
        taken["ahead"] = self.handed[0].fingerprint if self.handed else None  # what Lightning fetched ahead

    def start_epoch(self) -> dict[str, Any] | None:
        """A new iterator: the position it resumes at (``None``: the epoch's start)."""
        epoch = self.epoch_of()
        restore, self.restore = self.restore, None
        if restore is not None and restore["epoch"] != epoch:
            restore = None  # the checkpoint was taken in an earlier epoch, which ended since
        if restore is not None and len(restore["batches"]) != max(self.workers, 1):
            raise ValueError(
                f"{self.name}: the checkpoint was taken with {len(restore['batches'])} loader worker(s) reading its "
                f"stream, this run has num_workers={self.workers}: each worker reads its own shard, so resume with "
                f"the same num_workers" + (", or with --run.stream_resume restart" if self.can_restart else "")
            )
        self.taken = copy.deepcopy(restore) if restore is not None else _fresh(epoch, self.workers)
        self.handed.clear()
        self.resumed = restore
        if restore is not None:
            self.first = None
        return restore

    def hand_out(self, made: Iterator[Made], restore: dict[str, Any] | None) -> Iterator[Any]:
        """The batches of ``made`` (in the order the workers' turns give them) in the uninterrupted run's order."""
        n = max(self.workers, 1)
        skips = list(restore["batches"]) if restore is not None and not self.stateful else [0] * n
        if not self.ordered or n == 1:
            for item in made:
                if self._kept(item, skips, restore):
                    yield self._handed(item, restore)
            self._check_skipped(skips)
            return
        queues: list[deque[Made]] = [deque() for _ in range(n)]
        received, ended = [0] * n, [False] * n  # a worker's batches so far; whether its stream ended
        w = restore["next"] if restore is not None else 0
        while not all(ended) or any(queues):
            while not queues[w] and not ended[w]:
                item = next(made, None)
                if item is None:
                    ended = [True] * n
                    break
                key = (received[item.worker], item.worker)  # the workers' turns give batches in this order
                ended = [e or (received[v], v) < key for v, e in enumerate(ended)]  # passed over: its stream ended
                received[item.worker] += 1
                if self._kept(item, skips, restore):
                    queues[item.worker].append(item)
            if queues[w]:
                # recorded as handed out in the order training gets it, which is not the order of arrival
                yield self._handed(queues[w].popleft(), restore)
            w = (w + 1) % n
        self._check_skipped(skips)

    def _handed(self, item: Made, restore: dict[str, Any] | None) -> Any:
        """``item``'s batch, recorded as handed out; the first after a resume compared with the checkpoint's next."""
        self.handed.append(item)
        if restore is not None and self.first is None:
            self.first = item.fingerprint
            expected = restore.get("ahead")  # absent from a checkpoint of engine 1.4.0 or earlier
            if self.strict and expected is not None and self.first != expected and self.problem is None:
                gave = (
                    "its state_dict does not bring back what it gave (a shuffle buffer, random draws in its workers)"
                    if self.stateful
                    else "random draws in its workers start again from other seeds"
                )
                self.problem = (
                    f"{self.name}: its first batch after the resume differs from the batch the checkpoint's run had "
                    f"fetched next: {gave}. Nothing was trained. Resume with --run.stream_resume as_saved to "
                    "continue anyway (not exactly: the start line says so)"
                )  # fmt: skip
        return item.batch

    def verified(self, ranks: str) -> str:
        if not self.stateful:
            return (f"{self.name}: read again past the {sum(self.resumed['samples'])} samples trained on, the "
                    "stream gave the batch the checkpoint recorded last")  # fmt: skip
        return (f"{self.name}: its first batch{ranks} is the one the checkpoint's run had fetched next, resumed at "
                "its own state as of the batches trained on")  # fmt: skip

    def differs(self, rank: str) -> str:
        return (f"{self.name}: its first batch after the resume{rank} differs from the batch the checkpoint's run had "
                "fetched next (random draws in its workers, or a position its state_dict does not keep)")  # fmt: skip

    def _kept(self, item: Made, skips: list[int], restore: dict[str, Any] | None) -> bool:
        """Whether ``item`` goes to training (a fast-forward drops the batches trained on)."""
        if item.batch is None:
            skips[item.worker] -= 1
            last = item.fingerprint is not None and restore is not None  # the last batch it drops
            if last and self.problem is None and item.fingerprint != restore["fingerprints"][item.worker]:
                self.problem = (
                    f"{self.name}: after the fast-forward past the {sum(restore['samples'])} samples trained on "
                    f"(worker {item.worker}'s batch {restore['batches'][item.worker]}), the stream gave other "
                    "samples than the checkpoint recorded: its order is not the same for the same seed and "
                    "epoch. Resume with --run.stream_resume restart (the epoch's data starts again), or make "
                    "its order depend on the seed and epoch only (set_epoch, get_worker_info, the rank)"
                )
            return False
        return True

    def _check_skipped(self, skips: list[int]) -> None:
        short = [w for w, left in enumerate(skips) if left > 0]
        if short and self.problem is None:
            self.problem = (
                f"{self.name}: its stream ended before the fast-forward reached the samples trained on (worker "
                f"{short[0]} is {skips[short[0]]} batch(es) short): resume with --run.stream_resume restart"
            )
