"""The host copy a background checkpoint save writes from: taken while the loop waits, reusing its buffers, shared
by the saves of one point of training (``lightkeep.checkpoint_io``)."""

import copy
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
from lightning_utilities.core.apply_func import apply_to_collection

from lightkeep.compat_torch import version_counter


class HostSnapshot:
    """A copy of a checkpoint's tensors in host memory, taken while the loop waits, for a writer thread to save.

    The copy lands in the buffers of the previous snapshot where shapes match (no allocation, pinned for CUDA
    tensors). Saves of one point of training (same ``global_step``, epoch and loop progress) share one copy: a tensor
    whose memory and in-place version counter are unchanged is not copied again; the few small tensors each of
    Lightning's dumps makes anew go into new buffers, which no write in flight reads (what this saves:
    docs/checkpoints.md, 'Saves and their knobs'). Beyond the one host copy of the state, only those small tensors of
    the previous save are held while a write is in flight: at most 1% of it or 1 MiB, else the save waits first.
    """

    SMALL_FRACTION, SMALL_BYTES = 0.01, 2**20

    def __init__(self) -> None:
        self._progress: Any = None
        self.same_point = False  # the last take was at the same point of training as the one before it
        # id of the source's memory -> (source, its version when copied, the host copy). The source is held so that
        # its memory cannot be freed and reused by another tensor with the same key.
        self._copies: dict[tuple, tuple[torch.Tensor, int | None, torch.Tensor]] = {}

    def take(
        self, checkpoint: dict[str, Any], before_copying: Callable[[], None], untrained: bool = False
    ) -> dict[str, Any]:
        """The checkpoint with every tensor replaced by its host copy (containers rebuilt, so later changes to the
        trainer's dicts do not reach the file). ``before_copying`` runs first unless the copy only adds new
        buffers, small ones: it waits for the writes still reading the buffers.

        ``untrained``: the caller knows that no training batch ran since the last take (``AtomicCheckpointIO``
        holds its point until one starts). A save at the same global step with the same parts is then at the same
        point though the loops' counters moved on: ``last.ckpt`` at the end of ``fit`` after the last validation's
        best-k file, a validation's files after a batch end's ``last.ckpt``."""
        progress = _progress(checkpoint)
        same_point = progress is not None and _equal(progress, self._progress)
        same_point = self.same_point = same_point or (untrained and _same_step(progress, self._progress))
        tensors: list[torch.Tensor] = []
        _map_tensors(checkpoint, tensors.append)
        fresh = {_key(t): t for t in tensors}
        stale = {key for key, t in fresh.items() if not (same_point and self._unchanged(key, t))}
        if stale:
            new_bytes = sum(fresh[key].nbytes for key in stale)
            all_bytes = sum(t.nbytes for t in fresh.values())
            small = new_bytes <= max(self.SMALL_FRACTION * all_bytes, self.SMALL_BYTES)
            if not same_point or stale & self._copies.keys() or not small:
                before_copying()
            # buffers of tensors still there are refilled; the others are dropped first (freed once no write in
            # flight holds them), so the old and the new copy never both exist
            buffers = {key: host for key, (_, _, host) in self._copies.items() if key in stale}
            self._copies = {key: entry for key, entry in self._copies.items() if key in fresh and key not in stale}
            for key in stale:
                t = fresh[key]
                self._copies[key] = (t, version_counter(t), _to_host(t, buffers.pop(key, None)))
            self._progress = copy.deepcopy(progress)
        return _map_tensors(checkpoint, lambda t: self._copies[_key(t)][2])

    def _unchanged(self, key: tuple, t: torch.Tensor) -> bool:
        version = version_counter(t)  # bumped by every in-place write (optimizer steps, running stats); None: copied
        return key in self._copies and version is not None and self._copies[key][1] == version


_LEAVES = (str, int, float, bool, type(None))


def _map_tensors(obj: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """``apply_to_collection(obj, torch.Tensor, fn)``, fast on the plain dicts, lists and tuples a checkpoint is
    made of (its loop state alone is hundreds of nested dicts: ~2 ms a save through the general function, which
    checks each for dataclasses, namedtuples and defaultdicts). Anything else goes to the general function."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    kind = type(obj)
    if kind in _LEAVES:
        return obj
    if kind is dict or kind is OrderedDict:
        return kind((key, _map_tensors(value, fn)) for key, value in obj.items())
    if kind is list:
        return [_map_tensors(value, fn) for value in obj]
    if kind is tuple:
        return tuple(_map_tensors(value, fn) for value in obj)
    return apply_to_collection(obj, torch.Tensor, fn)


def _key(t: torch.Tensor) -> tuple:
    return (t.device, t.data_ptr(), t.dtype, tuple(t.shape), tuple(t.stride()) if t.layout == torch.strided else ())


def _to_host(t: torch.Tensor, buffer: torch.Tensor | None) -> torch.Tensor:
    t = t.detach()
    if t.layout != torch.strided:  # sparse and other layouts: a plain copy, no buffer reuse
        return t.to("cpu", copy=True)
    if buffer is None:
        buffer = torch.empty_like(t, device="cpu", pin_memory=t.is_cuda)  # dense: the same strides
    return buffer.copy_(t)


def _progress(checkpoint: dict[str, Any]) -> Any:
    """Where training was: equal for two saves only if no training batch ran between them and they hold the same
    parts (a ``save_weights_only`` dump, without optimizer and callback states, is never one file with a full one).
    ``None`` (never equal) for a checkpoint without loop state: nothing tells whether the weights moved."""
    if "loops" not in checkpoint:
        return None
    return checkpoint.get("epoch"), checkpoint.get("global_step"), checkpoint["loops"], sorted(checkpoint)


def _same_step(a: Any, b: Any) -> bool:
    """The same global step and parts, whatever the loops' counters say."""
    return a is not None and b is not None and _equal((a[1], a[3]), (b[1], b[3]))


def _equal(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except (RuntimeError, ValueError, TypeError):  # loop state holding tensors: taken as changed
        return False
