"""The private torch APIs the engine relies on, each behind a function (or constant) named for what it does:
``Optimizer``, ``LRScheduler``, ``Tensor``, serialization, DCP, pytree, ``DataLoader``, ``torch.compile``'s wrapper,
gloo's messages. tests/test_compat.py tests each name; on a layout these functions do not know they raise
``LightningChanged`` (``lightkeep.compat``).
"""

import contextlib
import copy
import functools
import threading
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader

from lightkeep.compat import LightningChanged


def set_nested(state_dict: dict[str, Any], path: Any, value: Any) -> None:
    from torch.distributed.checkpoint._traverse import set_element

    set_element(state_dict, path, value)


def skips_steps_on_device(optimizer: Any) -> bool:
    """Whether ``optimizer.step`` reads ``optimizer.found_inf`` and leaves everything as it was while it is 1."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


def set_last_lr(scheduler: Any, lrs: list[float]) -> None:
    """What ``scheduler.get_last_lr()`` returns (torch's ``LRScheduler._last_lr``; it has no public setter)."""
    if not hasattr(scheduler, "_last_lr"):
        raise LightningChanged("torch's LRScheduler._last_lr (what get_last_lr returns) is gone")
    scheduler._last_lr = list(lrs)


def unsaved_buffers(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``module``'s own buffers registered with ``persistent=False``, which its ``state_dict`` (so every checkpoint)
    leaves out; ``None`` for one registered or set so (a cache filled later)."""
    if not isinstance(getattr(module, "_non_persistent_buffers_set", None), set):
        raise LightningChanged("torch's Module._non_persistent_buffers_set (the buffers state_dict leaves out) is gone")
    return {name: b for name, b in module._buffers.items() if name in module._non_persistent_buffers_set}


def version_counter(t: torch.Tensor) -> int | None:
    """``t``'s in-place version counter (bumped by every in-place write); ``None`` for an inference tensor, which
    has none."""
    try:
        return t._version
    except RuntimeError:
        return None


@functools.cache
def crc32_setting_is_per_thread() -> bool:
    """Whether torch keeps its serialization config per thread (2.13 does, 2.9 does not): only then can one thread's
    ``torch.save`` leave out the CRC-32 while another's keeps it."""
    from torch.utils.serialization import config

    seen: list[bool] = []
    inside, done = threading.Event(), threading.Event()

    def other() -> None:
        with config.patch({"save.compute_crc32": not config.save.compute_crc32}):
            inside.set()
            done.wait(5)

    before = config.save.compute_crc32
    thread = threading.Thread(target=other, daemon=True)
    thread.start()
    inside.wait(5)
    seen.append(config.save.compute_crc32)
    done.set()
    thread.join()
    return seen == [before]


@contextlib.contextmanager
def crc32_off_in_this_thread() -> Iterator[bool]:
    """Inside it, ``torch.save`` on this thread writes no CRC-32 (yields ``True``), where torch keeps its
    serialization config per thread (2.13 does): a ``torch.save`` on another thread meanwhile keeps its checksums.
    Where the setting is process-wide, nothing changes (yields ``False``)."""
    if not crc32_setting_is_per_thread():
        yield False
        return
    before = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        yield True
    finally:
        torch.serialization.set_crc32_options(before)


def load_bytes_weights_only(planner: Any, read_item: Any, value: Any) -> None:
    """DCP's ``DefaultLoadPlanner.load_bytes`` (which reads with ``weights_only=False``), reading with ``True``."""
    try:
        state_dict, path = planner.original_state_dict, planner.mappings[read_item.dest_index.fqn]
    except AttributeError as error:
        raise LightningChanged(f"DCP's DefaultLoadPlanner has no {error.name}") from None
    set_nested(state_dict, path, torch.load(value, weights_only=True))


def index_for_reader(reader: Any, metadata: Any) -> Any:
    """DCP's ``Metadata`` as ``FileSystemReader.read_metadata`` returns it: with the reader's ``load_id``."""
    from torch.distributed.checkpoint.metadata import StorageMeta

    if getattr(metadata, "storage_meta", None) is None:
        metadata.storage_meta = StorageMeta()
    metadata.storage_meta.load_id = reader.load_id
    return metadata


# What gloo's collectives raise when another rank's process is gone.
PEER_GONE = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "pair.cc")


def tree_map(fn: Any, tree: Any) -> Any:
    """torch's ``tree_map`` (``torch.utils._pytree``, which torch has no public name for): ``fn`` on every leaf of
    nested lists, tuples and dicts, the structure kept."""
    from torch.utils._pytree import tree_map as torch_tree_map

    return torch_tree_map(fn, tree)


def tree_leaves(tree: Any) -> list[Any]:
    """torch's ``tree_leaves`` (``torch.utils._pytree``): the leaves of nested lists, tuples and dicts, in order."""
    from torch.utils._pytree import tree_leaves as torch_tree_leaves

    return torch_tree_leaves(tree)


def unstarted_copy(loader: Any) -> Any:
    """A shallow copy of ``loader`` that starts its own iterator: ``DataLoader`` keeps its persistent workers'
    iterator in ``_iterator``, which a copy would share with the user's loader."""
    if not hasattr(loader, "_iterator"):
        raise LightningChanged("torch.utils.data.DataLoader._iterator (persistent workers' iterator) is gone")
    rebuilt = copy.copy(loader)
    rebuilt._iterator = None
    return rebuilt


def sampler_of_its_batch_sampler(loader: Any) -> None:
    """``loader``'s ``sampler``, ``batch_size`` and ``drop_last`` are its ``batch_sampler``'s, as in a ``DataLoader``
    built with that sampler and batch size (which makes torch's ``BatchSampler`` of them): Lightning rebuilds a
    loader whose batch sampler is not torch's own (torchdata's ``BatchSampler``) around a new sampler with
    ``batch_size=None`` and the default ``SequentialSampler`` in ``sampler``, which torch's ``DataLoader`` refuses to
    change after ``__init__`` (its ``__setattr__`` guard: passed by here)."""
    batches = loader.batch_sampler
    drawn = getattr(batches, "sampler", None)
    if drawn is not None and loader.sampler is not drawn and isinstance(getattr(batches, "batch_size", None), int):
        for name, value in (("sampler", drawn), ("batch_size", batches.batch_size), ("drop_last", batches.drop_last)):
            object.__setattr__(loader, name, value)


def index_sampler(loader: Any) -> Any:
    """What ``loader``'s iterators draw each batch's indices from (torch's ``DataLoader._index_sampler``, a property a
    subclass can put its own in front of)."""
    prop = DataLoader.__dict__.get("_index_sampler")
    if not isinstance(prop, property):
        raise LightningChanged("torch.utils.data.DataLoader._index_sampler (its iterators' index sampler) is gone")
    return prop.fget(loader)  # type: ignore[misc]


COMPILED_KEY_PART = "_orig_mod."  # what torch.compile's wrapper adds to its module's state_dict keys


def uncompiled_key(key: str) -> str:
    """``key`` of a ``state_dict`` as the module holds it uncompiled: ``net._orig_mod.w`` -> ``net.w``."""
    return key.replace(COMPILED_KEY_PART, "")


def without_compiled_wrappers(module: torch.nn.Module) -> torch.nn.Module:
    """``module`` with each ``torch.compile``d submodule (an ``OptimizedModule``) put back as the module it wraps:
    the same parameters, keyed as the module built without ``configure_model``."""
    try:
        wrapper = torch._dynamo.eval_frame.OptimizedModule
    except AttributeError:
        raise LightningChanged("torch._dynamo.eval_frame.OptimizedModule is gone") from None
    for child in list(module.modules()):
        for attr, sub in list(child.named_children()):
            if isinstance(sub, wrapper):
                setattr(child, attr, sub._orig_mod)
    return module


@contextlib.contextmanager
def exit_barrier_waits(wait: Any) -> Iterator[None]:
    """Inside it, torchrun's agent (``SimpleElasticAgent._exit_barrier``: once its workers finished, it waits up to
    300 s for every node's agent) runs that barrier on a thread of its own, which ``wait(thread)`` joins for as long
    as it chooses; the agent goes on when ``wait`` returns. In a launcher's process (``lightkeep.torchrun``)."""
    from torch.distributed.elastic.agent.server.api import SimpleElasticAgent

    barrier = getattr(SimpleElasticAgent, "_exit_barrier", None)
    if not callable(barrier):
        raise LightningChanged("torch's SimpleElasticAgent._exit_barrier (torchrun's wait for every agent) is gone")

    def exit_barrier(agent: Any) -> None:
        thread = threading.Thread(target=barrier, args=(agent,), daemon=True, name="exit-barrier")
        thread.start()
        wait(thread)

    SimpleElasticAgent._exit_barrier = exit_barrier  # type: ignore[method-assign]
    try:
        yield
    finally:
        SimpleElasticAgent._exit_barrier = barrier  # type: ignore[method-assign]
