"""Train streams resume where they stopped: a plain ``DataLoader`` over an ``IterableDataset`` continues a mid-epoch
resume at the first sample not trained on, on every rank and in every loader worker, each step on the batch the
uninterrupted run trained there.

- A dataset with ``state_dict``/``load_state_dict`` (its own position): with workers, each worker's copy holds the
  position (the main process's copy never moves), so each copy is read in its worker after each batch it makes. The
  checkpoint keeps, per rank and worker, the state after the last batch trained on (Lightning's fetcher runs a
  batch ahead of training), and a resume loads it into that worker's copy before the worker starts. Exact where
  the state brings back what the stream gave: a state that leaves something out (a Hugging Face shuffle buffer)
  gives another first batch, which stops the run (below).
- A dataset without state whose order is the same for the same seed and epoch (sharded by worker and rank):
  fast-forwarded by count (``run.stream_resume: fast_forward``, the default). Each worker reads again the batches
  of its own that were trained on and drops them uncollated; the last one it drops is collated and compared with
  the fingerprint the checkpoint kept of it, and a stream that gives other samples stops the run in one line before
  the first step. ``restart``: the epoch's data starts again, as the start line says.

Either way a save also keeps a fingerprint of the batch handed out next (the one Lightning's fetcher took ahead of
training), and a resume compares its first batch with it: another batch stops the run in one line before training
on it, unless ``run.stream_resume`` is ``as_saved`` (``next_batch``'s verdict then says ``no``).

How: the loader's ``collate_fn`` is wrapped so that each batch comes with the worker that made it, its number of
samples, a fingerprint and the dataset's state; the loader hands on the batch alone. A ``DataLoader`` takes batches
from its workers in turn (0, 1, ..., a worker whose stream ended left out): a resumed one starts again at worker 0,
so its batches are held back (one round at most) and handed out in the uninterrupted run's turn, from the worker
after the one that made the last batch trained on. An ``IterableDataset`` with ``set_epoch`` (Hugging Face's,
LitData's) is given the epoch before each epoch's iterator, as Lightning gives it to samplers; with
``persistent_workers`` the workers keep the copy of the epoch they started in (torch's behaviour), so a resume in
a later epoch gives other samples and stops in that one line.
A checkpoint resumes on the numbers of ranks and workers that wrote it; on others the run stops in one line.
"""

import copy
import functools
import zlib
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import lightning as L
import numpy as np
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader, get_worker_info

from steadfast.compat_torch import tree_leaves, unstarted_copy

MODES = ("fast_forward", "restart", "as_saved")  # as_saved: another first batch continues (not exact)


def has_state(dataset: Any) -> bool:
    return hasattr(dataset, "state_dict") and hasattr(dataset, "load_state_dict")


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


def _load_state_in_worker(states: list[Any], user_init: Callable[[int], Any] | None, worker_id: int) -> None:
    """A worker's ``worker_init_fn`` on a resume: the user's own first (it may set up the worker's shard), then
    the state this worker's copy had after its last batch trained on."""
    if user_init is not None:
        user_init(worker_id)
    info = get_worker_info()
    if info is not None and states[info.id] is not None:
        info.dataset.load_state_dict(states[info.id])


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
    fingerprint of the batch handed out next (``None``: none handed out yet)."""
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


class StreamLoader(DataLoader):
    """A copy of the user's loader whose batches say which worker made them (``Tagging``); it hands out the
    batches alone, in the uninterrupted run's order, and resumes at its ``Position``."""

    position: Position

    def __iter__(self) -> Iterator[Any]:
        position, tagging = self.position, self.collate_fn
        dataset = self.dataset
        if hasattr(dataset, "set_epoch"):
            dataset.set_epoch(position.epoch_of())
        restore = position.start_epoch()
        user_init = self.worker_init_fn
        if restore is not None and position.stateful and self.num_workers == 0:
            dataset.load_state_dict(copy.deepcopy(restore["states"][0]))  # type: ignore[attr-defined]
        elif restore is not None and position.stateful:
            self.worker_init_fn = functools.partial(_load_state_in_worker, restore["states"], user_init)
        elif restore is not None:
            tagging.skip = dict(enumerate(restore["batches"]))
        try:
            made = super().__iter__()  # the workers start here, each with its copy of tagging.skip
        finally:
            self.worker_init_fn = user_init
            if self.num_workers:
                tagging.skip = {}
        if restore is not None and position.stateful:
            made = loading_its_state(made, position.name, self.num_workers)
        yield from position.hand_out(made, restore)


class StreamResume(Callback):
    """Keeps the position of each train ``IterableDataset`` loader (``resumable``), per rank and worker, in the
    checkpoint, and resumes each rank's loaders there.

    Args:
        mode: ``run.stream_resume``: ``fast_forward`` or ``restart``, for a dataset without state; ``as_saved``:
            as ``fast_forward``, and a first batch after a resume other than the checkpoint's next continues.
    """

    def __init__(self, mode: str = "fast_forward") -> None:
        if mode not in MODES:
            raise ValueError(f"run.stream_resume ({mode!r}) must be one of {', '.join(MODES)}")
        self.mode = mode
        self.positions: list[Any] = []  # Position, own_positions.OwnPosition or own_orders.OwnOrder
        self.saved: list[list[dict[str, Any]]] | None = None  # every rank's positions, from the checkpoint
        self._checked = False

    def rebuilding(self) -> None:
        """The train loaders are being built (again): positions are handed out from the first."""
        self.positions = []

    def resumable(self, loader: DataLoader, trainer: L.Trainer) -> tuple[Any, str | None]:
        """``loader`` (over an ``IterableDataset``) as a ``StreamLoader``, or as it is where the user chose
        ``restart``; and what it gives up, for the start line (``None``: nothing)."""
        index, dataset = len(self.positions), loader.dataset
        name = f"train loader {index} ({type(dataset).__name__})"
        stateful = has_state(dataset)
        if not stateful and self.mode == "restart":
            return loader, "run.stream_resume is restart: a mid-epoch resume restarts that epoch's data"
        ordered = getattr(loader, "in_order", True)  # in_order=False: batches as the workers finish them
        position = Position(name, loader.num_workers, stateful, ordered, lambda: trainer.current_epoch,
                            strict=self.mode != "as_saved")  # fmt: skip
        self.attach(position, trainer)
        rebuilt = unstarted_copy(loader)  # the user's loader is left as it is
        rebuilt.__class__ = _stream_class(type(loader))
        here = dataset if loader.num_workers == 0 else None
        rebuilt.collate_fn = Tagging(loader.collate_fn, stateful, loader.batch_sampler is not None, here)
        rebuilt.position = position
        return rebuilt, None

    def attach(self, position: Any, trainer: L.Trainer) -> None:
        """``position`` (a ``Position``, ``own_positions.OwnPosition`` or ``own_orders.OwnOrder``) is the next train
        loader's: given this rank's position in the checkpoint, if any."""
        if self.saved is not None:
            if len(self.saved) != trainer.world_size:
                raise ValueError(
                    f"{position.name}: the checkpoint holds the loader positions of {len(self.saved)} rank(s), this "
                    f"run has {trainer.world_size}: each rank reads its own share of the data from its own position, "
                    f"so resume on {len(self.saved)} rank(s)"
                    + (", or with --run.stream_resume restart" if position.can_restart else "")
                )
            mine = self.saved[trainer.global_rank]
            index = len(self.positions)
            position.restore = mine[index] if index < len(mine) else None
        self.positions.append(position)

    def notes(self, trainer: L.Trainer) -> list[str]:
        """What the streams give up, for the start line's opts out: a resume from a checkpoint without their
        positions (written by plain Lightning, an earlier version, or under ``restart``)."""
        if trainer.ckpt_path is None or self.saved is not None or not self.positions:
            return []
        return [p.unsaved() for p in self.positions]

    def describe(self) -> list[str]:
        """What a resume of each stream does (or did), for the start line."""
        out = []
        for i, p in enumerate(self.positions):
            if not isinstance(p, Position):  # steadfast.own_positions, steadfast.own_orders
                out.append(p.describe(len(self.saved) if self.saved else 1))
                continue
            resumed, ranks = p.resumed, self.saved or []
            samples = sum(sum(rank[i]["samples"]) for rank in ranks if i < len(rank) and rank[i])  # all ranks
            over = f" over {len(ranks)} ranks" if len(ranks) > 1 else ""
            at = f"{samples} samples of epoch {resumed['epoch']}{over}" if resumed is not None else ""
            if p.stateful:
                whose = f"its {p.workers} workers' states" if p.workers else "its state"
                done = f"resumed at {whose} after the {at} trained on" if resumed else f"a resume loads {whose}"
                out.append(f"{p.name}: {done} (its own state_dict)")
            elif resumed is not None:
                out.append(
                    f"{p.name}: fast-forwarded past the {at} trained on (read again, not trained on; "
                    "checked against the checkpoint's fingerprint before the first step)"
                )
            else:
                out.append(f"{p.name}, no state_dict: a mid-epoch resume fast-forwards it, reading again the samples "
                           "trained on")  # fmt: skip
        return out

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, idx: int) -> None:
        for position in self.positions:
            position.take(idx + 1)  # the batch in hand is trained on: a save from here on includes it
        if self._checked or not any(p.resumed is not None for p in self.positions):
            return
        self._checked = True  # once, at the first step after a resume: a collective under DDP
        problem = next((p.problem for p in self.positions if p.problem is not None), None)
        anywhere = problem is not None
        if trainer.world_size > 1:
            anywhere = trainer.strategy.reduce_boolean_decision(anywhere, all=False)
        if anywhere:
            raise ValueError(problem or "another rank's train loader gave other samples after the resume than the "
                             "checkpoint recorded (that rank's log names it, and the setting for it)")  # fmt: skip

    def state_dict(self) -> dict[str, Any]:
        if not self.positions:
            return {}
        mine = [p.taken for p in self.positions]
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            ranks: list[Any] = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(ranks, mine)  # every rank saves its own, rank 0 writes them all
        else:
            ranks = [mine]
        return {"ranks": ranks}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.saved = state_dict.get("ranks")


_CLASSES: dict[type, type] = {}


def _stream_class(cls: type) -> type:
    """``cls`` (``DataLoader`` or the user's subclass of it) with ``StreamLoader``'s ``__iter__`` in front."""
    if issubclass(cls, StreamLoader):
        return cls
    if cls is DataLoader:
        return StreamLoader
    if cls not in _CLASSES:
        _CLASSES[cls] = type(cls.__name__, (StreamLoader, cls), {"__module__": cls.__module__})
    return _CLASSES[cls]
