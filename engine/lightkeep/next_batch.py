"""The one-line verdict of a resume that compares its first batch with the batch the checkpoint's run would have
trained next (``lightkeep.batch_fingerprint``): ``resume verified``, or the first difference, or why there is
nothing to compare. The resumed loader hashes the first batch it yields (``ResumableDataLoader``); a stream or a
loader that keeps its own position is checked by its own record (``lightkeep.stream_positions``,
``lightkeep.own_positions``, ``lightkeep.own_orders``).
"""

from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities import CombinedLoader
from torch.utils.data import DataLoader, IterableDataset

from lightkeep import batch_fingerprint as fp
from lightkeep.compat_loops import train_loaders_cycle
from lightkeep.distributed import every_rank
from lightkeep.loaders import ResumableDataLoader, ResumableSampler
from lightkeep.own_orders import OwnOrder
from lightkeep.own_positions import OwnPosition
from lightkeep.stream_positions import Position
from lightkeep.stream_resume import saves_its_state
from lightkeep.user_loaders import own_order


def record(trainer: L.Trainer) -> list[Any]:
    """Per train loader: every rank's record of its next batch (``torch.Tensor`` each), or why there is none (a
    ``str``). Call it on every rank (the records are gathered)."""
    out: list[Any] = []
    for i, loader in enumerate(_train_loaders(trainer)):
        why = _why_unverifiable(loader, i)
        if why is not None:
            out.append(why)
            continue
        state = loader.state_dict()
        epoch, batches = state["epoch"], state["batches"]
        n = fp.batch_size(loader)
        if batches >= min(len(loader), trainer.num_training_batches):  # it ran out: its next batch is a first one
            # of the next epoch, or, a shorter one of cycled loaders while the epoch goes on, of this one again
            epoch, batches = epoch + (not _cycled_in_this_epoch(trainer, loader)), 0
        cached = loader.next_batch
        if cached is None or cached[0] != (epoch, batches):
            keys = fp.keys(loader.sampler, epoch, batches * n, n)
            cached = ((epoch, batches), fp.fingerprint(loader, epoch, batches, keys, fp.replay(loader, keys)))
            loader.next_batch = cached  # several files of one step: one replay
        out.append(every_rank(cached[1]))  # of a length per rank; once per save or resume, not per step
    return out


def watch(trainer: L.Trainer) -> None:
    """Has each of the engine's train loaders record the next batch it yields: a resumed run's first."""
    for loader in _train_loaders(trainer):
        if isinstance(loader, ResumableDataLoader):
            loader.watch_first_batch = observe  # called with the batch: loaders.py does not import this module


def observe(loader: ResumableDataLoader, batch: Any) -> torch.Tensor | None:
    """The record of ``batch``, the first ``loader`` yields once watched (``None``: a sampler the engine cannot
    read)."""
    if not isinstance(loader.sampler, ResumableSampler):
        return None
    state, n = loader.state_dict(), fp.batch_size(loader)  # the batches yielded before this one
    epoch, batches = state["epoch"], state["batches"]
    return fp.fingerprint(loader, epoch, batches, fp.keys(loader.sampler, epoch, batches * n, n), batch)


def verdict(trainer: L.Trainer, saved: list[Any] | None, resumed_from_lightning: bool) -> tuple[str, str]:
    """``("verified" | "differs" | "unverified", the start line's words)`` for the resumed run's first batch against
    the checkpoint's records (``saved``). Call it on every rank at the first training batch (the records are
    gathered)."""
    if saved is None:
        who = "plain Lightning wrote it" if resumed_from_lightning else "written before the engine recorded one"
        return "unverified", f"not verified: the checkpoint holds no fingerprint of its next batch ({who})"
    loaders = _train_loaders(trainer)
    if len(loaders) != len(saved):
        return "unverified", f"not verified: {len(loaders)} train loader(s), the checkpoint's run had {len(saved)}"
    said = []
    for i, (loader, then) in enumerate(zip(loaders, saved, strict=True)):
        own = _own_position_checked(trainer, loader)
        if own is not None:
            if own[0] != "verified":
                return own
            said.append(own[1])
            continue
        mine = loader.first_batch if isinstance(loader, ResumableDataLoader) else None
        if isinstance(then, str) or mine is None:
            why = then if isinstance(then, str) else _why_unverifiable(loader, i) or f"train loader {i} was not resumed"
            return "unverified", f"not verified: {why}"
        kind, words = _compare(fp.unpack(then), fp.unpack(every_rank(mine)))
        if kind != "verified":
            return kind, (f"train loader {i}: " if len(loaders) > 1 else "") + words
        said.append(words)
    return "verified", "; ".join(said)


def _compare(then: list[dict], now: list[dict]) -> tuple[str, str]:
    a, b = then[0], now[0]
    if a["size"] != b["size"]:
        return "differs", (
            f"no: the training set has {b['size']} samples, the checkpoint's run had {a['size']}: the data changed"
        )
    if (a["epoch"], a["place"]) != (b["epoch"], b["place"]):
        return "differs", (
            f"no, data order: the resume starts at epoch {b['epoch']}, place {b['place']} in its order; the "
            f"checkpoint's next batch is at epoch {a['epoch']}, place {a['place']}"
        )
    old, new = fp.in_order(then), fp.in_order(now)
    shared = min(len(old), len(new))
    epoch, place, ranks = b["epoch"], b["place"], len(now)
    for k, ((id_a, hash_a), (id_b, hash_b)) in enumerate(zip(old[:shared], new[:shared], strict=True)):
        where = f"epoch {epoch}, place {place + k} in its order"
        if id_a != id_b:
            return "differs", (
                f"no, data order: {where} is sample {id_b}, the checkpoint's run had sample {id_a} there (the "
                "loader's order changed since the save: its sampler, shuffle, batch size or data)"
            )
        if hash_a != hash_b:
            return _other_values(a, b, len(then), ranks, f"sample {id_b} ({where})")
    if len(then) == ranks and a["n"] == b["n"] and [r["whole"] for r in then] != [r["whole"] for r in now]:
        return "differs", "no: the first batch's fields that are not one per sample differ from the checkpoint's run's"
    batch = place // max(len(new), 1)
    if shared < len(old):  # a resume on fewer samples a micro-batch: the batch holds the first of the checkpoint's
        part = f"its {shared} samples, the first of the checkpoint's {len(old)}"
    elif shared < len(new):
        part = f"the first {shared} of its {len(new)} samples, all the checkpoint's batch held"
    else:
        part = f"{shared} samples"
    return "verified", (
        f"resume verified (epoch {epoch}, batch {batch}: {part} on {ranks} rank(s), those the checkpoint's run would "
        "have trained next)"
    )


def _other_values(a: dict, b: dict, world_then: int, world_now: int, which: str) -> tuple[str, str]:
    """The first difference in a sample's values, and its cause as far as the records tell."""
    if fp.UNSEEDED in (a["how"], b["how"]):
        return "differs", (
            f"no, augmentation: {which} holds other values than in the checkpoint's run: loader workers draw it from "
            "streams of their own, not seeded per sample (run.seed_per_sample is off, or the dataset cannot be "
            "seeded: a map-style Dataset of a Python class with a length can)"
        )
    if fp.MAIN in (a["how"], b["how"]) and world_then != world_now:
        return "differs", (
            f"no, augmentation: {which} holds other values than in the checkpoint's run: drawn in the main process "
            f"from the generators of each of its {world_then} rank(s), which do not follow a resume on {world_now}"
            " (loader workers seed each sample alike on any number of ranks)"
        )
    if a["place"] == 0:  # replayed at the end of the previous epoch, before the module's epoch-start hooks ran
        return "unverified", (
            f"not verified: {which} holds other values than the checkpoint's run replayed at the end of the "
            "previous epoch: the dataset draws from a source the engine does not seed (os.urandom, time, a "
            "generator of its own), or a hook changes it at an epoch's start (an epoch attribute)"
        )
    return "differs", (
        f"no, data: {which} holds other values than in the checkpoint's run: the dataset draws from a source the "
        "engine does not seed (os.urandom, time, a generator of its own), or its data changed since the save"
    )


def _train_loaders(trainer: L.Trainer) -> list[Any]:
    loaders = trainer.train_dataloader
    return CombinedLoader(loaders).flattened if loaders is not None else []


def _cycled_in_this_epoch(trainer: L.Trainer, loader: Any) -> bool:
    """Whether ``loader``, which ran out, is iterated again before its epoch ends: a shorter one of train loaders
    Lightning cycles (``max_size_cycle``, its default for a dict or list), while a longer one has batches left."""
    if len(loader) >= trainer.num_training_batches or not train_loaders_cycle(trainer):
        return False
    longer = [other for other in _train_loaders(trainer) if len(other) >= trainer.num_training_batches]
    return any(
        isinstance(other, ResumableDataLoader) and other.state_dict()["batches"] < trainer.num_training_batches
        for other in longer
    )


def _own_position_checked(trainer: L.Trainer, loader: Any) -> tuple[str, str] | None:
    """The verdict on a stream (``lightkeep.stream_resume``) or a loader that keeps its own position
    (``lightkeep.own_positions``) or order (``lightkeep.own_orders``), resumed at each rank's: its first batch on
    every rank against the batch the checkpoint's run had fetched next (a stream fast-forwarded: also the last batch
    it read again, checked as it was read); ``None``: not such a loader, or not resumed at a position. Call it on
    every rank (it gathers)."""
    position = getattr(loader, "position", None)
    if isinstance(position, Position):
        if position.resumed is None or position.problem is not None:
            return None
        expected = position.resumed.get("ahead")  # absent from a checkpoint of engine 1.4.0 or earlier
    elif isinstance(position, OwnPosition | OwnOrder) and position.resumed is not None:
        expected = position.resumed["next"]
    else:
        return None
    code = 2 if expected is None else 0 if position.first == expected else 1  # verified, differs, nothing to compare
    if code == 2 and isinstance(position, Position) and not position.stateful:
        code = 0  # the fast-forward's own check verified it
    codes = every_rank(code)
    ranks = f" on {len(codes)} ranks" if len(codes) > 1 else ""
    if 1 in codes:
        return "differs", f"no: {position.differs(f' on rank {codes.index(1)}' if len(codes) > 1 else '')}"
    if 2 in codes and isinstance(position, Position) and "ahead" not in position.resumed:  # the key 1.5.0 added
        return "unverified", (
            f"not verified: {position.name}: its position in the checkpoint was recorded by an engine before 1.5.0, "
            f"which kept no fingerprint of the batch fetched ahead, so there is none to compare {position.checked} with"
        )
    if 2 in codes:
        return "unverified", (
            f"not verified: {position.name}: the checkpoint's run had fetched no batch ahead of training (a loader "
            "with a length, or a save at an epoch's end), so the checkpoint holds none to compare "
            f"{position.checked} with"
        )
    return "verified", f"resume verified ({position.verified(ranks)})"


def _why_unverifiable(loader: Any, i: int) -> str | None:
    """Why the engine cannot replay ``loader``'s next batch (``None``: it can)."""
    if isinstance(loader, ResumableDataLoader) and isinstance(loader.sampler, ResumableSampler):
        return None
    cannot = f"train loader {i}"
    if saves_its_state(loader):
        return f"{cannot} ({type(loader).__name__}) keeps its own position, which Lightning restores unchecked"
    if not isinstance(loader, DataLoader):
        return f"{cannot} is a {type(loader).__name__}, not a DataLoader: the engine cannot replay its next batch"
    if isinstance(loader.dataset, IterableDataset):
        return f"{cannot} streams an IterableDataset ({type(loader.dataset).__name__}): its next batch has no index"
    if isinstance(loader, ResumableDataLoader):
        return f"{cannot}: overfit_batches' {type(loader.sampler).__name__} is not the engine's sampler"
    if isinstance(getattr(loader, "position", None), OwnOrder):
        return f"{cannot}: its {type(own_order(loader)).__name__} draws the next epoch's order, unchecked"
    return f"{cannot}: its {type(own_order(loader)).__name__} is the user's own, whose order the engine cannot replay"
