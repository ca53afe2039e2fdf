"""Host memory a training step frees stays with the process for the next step, instead of going back to the kernel
and being faulted in again, page by page, zeroed: ``KeepFreedHostMemory``, the setting
``speed.keep_freed_host_memory`` (on by default), for CPU runs only, named in the start
line and undone when the run ends."""

import ctypes
import os
import sys
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback

# glibc's mallopt parameters (malloc.h) and the values set
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD = 32 * 2**20  # the largest glibc accepts: blocks up to 32 MiB come from the heap, reused
TRIM_THRESHOLD = 2**30  # free memory at the heap's top is returned to the kernel only beyond 1 GiB
ENVIRONMENT = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_", "GLIBC_TUNABLES")
GLIBC_DEFAULT = 128 * 2**10  # both thresholds' values in a process that never set them
in_force = False  # whether the thresholds above are set now (by keep_freed_host_memory)


def keep_freed_host_memory() -> bool:
    """Sets glibc's malloc to keep freed blocks up to 32 MiB for reuse; ``True`` if it did.

    A CPU step allocates and frees the same tensors every step (gradients, the optimizer's temporaries). glibc
    serves blocks over its mmap threshold with fresh pages and gives freed memory at the heap's top back to the
    kernel once it exceeds its trim threshold; both move with the allocation history, so from one process to the
    next, the 2048-wide MLP's step either reused its memory or faulted 4,000-8,000 zeroed pages back in (~20% of a
    60 ms step here). Fixed thresholds make every step reuse it, as CUDA's caching allocator does on a GPU. The cost:
    a process keeps up to its peak of freed blocks (and 1 GiB at the heap's top) instead of returning them.

    Left alone where the environment already tunes malloc (``MALLOC_TRIM_THRESHOLD_=131072`` restores glibc's
    behaviour), and where the C library is not glibc.
    """
    if not sys.platform.startswith("linux") or any(name in os.environ for name in ENVIRONMENT):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # no mallopt (not glibc)
        return False
    global in_force
    in_force = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    return in_force


def give_freed_host_memory_back() -> None:
    """Sets both thresholds back to glibc's starting values (128 KiB), if ``keep_freed_host_memory`` set them.

    glibc offers no way back to its *dynamic* mmap threshold (which rises to the size of the largest mmapped block
    freed, up to 32 MiB): once any threshold is set it stays fixed. So after a run, blocks over 128 KiB come from
    fresh pages and the heap top is trimmed beyond 128 KiB: glibc's documented defaults, never the engine's.
    The free memory the run kept at the heap's top (up to the engine's 1 GiB) is given back now (``malloc_trim``):
    glibc trims only when a later ``free`` crosses the threshold, and until then the next blocks over 128 KiB would
    still come from that heap instead of fresh pages.
    """
    global in_force
    if in_force:
        libc = ctypes.CDLL(None)
        libc.mallopt(M_MMAP_THRESHOLD, GLIBC_DEFAULT)
        libc.mallopt(M_TRIM_THRESHOLD, GLIBC_DEFAULT)
        libc.malloc_trim(0)
        in_force = False


class KeepFreedHostMemory(Callback):
    """``keep_freed_host_memory`` while a run on CPUs lasts (from ``setup`` to ``teardown``, or its failure).

    On a GPU the tensors a step frees go back to CUDA's caching allocator, and the host has nothing to gain, so a run
    on another accelerator leaves malloc alone. Data loader workers forked during the run inherit the setting.

    Args:
        enabled: ``false`` leaves malloc as it is (e.g. to measure without it).
    """

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.applied = False

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self.enabled and not in_force and trainer.strategy.root_device.type == "cpu":
            self.applied = keep_freed_host_memory()

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._undo()

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._undo()  # Lightning skips teardown after a failure

    def _undo(self, *_: Any) -> None:
        if self.applied:
            give_freed_host_memory_back()
            self.applied = False
