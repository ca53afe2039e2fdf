"""Train streams resume where they stopped: a plain ``DataLoader`` over an ``IterableDataset`` continues a mid-epoch
resume at the first sample not trained on, on every rank and in every loader worker (what each kind of stream gets,
and what the start line says: docs/engine.md, 'Data pipelines and what a resume gives each').

- A dataset with ``state_dict``/``load_state_dict`` (its own position): each worker's copy holds the position, read
  in its worker after each batch it makes. The checkpoint keeps, per rank and worker, the state after the last batch
  trained on (Lightning's fetcher runs a batch ahead of training), loaded into that worker's copy before it starts.
- A dataset without state whose order is the same for the same seed and epoch (``run.stream_resume: fast_forward``,
  the default): each worker reads again the batches of its own that were trained on and drops them uncollated; the
  last one it drops is collated and compared with the fingerprint the checkpoint kept of it.

Either way a resume compares its first batch with the fingerprint a save kept of the batch handed out next (the one
Lightning's fetcher took ahead of training). How each batch says which worker made it, and the order a resumed loader
hands batches out in: ``lightkeep.stream_positions``. An ``IterableDataset`` with ``set_epoch`` (Hugging Face's,
LitData's) is given the epoch before each epoch's iterator, as Lightning gives it to samplers; with
``persistent_workers`` the workers keep the copy of the epoch they started in (torch's behaviour), so a resume in a
later epoch gives other samples, and stops there.
"""

import copy
import functools
from collections.abc import Callable, Iterator
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader, get_worker_info

from lightkeep.compat_torch import unstarted_copy
from lightkeep.distributed import every_rank
from lightkeep.loaders import in_front_of
from lightkeep.stream_positions import Position, Tagging, loading_its_state

MODES = ("fast_forward", "restart", "as_saved")  # as_saved: another first batch continues (not exact)


def saves_its_state(loader: Any) -> bool:
    """Whether Lightning saves ``loader``'s position (or a dataset's) in checkpoints and restores it: it has
    ``state_dict`` and ``load_state_dict`` (Lightning's own test)."""
    return hasattr(loader, "state_dict") and hasattr(loader, "load_state_dict")


def _load_state_in_worker(states: list[Any], user_init: Callable[[int], Any] | None, worker_id: int) -> None:
    """A worker's ``worker_init_fn`` on a resume: the user's own first (it may set up the worker's shard), then
    the state this worker's copy had after its last batch trained on."""
    if user_init is not None:
        user_init(worker_id)
    info = get_worker_info()
    if info is not None and states[info.id] is not None:
        info.dataset.load_state_dict(states[info.id])


class StreamLoader(DataLoader):
    """A copy of the user's loader whose batches say which worker made them (``Tagging``); it hands out the
    batches alone, in the uninterrupted run's order, and resumes at its ``Position``."""

    position: Position

    def __iter__(self) -> Iterator[Any]:
        position, tagging, dataset = self.position, self.collate_fn, self.dataset
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
        stateful = saves_its_state(dataset)
        if not stateful and self.mode == "restart":
            return loader, "run.stream_resume is restart: a mid-epoch resume restarts that epoch's data"
        ordered = getattr(loader, "in_order", True)  # in_order=False: batches as the workers finish them
        position = Position(name, loader.num_workers, stateful, ordered, lambda: trainer.current_epoch,
                            strict=self.mode != "as_saved")  # fmt: skip
        self.attach(position, trainer)
        rebuilt = unstarted_copy(loader)  # the user's loader is left as it is
        rebuilt.__class__ = in_front_of(type(loader), StreamLoader)
        here = dataset if loader.num_workers == 0 else None
        rebuilt.collate_fn = Tagging(loader.collate_fn, stateful, loader.batch_sampler is not None, here)
        rebuilt.position = position
        return rebuilt, None

    def attach(self, position: Any, trainer: L.Trainer) -> None:
        """``position`` (of any kind ``positions`` holds) is the next train loader's: given this rank's position in
        the checkpoint, if any."""
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
            if not isinstance(p, Position):
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
        return {"ranks": every_rank([p.taken for p in self.positions])}  # every rank's own, rank 0 writes them all

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.saved = state_dict.get("ranks")
