"""A run leaves its process as it found it: ``cli_main(args)`` returns with the same signal handlers, warning and
logging filters, garbage collector, torch settings, Lightning classes and malloc thresholds as before."""

import ctypes
import gc
import logging
import signal
import sys
import warnings

import pytest
import torch
from lightning.pytorch.trainer.connectors.logger_connector.result import _ResultMetric

from lightkeep.speed import host_memory
from tests.helpers import QUIET, cli_in_process


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]  # fmt: skip


def mmapped_block_count(size: int) -> int:
    """How many more blocks glibc holds in mmapped memory while one of ``size`` bytes is allocated: 1 when that size
    is over the mmap threshold, 0 when it comes from the heap."""
    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = _MallInfo2
    libc.malloc.restype = ctypes.c_void_p
    before = libc.mallinfo2().hblks
    block = libc.malloc(size)
    try:
        return libc.mallinfo2().hblks - before
    finally:
        libc.free(ctypes.c_void_p(block))


def comes_from_fresh_pages(size: int) -> bool:
    """Whether glibc mmaps a block of ``size`` bytes once the heap's free chunks that could hold one are used up:
    under an mmap threshold at most ``size`` the first block that the heap cannot serve is mmapped; under a higher
    one every block comes from the heap, grown as needed. (A single block says nothing: a free chunk that an
    earlier test's run left in the heap serves it whatever the threshold.)"""
    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = _MallInfo2
    libc.malloc.restype = ctypes.c_void_p
    start = libc.mallinfo2()
    blocks = []
    try:
        for _ in range(start.fordblks // size + 2):  # each block from the heap uses up >= size of its free bytes
            blocks.append(libc.malloc(size))
            if libc.mallinfo2().hblks > start.hblks:
                return True
        return False
    finally:
        for block in blocks:
            libc.free(ctypes.c_void_p(block))


def process_state() -> dict:
    return {
        "signal handlers": {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)},
        "warning filters": list(warnings.filters),
        "logging filters": {  # of every logger that has any
            name: list(log.filters)
            for name, log in logging.root.manager.loggerDict.items()
            if isinstance(log, logging.Logger) and log.filters
        },
        "gc": (gc.get_freeze_count(), gc.isenabled(), gc.get_threshold()),
        "torch CRC-32": torch.serialization.get_crc32_options(),
        "_ResultMetric.to": _ResultMetric.__dict__["to"],
        "_ResultMetric.compute": _ResultMetric.__dict__["compute"],
        "engine's malloc thresholds in force": getattr(host_memory, "in_force", None),
    }


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_a_run_leaves_signals_filters_gc_patches_and_malloc_as_it_found_them(tmp_path):
    gc.collect()
    was_frozen = gc.get_freeze_count()
    if was_frozen:  # an earlier run in this process left its heap frozen: what this test is about
        gc.unfreeze()
    # handlers of the caller's own, as an IPython kernel has
    previous = {s: signal.signal(s, lambda *_: None) for s in (signal.SIGINT, signal.SIGUSR1)}
    try:
        before = process_state()
        cli_in_process("fit", *QUIET, "--trainer.accelerator", "cpu", "--trainer.max_epochs", "1",
                       "--trainer.limit_train_batches", "2", "--trainer.limit_val_batches", "1",
                       root=tmp_path)  # fmt: skip
        after = process_state()
        changed = [f"{what}: {before[what]} -> {after[what]}" for what in before if after[what] != before[what]]
        assert not changed, "changed by the run:\n" + "\n".join(changed)
        # glibc's own threshold after the run (its 128 KiB, or higher only where it rose dynamically, which the
        # engine's 32 MiB never does): a 33 MiB block is always mmapped, and a 4 MiB one no longer comes from the
        # engine's 32 MiB heap
        assert mmapped_block_count(33 * 2**20) == 1, "precondition: mallinfo2 counts mmapped blocks"
        assert comes_from_fresh_pages(4 * 2**20), "malloc's mmap threshold is still the engine's 32 MiB"
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        if was_frozen:
            gc.freeze()
