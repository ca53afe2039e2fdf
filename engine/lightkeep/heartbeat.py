"""A rank's beat on its machine: a few bytes of a file in the temporary folder, mapped into the rank's memory, that its
hooks store into (no system call, no device sync) and that the ranks of its machine read as it is
(``lightkeep.liveness`` carries it to other machines)."""

import contextlib
import mmap
import os
import re
import struct
import tempfile
import time
from pathlib import Path

PREFIX = "project-heartbeat"
# One beat in memory: the time its thread last ran, the time of its last progress (time.monotonic(): one clock for
# every process of a machine), the global step, what it was doing (an index of WHAT), where in the training loop it
# was (3 x training batches begun + 0, 1, 2 for a batch's start, backward, end; -1 outside training), its process
# and its global rank.
CELL = struct.Struct("<ddqqqqq")
ALIVE, PROGRESS = struct.Struct("<d"), struct.Struct("<dqqq")  # at offsets 0 and 8
NOTE = struct.Struct("<400s")  # after the cell: the first line of the rank's own exception, UTF-8, zero-padded


def process_state(pid: int) -> str:
    """``"running"``, ``"stopped"`` (SIGSTOP, a debugger) or ``"gone"`` (a zombie too) for a process of this
    machine."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return "gone"
        except PermissionError:
            pass  # another user's
        return "running"
    return "gone" if state in (b"Z", b"X") else "stopped" if state in (b"T", b"t") else "running"


class Heartbeat:
    """This rank's beat, mapped into memory: ``beat`` and ``alive`` store into it, this machine's ranks read the
    file (``read_cell``)."""

    def __init__(self, path: Path, rank: int) -> None:
        self.path = path
        tmp = path.with_name(f"{path.name}.tmp")
        with open(tmp, "w+b") as f:  # whole before it has its name: a reader sees all of it or none
            f.write(CELL.pack(time.monotonic(), time.monotonic(), 0, 0, -1, os.getpid(), rank) + NOTE.pack(b""))
            f.flush()
            self._cell = mmap.mmap(f.fileno(), CELL.size + NOTE.size)
        os.replace(tmp, path)

    def beat(self, step: int, what: int, point: int = -1) -> None:
        PROGRESS.pack_into(self._cell, 8, time.monotonic(), step, what, point)

    def alive(self) -> None:
        ALIVE.pack_into(self._cell, 0, time.monotonic())

    def cell(self) -> tuple[float, float, int, int, int, int, int]:
        return CELL.unpack(self._cell[: CELL.size])

    def note(self, text: str) -> None:
        NOTE.pack_into(self._cell, CELL.size, text.encode()[: NOTE.size])

    def close(self) -> None:
        self.path.unlink(missing_ok=True)
        self._cell.close()


def read_cell(path: Path) -> tuple[float, float, int, int, int, int, int] | None:
    try:
        data = path.read_bytes()
    except OSError:
        return None
    return CELL.unpack(data[: CELL.size]) if len(data) == CELL.size + NOTE.size else None


def read_note(path: Path) -> str | None:
    try:
        data = path.read_bytes()
    except OSError:
        return None
    note = data[CELL.size :].rstrip(b"\0").decode(errors="replace") if len(data) == CELL.size + NOTE.size else ""
    return note or None


def remove_heartbeats_of_ended_runs() -> None:
    """The heartbeats that ranks killed at once (kill -9) left in the temporary folder."""
    for path in Path(tempfile.gettempdir()).glob(f"{PREFIX}-*"):
        match = re.fullmatch(rf"{PREFIX}-(\d+)-\w+-\d+(?:\.tmp)?", path.name)
        if match and process_state(int(match[1])) == "gone":
            with contextlib.suppress(OSError):
                path.unlink()
