"""Checkpoint files written so that a kill or a full disk at any moment cannot corrupt them: an atomic rename, in
the background, the saves of one point of training as one file under their names."""

import contextlib
import errno
import os
import sys
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO

from lightkeep.checkpoint_files import FilePath, load_checkpoint_file
from lightkeep.compat_torch import crc32_off_in_this_thread
from lightkeep.host_snapshot import HostSnapshot
from lightkeep.run_checkpoints import ResumeError, checkpoints_newest_first, read_global_step


class CheckpointWriteError(OSError):
    """A checkpoint that could not be written (a full disk, a read-only or lost folder). ``strerror`` is the whole
    message: the file, why, the newest checkpoint there (intact: the write went to a ``.tmp``) and the fix; it
    ends with "resume with --ckpt_path last", which the CLI follows with the command (``one_line_errors``)."""


@dataclass
class _Point:
    """The saves of one point of training held back until training moves on: written once, under every name."""

    checkpoint: dict[str, Any]  # the last save's: every callback's state as it stands after all of them saved
    paths: list[Path]
    removals: list[Path] = field(default_factory=list)  # done after the write, as they were asked for after saves


class AtomicCheckpointIO(TorchCheckpointIO):
    """Writes ``<name>.tmp`` beside the target, fsyncs it and renames it over the target; in the background.

    A rename within one directory is atomic on POSIX filesystems (Lightning's own save goes through a temporary file
    in the system temp folder, which is a copy, not a rename, when that folder is on another filesystem). A failed
    write removes the ``.tmp`` and raises ``CheckpointWriteError``. What the atomic, background writes and the one
    file per point of training guarantee, what a save costs and what a failed write says: docs/checkpoints.md,
    'Atomic writes, in the background', 'Saves and their knobs'. Local paths only; remote URLs fall back to
    Lightning's writer.

    One thread writes, fsyncs and renames, one file after the other, and removes the files ModelCheckpoint drops
    from its top k in the same queue, so a removal never overtakes the write of its file; the removals queued after
    a failed write are not done. Lightning's ``AsyncCheckpointIO`` queues without bound (a copy per save), copies on
    the GPU, and removes files while their writes are queued (Lightning issue #14035). Every write is finished
    before ``fit`` returns or raises (``teardown``), before a preemption or Ctrl-C exit (``signals``), and before a
    checkpoint is loaded. While ``OneFilePerPoint`` runs, the saves of one point are held until training moves on; a
    save while another of its point is already being written is written on its own.

    The zip's CRC-32 is left out by the writing thread's ``torch.save`` only (torch keeps that setting per thread;
    where a torch version keeps it for the whole process, every file gets its CRC-32); ``unzip -t`` then reports the
    records as damaged.

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
        self._write_failed = False  # set by the writer: the removals queued after a failed write are skipped

    def save_checkpoint(self, checkpoint: dict[str, Any], path: FilePath, storage_options: Any | None = None) -> None:
        # SLURM's hpc_ckpt: Lightning requeues the job right after this returns, and the job is killed soon after,
        # so the file must be whole by then
        if "://" in str(path) or not self.background or Path(path).name.startswith("hpc_ckpt_"):
            self.wait()
            if "://" in str(path):
                return super().save_checkpoint(checkpoint, path, storage_options)
            return self._save_atomically(checkpoint, Path(path))
        if any(f.done() and f.exception() is not None for f in self._queued):
            self.wait()  # raises a write that failed
        # a wait writes what is held first; a point held is one no training batch has changed since
        on_host = self._snapshot.take(checkpoint, before_copying=self.wait, untrained=self._held is not None)
        path = Path(path)
        # its folder now, not with the file: ModelCheckpoint(save_last="link") links last.ckpt to the file right
        # after this returns, and a link into a folder not yet there failed the run at its first save
        path.parent.mkdir(parents=True, exist_ok=True)
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
            self._submit(self._remove_unless_a_write_failed, path)  # after the writes queued before it, its own too
        else:
            super().remove_checkpoint(path)

    def _remove_unless_a_write_failed(self, path: FilePath) -> None:
        if not self._write_failed:  # else it may be the newest complete file left: the one to resume from
            super().remove_checkpoint(path)

    def close_point(self) -> None:
        """Training moved on: the saves held for the point just left are queued for the writer."""
        held, self._held = self._held, None
        if held is not None:
            # last.ckpt too: this writer rewrites it by a rename, never into the file, so the names linked to it
            # keep their bytes; a fit with another writer gives it a file of its own first (OneFilePerPoint)
            self._submit(self._save_atomically, held.checkpoint, *held.paths)
            for path in held.removals:
                self._submit(self._remove_unless_a_write_failed, path)

    def wait(self) -> None:
        """Returns once every save (held ones too) and removal is done; raises the first that failed."""
        self.close_point()
        queued, self._queued = self._queued, []
        errors = [f.exception() for f in queued]
        self._write_failed = False  # said now, by the raise below
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
            said = error.strerror if isinstance(error, OSError) and error.strerror else error
            print(f"error: {said}", file=sys.stderr)  # beside the error the run is already failing with
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
        except BaseException as error:
            for written in tmps:
                with contextlib.suppress(OSError):  # a read-only folder refuses this too: its own error is the one
                    written.unlink(missing_ok=True)
            cause = _os_error(error) if isinstance(error, OSError | RuntimeError) else None
            if cause is None:
                raise
            self._write_failed = True
            raise CheckpointWriteError(cause.errno, _could_not_save(current, cause)) from error

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


def _os_error(error: BaseException) -> OSError | None:
    """The ``OSError`` that made a write fail: ``error`` itself, or the one under torch's ``RuntimeError``."""
    seen: BaseException | None = error
    while seen is not None and not isinstance(seen, OSError):
        seen = seen.__cause__ or seen.__context__
    return seen


def _could_not_save(path: Path, error: OSError) -> str:
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        fix = "Free space there"
    elif error.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        fix = "Make the folder writable"
    elif error.errno == errno.EFBIG:
        fix = "Allow larger files there (ulimit -f, the file system's own limit)"
    else:
        fix = "Fix the folder (its disk, its mount)"
    for newest in checkpoints_newest_first(path.parent, "*.ckpt"):
        try:
            intact = f"the earlier checkpoint {newest} (step {read_global_step(newest)}) is intact"
            break
        except ResumeError:
            continue
    else:
        intact = "no earlier checkpoint is there"
    return (
        f"could not save the checkpoint {path.name} in {path.parent}: {error.strerror or error} (writing "
        f"{path.name}.tmp); {intact}. {fix}, then resume with --ckpt_path last"
    )


def wait_for_writes(trainer: Any) -> None:
    """Returns once the trainer's background checkpoint writes are on disk; raises the first that failed."""
    io = trainer.strategy.checkpoint_io
    if isinstance(io, AtomicCheckpointIO):
        io.wait()
