"""The counter of scripts/count_syncs.py: a ``TorchDispatchMode`` that sees each op before it runs and counts those
that read a device value on the host, by the source the Python stack at the op names; and, under DDP, the collectives
(``c10d`` ops, which go through the dispatcher too): blocking ones (``torch.distributed``'s function called without
``async_op``), where the host waits for every rank, apart from those nothing waits for (``async_op=True``, and those
DDP starts from C++ for its gradient buckets, which a GPU waits for on its stream).
"""

import json
import os
import sys
import threading
import warnings
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

REPO = Path(__file__).resolve().parent.parent
aten = torch.ops.aten
# ops whose result the host must see: a scalar read, or an output whose size depends on the values
HOST_VALUE_OPS = {
    aten._local_scalar_dense.default,
    aten.is_nonzero.default,
    aten.equal.default,
    aten.nonzero.default,
    aten.masked_select.default,
    aten._unique2.default,
    aten.unique_consecutive.default,
    aten.repeat_interleave.Tensor,
}
COPY_OPS = {aten._to_copy.default, aten.copy_.default}
# (path fragment, source), by priority: the first that any frame of the stack at the op matches names the source
# (torchmetrics called from module.py is torchmetrics'; module.py called from Lightning's loop is module.py's)
HOST_CODE = (
    ("/torch/optim/", "host: optimizer step counters"),
    ("/torch/utils/data/", "host: sampler"),
    # copies the engine staged into host memory steps before (pinned, non-blocking on a GPU): read without waiting
    ("/lightkeep/guards.py:_read_staged", "host: staged copies"),
    ("/lightkeep/agreement.py:sums", "host: staged copies"),  # the ranks' agreements (a stop, last.ckpt's timer)
    ("/lightkeep/compat_logging.py:_staged_bar_values", "host: staged copies"),
)
SOURCES = (
    # under DDP: Lightning's per-step agreement on a SIGTERM (Lightning issue #21487), a ModelCheckpoint's check of
    # its train_time_interval on rank 0's clock (the engine's timed last.ckpt is one)
    ("/lightning/pytorch/loops/training_epoch_loop.py:_broadcast_sigterm_tensor", "lightning: SIGTERM broadcast"),
    ("/lightning/pytorch/callbacks/model_checkpoint.py:on_train_batch_end", "lightning: checkpoint timer"),
    ("/torchmetrics/", "torchmetrics"),
    ("/lightning/pytorch/callbacks/progress/", "lightning: progress bar"),
    ("/lightning/pytorch/trainer/connectors/logger_connector/", "lightning: logging"),
    ("/lightning/pytorch/loggers/", "lightning: logging"),
    ("/engine/lightkeep/", "engine"),
    ("/lightning/pytorch/callbacks/", "lightning: other callbacks"),
    ("/project/module.py", "module.py"),
    ("/scripts/benchmark", "the script's own code"),
    ("/project/", "project: other"),
    ("/lightning/", "lightning: loop"),
)
HOST_ONLY = tuple(source for _, source in HOST_CODE)
# what torch.cuda.set_sync_debug_mode("warn") says at each synchronizing CUDA call (torch/csrc/cuda/...)
CUDA_SYNC_WARNING = "called a synchronizing CUDA operation"


class SyncCounter(TorchDispatchMode):
    """Counts the ops that read a device value on the host, by source, on the thread that installed it, and the
    collectives, blocking or not; ``step()`` names the optimizer step in progress, so that the steps at which the host
    waits at least once (a read or a blocking collective: each drains a GPU's queue) are counted too. On a GPU it
    also counts what CUDA itself reports as a synchronization (``torch.cuda.set_sync_debug_mode("warn")``, the
    driver's view: a second opinion on the op list above), in ``cuda_syncs``; ``None`` without CUDA."""

    def __init__(
        self, counting: Callable[[], bool], phase: Callable[[], str], step: Callable[[], int] = lambda: -1
    ) -> None:
        super().__init__()
        self.counting, self.phase, self.step, self.thread = counting, phase, step, threading.get_ident()
        self.epoch_end = 0  # syncs outside the steps: epoch-end metrics, checkpoint decisions after validation
        self.by_source: Counter[str] = Counter()
        self.where: Counter[str] = Counter()  # source: the innermost frame outside torch, file:line
        self.collectives: Counter[str] = Counter()  # blocking, by source
        self.async_collectives: Counter[str] = Counter()  # nothing waits for them on the host, by source
        self.drain_steps: set[int] = set()  # steps with at least one host read of a device value or blocking collective
        self.host_steps: dict[str, set[int]] = {}  # "path (function)" of a host-only read: the steps it read at
        self.stalls = 0  # syncs with device work queued since the previous one: the ones a GPU makes the host wait at
        self.work_since_sync = True
        self.cuda_syncs: int | None = None

    def __enter__(self):  # type: ignore[no-untyped-def]
        if torch.cuda.is_available():
            self.cuda_syncs, self._debug_mode = 0, torch.cuda.get_sync_debug_mode()
            self._warnings = warnings.catch_warnings()
            self._warnings.__enter__()
            warnings.filterwarnings("always", message=f".*{CUDA_SYNC_WARNING}")
            shown = warnings.showwarning

            def count(message, category, *args, **kwargs):  # type: ignore[no-untyped-def]
                if CUDA_SYNC_WARNING not in str(message):
                    return shown(message, category, *args, **kwargs)
                counted = threading.get_ident() == self.thread and self.counting() and self.phase() != "epoch end"
                self.cuda_syncs += counted  # type: ignore[operator]

            warnings.showwarning = count
            torch.cuda.set_sync_debug_mode("warn")
        return super().__enter__()

    def __exit__(self, *exc):  # type: ignore[no-untyped-def]
        if self.cuda_syncs is not None:
            torch.cuda.set_sync_debug_mode(self._debug_mode)
            self._warnings.__exit__(*exc)  # the filters and showwarning as they were
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if threading.get_ident() != self.thread or not self.counting():
            return out
        if func.namespace == "c10d":
            blocking = _blocking_collective()
            source, owner = _source()
            if self.phase() == "epoch end":
                self.epoch_end += blocking
            elif blocking:
                self.collectives[source] += 1
                self.where[f"{source}: {owner} ({func.__name__.split('.')[0]})"] += 1
                self.drain_steps.add(self.step())
                self.stalls += self.work_since_sync
                self.work_since_sync = False
            else:
                self.async_collectives[source] += 1
            return out
        if func in HOST_VALUE_OPS or (func in COPY_OPS and _device_to_host(func, args, kwargs, out)):
            source, owner = _source()
            if self.phase() == "epoch end":
                self.epoch_end += source not in HOST_ONLY
                return out
            self.by_source[source] += 1
            self.where[f"{source}: {owner}"] += 1
            if source not in HOST_ONLY:
                self.drain_steps.add(self.step())
                self.stalls += self.work_since_sync
                self.work_since_sync = False
            else:  # path (function), line left out: the steps at which each reads
                self.host_steps.setdefault(owner.split(":")[0] + owner[owner.rfind(" ") :], set()).add(self.step())
        else:
            self.work_since_sync = True
        return out


def _device_to_host(func, args, kwargs, out) -> bool:  # type: ignore[no-untyped-def]
    src = args[1] if func is aten.copy_.default else args[0]
    dst = args[0] if func is aten.copy_.default else out
    blocking = not kwargs.get("non_blocking", args[2] if func is aten.copy_.default and len(args) > 2 else False)
    return src.device.type != "cpu" and dst.device.type == "cpu" and blocking


def _blocking_collective() -> bool:
    """Whether the collective being dispatched was asked for without ``async_op`` (``torch.distributed``'s functions
    then wait for it before they return); one started from C++ (DDP's buckets) has no such frame: not blocking."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_filename.endswith("distributed_c10d.py") and "async_op" in frame.f_locals:
            return not frame.f_locals["async_op"]
        frame = frame.f_back
    return False


def _source() -> tuple[str, str]:
    """The source of the op being dispatched, and the code that read the value: the innermost frame outside torch's
    own Python (tensor methods, this mode), as ``path:line`` from its package on."""
    files, lines, frame = [], [], sys._getframe(2)
    while frame is not None:
        files.append(f"{frame.f_code.co_filename.replace(os.sep, '/')}:{frame.f_code.co_name}")
        lines.append(frame.f_lineno)
        frame = frame.f_back
    i = next((i for i, f in enumerate(files) if "/torch/" not in f or any(h in f for h, _ in HOST_CODE)), 0)
    path, function = files[i].rsplit(":", 1)
    owner = f"{path.rsplit('site-packages/', 1)[-1].removeprefix(str(REPO) + '/')}:{lines[i]} ({function})"
    for fragment, source in HOST_CODE:
        if fragment in files[i]:
            return source, owner
    for fragment, source in SOURCES:
        if any(fragment in f for f in files):
            return source, owner
    return "other", owner


def write_counts(out: Path, counter: SyncCounter, steps: int) -> None:
    out.write_text(
        json.dumps(
            {
                "steps": steps,
                "by_source": dict(counter.by_source),
                "stalls": counter.stalls,
                "epoch_end": counter.epoch_end,
                "cuda_syncs": counter.cuda_syncs,
                "where": dict(counter.where),
                "collectives": dict(counter.collectives),
                "async_collectives": dict(counter.async_collectives),
                "drain_steps": sorted(counter.drain_steps),
                "host_steps": {owner: sorted(steps) for owner, steps in counter.host_steps.items()},
            }
        )
    )


def rank_file(out: Path, rank: int) -> Path:
    """Where rank ``rank`` of a multi-process run writes what ``out`` holds in one process."""
    return out.with_name(f"{out.stem}.rank{rank}{out.suffix}")
