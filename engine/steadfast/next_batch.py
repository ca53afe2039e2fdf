"""The batch a checkpoint's run trains on next, as a fingerprint, and the one-line verdict of a resume that compares its
own first batch with it: ``resume verified``, or the first difference.

Each checkpoint records, per train loader and rank, the next batch: its epoch, its place in the epoch's order (the
samples of all ranks before it), each sample's dataset index, and a 64-bit hash of each sample's tensors and of the
whole batch. The batch is replayed at the save, in the main process, as the loader would fetch it: the same keys from
the engine's sampler, the same ``__getitem__`` (seeded per sample as the loader's workers seed it), the same
``collate_fn``; the global generators are put back after, so nothing the run draws changes. The resumed loader hashes
the first batch it yields (``ResumableDataLoader``). Rank ``r`` of ``W`` holds the places ``r, r + W, ...`` of the
global batch, so the ranks' records interleave into the epoch's order and a resume on another number of ranks
compares the samples both runs put at the same places.

Cost, all on the host and off the training step: at each save (the files of one step share it) one batch loaded as a
loader worker loads it, and hashed (blake2b over its bytes once), per rank, and a gather of its few ints under DDP;
on a resume the same hash of the first batch, taken before it moves to a device, and one gather at the first batch.
Nothing per step. (A batch of 64 x 3 x 224 x 224 floats from a ``TensorDataset``, 38.5 MB, on a 2-core machine
under a load of 7: about 1.0 s to collate, as the loader does for every batch, and 0.15 s to hash, a save.)
"""

import copy
import hashlib
import itertools
import random
from collections.abc import Mapping
from typing import Any

import lightning as L
import numpy as np
import torch
from lightning.pytorch.utilities import CombinedLoader
from torch.utils.data import DataLoader, IterableDataset

from steadfast.loaders import ResumableDataLoader, ResumableSampler
from steadfast.own_orders import OwnOrder
from steadfast.own_positions import OwnPosition
from steadfast.sample_seeds import seed_per_sample
from steadfast.stream_positions import Position
from steadfast.user_loaders import own_order, saves_its_state

# A record is one int64 tensor: these fields, then the n sample indices, then the n sample hashes.
FIELDS = ("epoch", "place", "rank", "world", "size", "how", "whole", "n")
MAIN, SEEDED, UNSEEDED = 0, 1, 2  # "how": fetched in the main process; by workers seeded per sample; by workers not


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
        n = _batch_size(loader)
        if batches >= min(len(loader), trainer.num_training_batches):  # the epoch is over: the next one's first
            epoch, batches = epoch + 1, 0
        cached = loader.next_batch
        if cached is None or cached[0] != (epoch, batches):
            keys = _keys(loader.sampler, epoch, batches * n, n)
            cached = ((epoch, batches), _fingerprint(loader, epoch, batches, keys, _replay(loader, keys)))
            loader.next_batch = cached  # several files of one step: one replay
        out.append(_gather(trainer, cached[1]))
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
    state, n = loader.state_dict(), _batch_size(loader)  # the batches yielded before this one
    epoch, batches = state["epoch"], state["batches"]
    return _fingerprint(loader, epoch, batches, _keys(loader.sampler, epoch, batches * n, n), batch)


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
        if own is not None and own[0] != "verified":
            return own
        checked = own[1] if own is not None else None
        if checked is not None:
            said.append(checked)
            continue
        mine = loader.first_batch if isinstance(loader, ResumableDataLoader) else None
        if isinstance(then, str) or mine is None:
            why = then if isinstance(then, str) else _why_unverifiable(loader, i) or f"train loader {i} was not resumed"
            return "unverified", f"not verified: {why}"
        kind, words = _compare(_unpack(then), _unpack(_gather(trainer, mine)))
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
    old, new = _in_order(then), _in_order(now)
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
    if UNSEEDED in (a["how"], b["how"]):
        return "differs", (
            f"no, augmentation: {which} holds other values than in the checkpoint's run: loader workers draw it from "
            "streams of their own, not seeded per sample (run.seed_per_sample is off, or the dataset cannot be "
            "seeded: a map-style Dataset of a Python class with a length can)"
        )
    if MAIN in (a["how"], b["how"]) and world_then != world_now:
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


def _own_position_checked(trainer: L.Trainer, loader: Any) -> tuple[str, str] | None:
    """The verdict on a stream (``steadfast.stream_resume``) or a loader that keeps its own position
    (``steadfast.own_positions``) or order (``steadfast.own_orders``), resumed at each rank's: its first batch on
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
    codes = [code]
    if trainer.world_size > 1:
        mine = torch.tensor(code, device=trainer.strategy.root_device)
        codes = trainer.strategy.all_gather(mine).reshape(-1).tolist()
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


def _batch_size(loader: ResumableDataLoader) -> int:
    batches = loader.batch_sampler
    return (getattr(batches, "batch_size", None) or 1) if batches is not None else 1


def _keys(sampler: ResumableSampler, epoch: int, skip: int, n: int) -> list[int]:
    """The ``n`` keys ``sampler`` hands out in ``epoch`` after ``skip`` (a copy is iterated, not the sampler)."""
    replay = copy.copy(sampler)
    replay.set_epoch(epoch)
    replay.skip = skip
    return list(itertools.islice(iter(replay), n))


def _replay(loader: ResumableDataLoader, keys: list[int]) -> Any:
    """The batch of ``keys`` as ``loader`` fetches it, in this process; its global generators as they were after."""
    dataset = loader.dataset
    seeded = loader.sampler.epoch_in_keys  # type: ignore[attr-defined]
    undo = seed_per_sample(dataset, loader.sampler.seed) if seeded else lambda: None  # as each worker seeds its copy
    states = torch.get_rng_state(), np.random.get_state(), random.getstate()
    try:
        if loader.batch_sampler is None:
            return loader.collate_fn(dataset[keys[0]])
        if callable(getattr(dataset, "__getitems__", None)):  # as torch's fetcher does
            return loader.collate_fn(dataset.__getitems__(keys))
        return loader.collate_fn([dataset[key] for key in keys])
    finally:
        torch.set_rng_state(states[0])
        np.random.set_state(states[1])
        random.setstate(states[2])
        undo()


def _fingerprint(loader: ResumableDataLoader, epoch: int, batches: int, keys: list[int], batch: Any) -> torch.Tensor:
    sampler: ResumableSampler = loader.sampler  # type: ignore[assignment]
    size, n = len(sampler.dataset), len(keys)  # type: ignore[arg-type]
    ids = [key % size for key in keys] if sampler.epoch_in_keys else keys
    how = SEEDED if sampler.epoch_in_keys else UNSEEDED if loader.num_workers else MAIN
    samples, whole = _hashes(batch, n)
    place = batches * _batch_size(loader) * sampler.num_replicas
    fields = [epoch, place, sampler.rank, sampler.num_replicas, size, how, whole, n]
    return torch.tensor([*fields, *ids, *samples], dtype=torch.int64)


def _hashes(batch: Any, n: int) -> tuple[list[int], int]:
    """A hash of each of the batch's ``n`` samples (its tensors' rows, its per-sample strings and numbers), and one of
    the whole batch (dtypes, shapes, every leaf)."""
    rows = [hashlib.blake2b(digest_size=8) for _ in range(n)]
    whole = hashlib.blake2b(digest_size=8)

    def walk(x: Any) -> None:
        if isinstance(x, np.ndarray) and x.dtype != object:
            x = torch.from_numpy(np.ascontiguousarray(x))
        if isinstance(x, torch.Tensor):
            t = x.detach().cpu().contiguous()
            whole.update(f"{t.dtype}{tuple(t.shape)}".encode())
            raw = t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
            if t.dim() and len(t) == n:  # its bytes once, into the rows (the whole batch's hash covers the rows')
                for row, part in zip(rows, raw.reshape(n, -1).numpy(), strict=True):
                    row.update(part)
            else:
                whole.update(raw.numpy())
        elif isinstance(x, Mapping):
            for key, value in x.items():
                whole.update(repr(key).encode())
                walk(value)
        elif isinstance(x, list | tuple) and len(x) == n and all(isinstance(v, str | bytes | int | float) for v in x):
            for row, value in zip(rows, x, strict=True):  # default_collate's list of a batch's strings
                row.update(repr(value).encode())
        elif isinstance(x, list | tuple):
            for value in x:
                walk(value)
        else:  # a number, a string; of another object only its type (its repr may hold an address)
            plain = isinstance(x, str | bytes | int | float | bool | None)
            whole.update((repr(x) if plain else type(x).__name__).encode())

    walk(batch)
    for row in rows:
        whole.update(row.digest())
    as_int = lambda h: int.from_bytes(h.digest(), "little", signed=True)  # noqa: E731
    return [as_int(row) for row in rows], as_int(whole)


def _gather(trainer: L.Trainer, mine: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's record (one per rank; ``[mine]`` on one process)."""
    if trainer.world_size == 1:
        return [mine]
    device = trainer.strategy.root_device  # NCCL gathers only device tensors
    length = trainer.strategy.all_gather(torch.tensor([len(mine)], device=device)).cpu().reshape(-1)
    padded = torch.full((int(length.max()),), -1, dtype=torch.int64)
    padded[: len(mine)] = mine
    every = trainer.strategy.all_gather(padded.to(device)).cpu()
    return [every[r, : int(length[r])].clone() for r in range(trainer.world_size)]


def _unpack(ranks: list[torch.Tensor]) -> list[dict]:
    out = []
    for row in ranks:
        values = row.tolist()
        fields = dict(zip(FIELDS, values, strict=False))
        n, start = fields["n"], len(FIELDS)
        out.append({**fields, "ids": values[start : start + n], "hashes": values[start + n : start + 2 * n]})
    return out


def _in_order(ranks: list[dict]) -> list[tuple[int, int]]:
    """``(index, hash)`` of each sample of the batch over all ranks, in the epoch's order (the sampler's rank ``r``
    of ``W`` holds its places ``r, r + W, ...``); ranks sharing a sampler rank (model parallel) counted once."""
    by_rank = {r["rank"]: r for r in ranks}
    world, n = ranks[0]["world"], min(r["n"] for r in ranks)
    if sorted(by_rank) != list(range(world)):
        return []
    return [(by_rank[r]["ids"][j], by_rank[r]["hashes"][j]) for j in range(n) for r in range(world)]
