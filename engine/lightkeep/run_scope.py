"""What a run changes in its process, it changes for the run only: ``cli_main`` runs each invocation inside
``for_the_run()``, and once that returns or raises, the process is as it was before.

- the console's filters (``lightkeep.console``): ``warnings.filters`` back to the list it was, the logging
  filters removed;
- the heap frozen out of the garbage collector's full passes (``gc.freeze``), unfrozen after; left alone when the
  caller had frozen objects of its own (no way to unfreeze only ours);
- ``self.log``'s skipped moves (``compat_logging.skip_moves_already_done``), Lightning's own ``_ResultMetric.to`` after;
- progress-bar values read at a bar's refresh, from host copies (``compat_logging.read_bar_values_without_waiting``),
  Lightning's conversion at every batch end after;
- ``sync_dist=True`` epoch means weighed by every rank's samples (``compat_logging.weigh_synced_means_by_samples``),
  Lightning's own ``_ResultMetric.compute`` after;
- the SIGINT, SIGTERM and SIGUSR1 handlers (``lightkeep.signals``, Lightning's), the caller's again after.
- ``PROJECT_RUN_DIR``, the run folder rank 0 claimed for the ranks it starts (``lightkeep.runs``), as it was;
- torch's float32 matmul precision (``speed.matmul_precision``, set before the Trainer is built), as it was.

``KeepFreedHostMemory`` (``speed.keep_freed_host_memory``), a callback, undoes its malloc setting itself; the
checkpoint writer's CRC-32 setting is per thread (``compat_torch.crc32_off_in_this_thread``).
"""

import contextlib
import gc
import os
import signal
import threading
from collections.abc import Callable, Iterable, Iterator

import torch

from lightkeep.compat_logging import (
    read_bar_values_without_waiting,
    skip_moves_already_done,
    weigh_synced_means_by_samples,
)
from lightkeep.console import quiet_console
from lightkeep.runs import RUN_DIR_ENV

SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGUSR1") if hasattr(signal, name))
_freezing = False  # whether the run in progress froze the heap (and unfreezes it after)


@contextlib.contextmanager
def for_the_run() -> Iterator[None]:
    global _freezing
    put_back_handlers = handlers_kept(SIGNALS)
    # Python's full garbage collections walk every object alive, and importing Lightning leaves ~450k of them: one
    # pass cost 0.22 s of start-up here, more came during training, and the one at exit 1.2 s. Objects frozen now
    # are left out of those passes (the few dozen that are already garbage are kept); later ones are collected.
    freeze = not _freezing and gc.get_freeze_count() == 0
    undo_moves = undo_bar = undo_means = lambda: None
    run_dir = os.environ.get(RUN_DIR_ENV)
    matmul_precision = torch.get_float32_matmul_precision()  # speed.matmul_precision's, set for the run
    try:
        with quiet_console():
            if freeze:
                _freezing = True
                gc.freeze()
            undo_moves = skip_moves_already_done()  # each self.log no longer walks its stored result (0.28 ms)
            undo_bar = read_bar_values_without_waiting()  # no device sync per prog_bar value and step
            undo_means = weigh_synced_means_by_samples()  # sync_dist means over ranks of unequal shares: exact
            yield
    finally:
        if run_dir is None:
            os.environ.pop(RUN_DIR_ENV, None)
        else:
            os.environ[RUN_DIR_ENV] = run_dir
        torch.set_float32_matmul_precision(matmul_precision)
        undo_means()
        undo_bar()
        undo_moves()
        if freeze:
            gc.unfreeze()
            _freezing = False
        put_back_handlers()


def handlers_kept(signums: Iterable[int]) -> Callable[[], None]:
    """The one way the engine sets signal handlers back (the run's here, a stage's in ``lightkeep.signals``): the
    handlers of ``signums`` as they are now, and a function that sets them back. Only the main thread can set a
    handler, so elsewhere nothing is kept; a handler set outside Python (``None``) cannot be set again."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    kept = {s: signal.getsignal(s) for s in signums}

    def put_back() -> None:
        for signum, handler in kept.items():
            if handler is not None and signal.getsignal(signum) is not handler:
                signal.signal(signum, handler)

    return put_back


def freeze_what_was_built() -> None:
    """The parsers, config and objects a run just built are frozen too, if the run froze the heap."""
    if _freezing:
        gc.freeze()


def heap_frozen() -> bool:
    return _freezing
