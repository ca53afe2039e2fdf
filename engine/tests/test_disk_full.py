"""A checkpoint that cannot be written (a full disk, a read-only folder) ends the run in one ``error:`` line: the
file, why, the intact earlier checkpoint and the command that resumes, exit code 1; no earlier checkpoint changes,
and that command resumes once the folder is fixed.

On real file systems. The full disk is a 6 MB tmpfs where this machine lets the test mount one (as root, or with
passwordless sudo); elsewhere it is the process's file-size limit (``RLIMIT_FSIZE``), under which the kernel
refuses a write with EFBIG where a full disk refuses it with ENOSPC, and torch's zip writer turns either into the
same ``RuntimeError: [enforce fail at inline_container.cc] unexpected pos`` (the first test checks it). Each test
prints which one it ran on.
"""

import contextlib
import errno
import hashlib
import os
import resource
import shlex
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from lightkeep.checkpoint_io import AtomicCheckpointIO, CheckpointWriteError
from tests.helpers import QUIET, RUN_NAME, cli, cli_in_process, run_dirs

# 3 steps per epoch; the stand-in's default net makes ~1 MB checkpoints, more than the room left on a full disk
ARGS = [*QUIET, "--trainer.limit_train_batches", "3", "--trainer.limit_val_batches", "2", "--model.warmup", "0"]
ROOM = 400 * 1024  # what a full disk has left: the run's logs and config fit, a checkpoint does not


def as_root(*command: str) -> bool:
    """Runs ``command`` as root (this process, or passwordless sudo); False where neither is allowed or it fails."""
    prefix = [] if os.geteuid() == 0 else ["sudo", "-n"] if shutil.which("sudo") else None
    return prefix is not None and subprocess.run([*prefix, *command], capture_output=True).returncode == 0


class SmallDisk:
    """A folder on a 6 MB tmpfs, or, where nothing may be mounted, a plain folder under a file-size limit."""

    def __init__(self, path: Path) -> None:
        path.mkdir()
        self.path = path
        self.mounted = as_root("mount", "-t", "tmpfs", "-o", "size=6m,mode=1777", "tmpfs", str(path))
        self.errno = errno.ENOSPC if self.mounted else errno.EFBIG
        print("full disk:", "a 6 MB tmpfs" if self.mounted else "RLIMIT_FSIZE (no mount allowed here)")

    @contextlib.contextmanager
    def full(self) -> Iterator[None]:
        """``ROOM`` bytes left: a file fills the rest of the tmpfs (or: no file may grow past ``ROOM``)."""
        if self.mounted:
            stats = os.statvfs(self.path)
            filler = self.path / "filler"
            filler.write_bytes(bytes(stats.f_bavail * stats.f_frsize - ROOM))  # zeros written: tmpfs has no holes
            try:
                yield
            finally:
                filler.unlink()
        else:  # Python ignores SIGXFSZ: a write past the limit fails with EFBIG; children inherit the limit
            soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
            resource.setrlimit(resource.RLIMIT_FSIZE, (ROOM, hard))
            try:
                yield
            finally:
                resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))

    def close(self) -> None:
        if self.mounted:
            assert as_root("umount", str(self.path))


@pytest.fixture
def small_disk(tmp_path) -> Iterator[SmallDisk]:
    disk = SmallDisk(tmp_path / "disk")
    try:
        yield disk
    finally:
        disk.close()


@contextlib.contextmanager
def read_only(folder: Path) -> Iterator[None]:
    """``folder`` made read-only: its mode, or for root (whom a mode does not stop) a read-only bind mount."""
    if os.geteuid() != 0:
        folder.chmod(0o555)
        try:
            yield
        finally:
            folder.chmod(0o755)
        return
    if not (as_root("mount", "--bind", str(folder), str(folder))):
        pytest.fail("as root, a folder is made read-only by a read-only bind mount: mount is not allowed here")
    try:
        assert as_root("mount", "-o", "remount,bind,ro", str(folder))
        yield
    finally:
        assert as_root("umount", str(folder))


def digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.glob("*.ckpt"))}


def state(step: int) -> dict:
    return {"state_dict": {"net.w": torch.full((256, 1024), float(step))}, "global_step": step}  # 1 MB


def the_error_line(proc: subprocess.CompletedProcess) -> str:
    """The one ``error:`` line, the last thing the run printed, without a traceback."""
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and proc.stderr.strip().splitlines()[-1] == errors[0], proc.stderr[-3000:]
    return errors[0]


def test_torchs_runtime_error_on_a_full_disk_is_reported_as_the_disk_and_keeps_every_file(small_disk):
    folder = small_disk.path / "checkpoints"
    io = AtomicCheckpointIO()
    io.save_checkpoint(state(5), folder / "old.ckpt")
    io.save_checkpoint(state(10), folder / "last.ckpt")
    io.wait()
    before = digests(folder)
    with small_disk.full():
        # What torch raises on a full disk: not an OSError, one under a RuntimeError (why the writer looks beneath)
        with open(small_disk.path / "probe", "wb") as f, pytest.raises(RuntimeError, match="unexpected pos") as got:
            torch.save(state(0), f)
        assert isinstance(got.value.__context__, OSError) and got.value.__context__.errno == small_disk.errno
        (small_disk.path / "probe").unlink()
        io.save_checkpoint(state(20), folder / "best.ckpt")  # in the background
        io.remove_checkpoint(folder / "old.ckpt")  # queued behind it, as a top k drops a file after a save
        with pytest.raises(CheckpointWriteError) as failed:
            io.wait()
    assert failed.value.errno == small_disk.errno
    assert failed.value.strerror.startswith(
        f"could not save the checkpoint best.ckpt in {folder}: {os.strerror(small_disk.errno)} (writing "
        f"best.ckpt.tmp); the earlier checkpoint {folder / 'last.ckpt'} (step 10) is intact. "
    )
    assert failed.value.strerror.endswith(", then resume with --ckpt_path last")
    assert digests(folder) == before  # old.ckpt too: the save that was to replace it failed
    assert not list(folder.glob("*.tmp"))
    io.teardown()


@pytest.fixture(scope="module")
def one_epoch(tmp_path_factory) -> Path:
    """A folder holding one finished 1-epoch fit (runs/<RUN_NAME>/version_0, last.ckpt of step 3): the earlier run
    both tests below resume, fitted once and copied (``earlier_run``) rather than once a test."""
    cwd = tmp_path_factory.mktemp("one_epoch")
    cli_in_process("fit", *ARGS, "--trainer.max_epochs", "1", root=cwd / "runs")  # the real CLI, in this process
    return cwd


def earlier_run(one_epoch: Path, cwd: Path) -> None:
    """``one_epoch``'s runs/ copied into ``cwd``; ``cp -a`` keeps the names of one checkpoint file one file (hard
    links: what a 6 MB disk holds) and the mtimes that ``--ckpt_path last`` goes by."""
    subprocess.run(["cp", "-a", str(one_epoch / "runs"), str(cwd)], check=True)


@pytest.mark.slow  # two real fits in subprocesses, after the shared first one
def test_a_full_disk_ends_the_fit_in_one_line_and_the_command_it_prints_resumes_once_space_is_freed(
    small_disk, one_epoch
):
    cwd = small_disk.path
    earlier_run(one_epoch, cwd)
    folder = cwd / "runs" / RUN_NAME / "version_0" / "checkpoints"
    assert torch.load(folder / "last.ckpt", weights_only=True)["global_step"] == 3
    before = digests(folder)
    with small_disk.full():
        proc = cli("fit", *ARGS, "--trainer.max_epochs", "2", "--ckpt_path", "last", cwd=cwd, check=False)
    line = the_error_line(proc)
    relative = f"runs/{RUN_NAME}/version_0/checkpoints"
    assert line.startswith("error: could not save the checkpoint ") and f".ckpt in {relative}: " in line, line
    assert f": {os.strerror(small_disk.errno)} (writing " in line, line
    assert f"; the earlier checkpoint {relative}/last.ckpt (step 3) is intact. " in line, line
    assert digests(folder) == before and not list(folder.glob("*.tmp"))
    # The command it prints, run as printed, once the disk has room again
    command = shlex.split(line.split(", then resume with --ckpt_path last: ", 1)[1])
    assert command[:4] == ["python", "-m", "project", "fit"] and command[-2:] == ["--ckpt_path", "last"]
    proc = cli(*command[3:], cwd=cwd)
    assert f"resuming from {relative}/last.ckpt (global step 3)" in proc.stdout + proc.stderr
    assert torch.load(folder / "last.ckpt", weights_only=True)["global_step"] == 6
    assert run_dirs(cwd) == [folder.parent]


@pytest.mark.slow  # a real fit in a subprocess, after the shared first one
def test_a_read_only_checkpoint_folder_ends_in_the_engines_advice_not_the_clean_ups_error(tmp_path, one_epoch):
    earlier_run(one_epoch, tmp_path)
    folder = tmp_path / "runs" / RUN_NAME / "version_0" / "checkpoints"
    before = digests(folder)
    with read_only(folder):
        proc = cli("fit", *ARGS, "--trainer.max_epochs", "2", "--ckpt_path", "last", cwd=tmp_path, check=False)
    line = the_error_line(proc)
    relative = f"runs/{RUN_NAME}/version_0/checkpoints"
    assert line.startswith("error: could not save the checkpoint ") and f".ckpt in {relative}: " in line, line
    assert f"; the earlier checkpoint {relative}/last.ckpt (step 3) is intact. Make the folder writable" in line
    assert ", then resume with --ckpt_path last: python -m project fit " in line, line
    assert digests(folder) == before and not list(folder.glob("*.tmp"))
