"""Checkpoint files: written so that a kill or a full disk at any moment cannot corrupt them, read so that a file
from anywhere cannot run code."""

import contextlib
import copy
import os
import pickle
import re
import sys
import zipfile
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning_utilities.core.apply_func import apply_to_collection
from torch import nn

from project.engine.compat import (
    count_pending_saves_as_files,
    crc32_off_in_this_thread,
    restore_file_exists,
    version_counter,
)

FilePath = str | os.PathLike  # a path; Lightning's own alias, `_PATH`, is private


class CheckpointLoadError(ValueError):
    """A file that cannot be loaded as a checkpoint (or not into this model); the message names it and the fix."""


def load_checkpoint_file(path: FilePath, mmap: bool = False, map_location: Any = "cpu") -> dict[str, Any]:
    """``torch.load`` with ``weights_only=True``: tensors, numbers, strings and containers only, never code.

    A pickle can name any function to call while it is loaded (``os.system``, ...); ``weights_only`` refuses
    every name outside torch's allow-list. The template's own checkpoints hold nothing else. ``mmap`` reads the
    structure now and the tensors' bytes only when they are used.
    """
    if not zipfile.is_zipfile(path):  # what torch.save writes since 1.6; mmap would fail with a puzzling message
        kind = (
            "an empty file" if os.path.getsize(path) == 0 else "not a zip archive (cut short, or another kind of file)"
        )
        raise CheckpointLoadError(f"{path} is not a readable checkpoint: it is {kind}")
    try:
        checkpoint = torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as error:
        found = re.search(r"Unsupported global: GLOBAL (\S+)", str(error))
        what = f"a Python object ({found[1]})" if found else "a Python object"
        raise CheckpointLoadError(
            f"{path} holds {what} besides tensors and plain data, and loading it could run code, so it was not "
            "loaded. Use checkpoints you trust only; if you trust this one and the object is your own class, allow "
            "it with torch.serialization.add_safe_globals([YourClass]) before the run"
        ) from None
    except Exception as error:  # a damaged archive: torch raises RuntimeError, EOFError, ... depending on where
        first_line = str(error).splitlines()[0] if str(error) else ""
        raise CheckpointLoadError(
            f"{path} is not a readable checkpoint ({type(error).__name__}: {first_line})"
        ) from None
    if not isinstance(checkpoint, dict) or "state_dict" not in checkpoint:
        raise CheckpointLoadError(
            f"{path} is not a Lightning checkpoint: it holds a {type(checkpoint).__name__} without a 'state_dict'"
        )
    return checkpoint


def check_fits(path: FilePath, module: nn.Module) -> None:
    """Raises ``CheckpointLoadError`` listing each parameter whose shape differs (and, when the module loads
    strictly, each one missing on either side), before a run starts and writes anything.

    Lightning finds the same only after the run folder and its config exist, in a traceback of torch's list.
    """
    saved = load_checkpoint_file(path, mmap=True)["state_dict"]
    full = module.state_dict()
    here = {k: v for k, v in full.items() if isinstance(v, torch.Tensor) and not nn.parameter.is_lazy(v)}
    problems = [
        f"{key} is {list(saved[key].shape)} in the checkpoint, {list(value.shape)} here"
        for key, value in here.items()
        if isinstance(saved.get(key), torch.Tensor) and saved[key].shape != value.shape
    ]
    if getattr(module, "strict_loading", True):
        missing, unexpected = sorted(full.keys() - saved.keys()), sorted(saved.keys() - full.keys())
        problems += [f"{key} is missing from the checkpoint" for key in missing]
        if not is_overridden("configure_model", module):  # else those layers may be built there, later
            problems += [f"{key} is in the checkpoint only" for key in unexpected]
    if not problems:
        return
    shown = "; ".join(problems[:10]) + (f"; and {len(problems) - 10} more" if len(problems) > 10 else "")
    run_config = Path(path).parent.parent / "config.yaml"  # <run>/checkpoints/<file>.ckpt
    fix = f"add --config {run_config}" if run_config.is_file() else "give the --model arguments of its run"
    raise CheckpointLoadError(
        f"{path} holds a different network from the one configured: {shown}. "
        f"Build the network the checkpoint was saved from: {fix}"
    )


class HostSnapshot:
    """A copy of a checkpoint's tensors in host memory, taken while the loop waits, for a writer thread to save.

    The copy lands in the buffers of the previous snapshot where shapes match (no allocation, pinned for CUDA
    tensors). Saves taken at the same point of training (the best-k file, ``last.ckpt`` and the every-2-epochs file
    at one validation end: same ``global_step``, epoch and loop progress) share one copy: a tensor that has not
    changed since (the same memory, its in-place version counter unchanged) is not copied again. Each of
    Lightning's dumps makes a few small tensors anew (RNG states, scores): those are copied into new buffers, which
    no write in flight reads, so the second and third saves of a point do not wait for the first one's write. So
    there is never more than one host copy of the state (plus, while a write is in flight, those small tensors of
    the previous save: at most 1% of it or 1 MiB, else the save waits first).
    """

    SMALL_FRACTION, SMALL_BYTES = 0.01, 2**20

    def __init__(self) -> None:
        self._progress: Any = None
        self.same_point = False  # the last take was at the same point of training as the one before it
        # id of the source's memory -> (source, its version when copied, the host copy). The source is held so that
        # its memory cannot be freed and reused by another tensor with the same key.
        self._copies: dict[tuple, tuple[torch.Tensor, int | None, torch.Tensor]] = {}

    def take(self, checkpoint: dict[str, Any], before_copying: Callable[[], None]) -> dict[str, Any]:
        """The checkpoint with every tensor replaced by its host copy (containers rebuilt, so later changes to the
        trainer's dicts do not reach the file). ``before_copying`` runs first unless the copy only adds new
        buffers, small ones: it waits for the writes still reading the buffers."""
        progress = _progress(checkpoint)
        same_point = self.same_point = progress is not None and _equal(progress, self._progress)
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
                self._copies[key] = (t, _version(t), _to_host(t, buffers.pop(key, None)))
            self._progress = copy.deepcopy(progress)
        return _map_tensors(checkpoint, lambda t: self._copies[_key(t)][2])

    def _unchanged(self, key: tuple, t: torch.Tensor) -> bool:
        version = _version(t)
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


def _version(t: torch.Tensor) -> int | None:
    return version_counter(t)  # bumped by every in-place write (optimizer steps, running stats); None: copied


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


def _equal(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except (RuntimeError, ValueError, TypeError):  # loop state holding tensors: taken as changed
        return False


@dataclass
class _Point:
    """The saves of one point of training held back until training moves on: written once, under every name."""

    checkpoint: dict[str, Any]  # the last save's: every callback's state as it stands after all of them saved
    paths: list[Path]
    removals: list[Path] = field(default_factory=list)  # done after the write, as they were asked for after saves


class AtomicCheckpointIO(TorchCheckpointIO):
    """Writes ``<name>.tmp`` beside the target, fsyncs it and renames it over the target; in the background.

    A rename within one directory is atomic on POSIX filesystems, so ``last.ckpt`` is always either the previous
    complete file or the new complete one, and the ``.tmp`` never matches ``*.ckpt`` (what ``--ckpt_path last``
    looks at). (Lightning's own save goes through a temporary file in the system temp folder, which is a copy, not
    a rename, when that folder is on another filesystem.) A failed write (a full disk, a lost mount) removes the
    ``.tmp`` and raises an ``OSError`` that names the folder and what to do. Local paths only; remote URLs fall back
    to Lightning's writer.

    In the background (the default), a save costs the loop only the copy of the state to host memory
    (``HostSnapshot``); one thread writes, fsyncs and renames, one file after the other, and removes the files
    ModelCheckpoint drops from its top k in the same queue, so a removal never overtakes the write of its file. A
    save that needs a new copy first waits for the writes in flight (one host copy at most). Lightning's
    ``AsyncCheckpointIO`` queues without bound (a copy per save), copies on the GPU, and removes files while their
    writes are queued (Lightning issue #14035). Every write is finished before ``fit`` returns or raises
    (``teardown``), before a preemption or Ctrl-C exit (``signals``), and before a checkpoint is loaded. A failed
    background write is raised at the next save or at the end of ``fit``.

    Saves of one point of training (the best-k file and the every-2-epochs file of one validation: the same step,
    loop state and tensors) are one file under several names, hard links, written once. While ``OneFilePerPoint``
    (an engine callback) runs, such saves are held until training moves on (the next batch or epoch, the end of
    ``fit``, a signal), so that the file holds the last of them, whose callback states include every file of that
    point; a save while another of its point is already being written is written on its own. ``last.ckpt``, which
    each refresh rewrites under the same name, is never linked. Where the folder cannot hard-link (another
    filesystem, some network mounts), each name is written in full.

    The zip's CRC-32 of each record is not computed (``crc32``): ``torch.load`` never checks it, and it was half
    of a write's CPU time. Tools that verify zip archives (``unzip -t``) then report the records as damaged. Only
    the writing thread's ``torch.save`` leaves it out (torch keeps that setting per thread); where a torch version
    keeps it for the whole process, every file gets its CRC-32.

    Loading always uses ``weights_only=True`` (see ``load_checkpoint_file``), whatever ``--weights_only`` says.

    Args:
        background: Write in a background thread; ``false``: the loop waits for each whole save (write and fsync).
        crc32: Compute the zip archive's CRC-32 checksums, for tools that check them; ``torch.load`` does not.
    """

    def __init__(self, background: bool = True, crc32: bool = False) -> None:
        super().__init__()
        self.background, self.crc32 = background, crc32
        self.hold_points = False  # set by OneFilePerPoint while it calls close_point when training moves on
        self._snapshot = HostSnapshot()
        self._writer: ThreadPoolExecutor | None = None
        self._queued: list[Future] = []  # writes and removals in flight, in order
        self._held: _Point | None = None

    def save_checkpoint(self, checkpoint: dict[str, Any], path: FilePath, storage_options: Any | None = None) -> None:
        # SLURM's hpc_ckpt: Lightning requeues the job right after this returns, and the job is killed soon after,
        # so the file must be whole by then
        if "://" in str(path) or not self.background or Path(path).name.startswith("hpc_ckpt_"):
            self.wait()
            if "://" in str(path):
                return super().save_checkpoint(checkpoint, path, storage_options)
            return self._save_atomically(checkpoint, Path(path))
        self._raise_failed_write()
        on_host = self._snapshot.take(checkpoint, before_copying=self.wait)  # a wait writes what is held first
        path = Path(path)
        if self._held is not None and self._snapshot.same_point:
            held = self._held
            held.checkpoint = on_host
            held.paths += [] if path in held.paths else [path]
            held.removals = [p for p in held.removals if p != path]  # saved again after its removal: kept
            return
        self.close_point()
        if self.hold_points:
            self._held = _Point(on_host, [path])
        else:
            self._submit(self._save_atomically, on_host, path)

    def claims(self, path: FilePath) -> bool:
        """Whether a save to ``path`` is held or being written: the name is taken, though not yet on disk."""
        path = Path(path)
        held = self._held is not None and path in self._held.paths and path not in self._held.removals
        return held or any(path in getattr(f, "paths", ()) and not f.done() for f in self._queued)

    def remove_checkpoint(self, path: FilePath) -> None:
        if self._held is not None:
            self._held.removals.append(Path(path))
        elif self._queued:
            self._submit(super().remove_checkpoint, path)  # after the writes queued before it, this file's too
        else:
            super().remove_checkpoint(path)

    def close_point(self) -> None:
        """Training moved on: the saves held for the point just left are queued for the writer."""
        held, self._held = self._held, None
        if held is not None:
            # last.ckpt is rewritten under its name at each refresh: never linked, since a writer that rewrites a
            # file in place (Lightning's own, when its temporary folder is on another filesystem) would also
            # change the files linked to it; the others' names are new each time
            alone = [p for p in held.paths if p.name.startswith(ModelCheckpoint.CHECKPOINT_NAME_LAST)]
            shared = [p for p in held.paths if p not in alone]
            for paths in ([shared] if shared else []) + [[p] for p in alone]:
                self._submit(self._save_atomically, held.checkpoint, *paths)
            for path in held.removals:
                self._submit(super().remove_checkpoint, path)

    def wait(self) -> None:
        """Returns once every save (held ones too) and removal is done; raises the first that failed."""
        self.close_point()
        queued, self._queued = self._queued, []
        errors = [f.exception() for f in queued]
        error = next((e for e in errors if e is not None), None)
        if error is not None:
            raise error

    def teardown(self) -> None:
        # End of fit, validate, ...: Lightning calls this after the run and after an exception, whose report a
        # failed write must not replace; it is then printed beside it.
        handling = sys.exc_info()[1]
        try:
            self.wait()
        except Exception as error:
            if handling is None:
                raise
            print(f"error: {error}", file=sys.stderr)  # beside the error the run is already failing with
        finally:
            self.hold_points = False  # after a failed fit too, where Lightning skips the callbacks' teardown
            if self._writer is not None:
                self._writer.shutdown()
                self._writer = None

    def _submit(self, fn: Callable[..., None], *args: Any) -> None:
        if self._writer is None:
            self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-writer")
        future = self._writer.submit(fn, *args)
        if fn == self._save_atomically:
            future.paths = args[1:]  # type: ignore[attr-defined]  # for claims()
        self._queued.append(future)

    def _raise_failed_write(self) -> None:
        if any(f.done() and f.exception() is not None for f in self._queued):
            self.wait()

    def _save_atomically(self, checkpoint: dict[str, Any], path: Path, *same: Path) -> None:
        """Writes ``path`` (and ``same``, hard links to it) through ``.tmp`` files renamed over them."""
        tmps: list[Path] = []
        current = path
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmps.append(tmp := path.with_name(f"{path.name}.tmp"))
            tmp.unlink(missing_ok=True)  # a .tmp left by a kill may be a hard link to a finished file: never into it
            with open(tmp, "wb") as f:
                self._write(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
            for current in same:
                current.parent.mkdir(parents=True, exist_ok=True)
                tmps.append(link := current.with_name(f"{current.name}.tmp"))
                link.unlink(missing_ok=True)
                try:
                    os.link(tmp, link)
                except OSError:  # no hard links there (another filesystem, some network mounts): a copy of its own
                    with open(link, "wb") as f:
                        self._write(checkpoint, f)
                        f.flush()
                        os.fsync(f.fileno())
            for name, written in zip((*same, path), (*tmps[1:], tmp), strict=True):
                current = name
                os.replace(written, name)
        except OSError as error:
            for written in tmps:
                written.unlink(missing_ok=True)
            raise OSError(
                error.errno,
                f"could not save the checkpoint {current.name} in {current.parent} ({error.strerror or error}); the "
                "checkpoints already there are intact. Free space there (or make it writable), then resume with "
                "--ckpt_path last",
            ) from error
        except BaseException:
            for written in tmps:
                written.unlink(missing_ok=True)
            raise

    def _write(self, checkpoint: dict[str, Any], f: BinaryIO) -> None:  # tests.faults.DiskFullOnSave cuts it short
        with crc32_off_in_this_thread() if not self.crc32 else contextlib.nullcontext():
            torch.save(checkpoint, f)

    def load_checkpoint(self, path: FilePath, map_location: Any = "cpu", weights_only: bool | None = None) -> dict:
        self.wait()
        if "://" in str(path):
            return super().load_checkpoint(path, map_location, weights_only=True)
        if not Path(path).is_file():
            raise FileNotFoundError(f"Checkpoint file not found: {path}")
        return load_checkpoint_file(path, map_location=map_location)


class OneFilePerPoint(Callback):
    """Tells the template's checkpoint writer (``AtomicCheckpointIO``) when training moves on from a point, so that
    the saves of that point (the best-k, every-2-epochs and ``last.ckpt`` files of one validation) are written as
    one file under their names, holding the state after the last of them. Held between a validation's end and the
    next training batch (or epoch start, or the end of ``fit``): a kill in between loses that point's files, as a
    kill during their write would.

    A name whose save is held or still being written counts as taken when a ``ModelCheckpoint`` asks whether its
    file exists (``file_exists``), as it would once on disk: two of them with the same file name at one point get
    ``name`` and ``name-v1``, Lightning's way, instead of one file that the first one's top k would delete from
    under the other.
    """

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        io = trainer.strategy.checkpoint_io
        if isinstance(io, AtomicCheckpointIO) and stage == "fit":
            io.hold_points = True
            for callback in trainer.checkpoint_callbacks:
                if isinstance(callback, ModelCheckpoint):
                    count_pending_saves_as_files(callback, _pending_write(io))

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._close(trainer)

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._close(trainer)

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._close(trainer)
        for callback in trainer.checkpoint_callbacks:
            restore_file_exists(callback)  # the class's own again

    def _close(self, trainer: L.Trainer) -> None:
        io = trainer.strategy.checkpoint_io
        if isinstance(io, AtomicCheckpointIO):
            io.close_point()


def _pending_write(io: AtomicCheckpointIO) -> Callable[[FilePath, L.Trainer], bool]:
    def pending(filepath: FilePath, trainer: L.Trainer) -> bool:
        # rank 0 alone writes; every rank takes the same decision (one more collective, at a save only)
        return trainer.strategy.reduce_boolean_decision(trainer.is_global_zero and io.claims(filepath), all=False)

    return pending


def wait_for_writes(trainer: Any) -> None:
    """Returns once the trainer's background checkpoint writes are on disk; raises the first that failed."""
    io = trainer.strategy.checkpoint_io
    if isinstance(io, AtomicCheckpointIO):
        io.wait()
