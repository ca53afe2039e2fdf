"""What the ranks agree on at a training batch end without a collective the host waits for at each step (Lightning's
SIGTERM handling and ``ModelCheckpoint``'s timer each broadcast rank 0's decision at every batch end): every
``AGREE_EVERY`` batches each rank starts an all-reduce of its flags that nobody waits for, and every rank reads the
sums ``AGREE_EVERY`` batches later, the same on all of them, and acts on them at that batch's end. A flag set on any
rank is thus acted on by every rank at one batch end, within ``2 x AGREE_EVERY`` training batches. None is left under
way past an epoch's end: its sums are read there and acted on at the next batch end. The preemption stop
(``signals``) and the timed ``last.ckpt`` (``last_checkpoint``) agree this way under DDP; one process decides alone.
"""

from typing import Any

import torch
import torch.distributed as dist

# Training batches between two starts of an agreement, and between a start and its read.
AGREE_EVERY = 10


class Agreement:
    """Every rank's flags summed over the ranks without waiting: ``start(flags)`` begins an all-reduce that nothing
    waits for; ``sums()``, called by every rank at the same point some batches later, gives the same sums on every
    rank. On a GPU the sums are copied into pinned host memory behind the all-reduce, so that reading them waits for
    that copy only (long done), never for the rest of the device's queue. Like any collective, each rank calls both
    in the same order relative to its other collectives (gloo and NCCL match them by order)."""

    def __init__(self, device: torch.device, size: int) -> None:
        self.cuda = device.type == "cuda"
        self.flags = torch.zeros(size, dtype=torch.int32, device=device)  # (size,) this rank's, then the sums
        self.host = torch.zeros(size, dtype=torch.int32, pin_memory=self.cuda)  # on a GPU: the flags in, the sums out
        self.work: Any = None  # the all-reduce under way
        self.copied: Any = None  # on a GPU: the event after the copy of the sums into self.host

    @property
    def pending(self) -> bool:
        return self.work is not None

    def start(self, flags: list[int]) -> None:
        values = torch.tensor(flags, dtype=torch.int32)
        if self.cuda:  # the previous sums() waited for everything that used self.host
            self.host.copy_(values)
            self.flags.copy_(self.host, non_blocking=True)
        else:
            self.flags.copy_(values)
        self.work = dist.all_reduce(self.flags, async_op=True)
        if self.cuda:
            self.work.wait()  # NCCL: the current stream waits for the all-reduce, the host does not
            self.host.copy_(self.flags, non_blocking=True)
            self.copied = torch.cuda.Event()
            self.copied.record()

    def sums(self) -> list[int]:
        """The sums of the last ``start`` (every rank started it, some batches ago), which is then over."""
        work, self.work = self.work, None
        if self.cuda:
            self.copied.synchronize()
            return self.host.tolist()
        work.wait()  # gloo: done long ago unless a rank lags that far
        return self.flags.tolist()
