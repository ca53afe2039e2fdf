"""What the engine saves, always: the ``checkpoints:`` section of a config (``--checkpoints.KEY``).

Lightning's way to configure a run is ``trainer.callbacks`` / ``trainer.plugins`` lists, and a config that sets
its own list replaces the base config's. Had ``last.ckpt`` (on a timer, at the end, on SIGTERM/SIGUSR1/Ctrl-C),
the atomic writer, the run summary and the learning-rate curve been entries of those lists, a user's own
``callbacks: [ModelCheckpoint(...)]`` would have switched them all off, silently. Here the CLI adds them to
whatever the lists hold; what may be switched off is a setting below, and the start line says what is off.
"""

from datetime import timedelta
from typing import Any

from lightning.pytorch.callbacks import Callback, LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.plugins.io import CheckpointIO

from lightkeep.checkpoint_io import AtomicCheckpointIO
from lightkeep.judge import RunSummary
from lightkeep.last_checkpoint import LastCheckpoint

PERIODIC_FILENAME = "epoch{epoch:03d}"


class CheckpointPolicy:
    """``last.ckpt`` and the kept files of every run, and how they are written.

    Args:
        last_every: How often ``last.ckpt`` is refreshed during training, e.g. ``"0:10:00"`` (also at the end of
            ``fit``, and on SIGTERM, SIGUSR1 and Ctrl-C before exiting). A hard crash loses at most this much of
            training beyond the newest other checkpoint.
        every_n_epochs: Keep a checkpoint every this many epochs (``epoch{epoch:03d}.ckpt``, all kept, as the blog
            saved its train state every 2 epochs); ``null``: none.
        background: Write checkpoints in a background thread: the loop waits only for the copy of the state to
            host memory. ``false``: every save waits for its write and fsync.
        crc32: Compute the zip checksums of each file, for tools that check them (``unzip -t``); ``torch.load``
            never reads them, and they cost half a write's CPU time.
    """

    def __init__(
        self,
        last_every: timedelta = timedelta(minutes=10),
        every_n_epochs: int | None = 2,
        background: bool = True,
        crc32: bool = False,
    ) -> None:
        if last_every <= timedelta(0):
            raise ValueError(f"checkpoints.last_every ({last_every}) must be > 0, e.g. '0:10:00'")
        if every_n_epochs is not None and every_n_epochs < 1:
            raise ValueError(f"checkpoints.every_n_epochs ({every_n_epochs}) must be >= 1, or null for none")
        self.last_every, self.every_n_epochs = last_every, every_n_epochs
        self.background, self.crc32 = background, crc32
        self.last: LastCheckpoint | None = None  # the run's, once callbacks() has chosen it

    def callbacks(self, given: list[Callback]) -> list[Callback]:
        """The engine's savers and reporters, to put beside ``given`` (the config's list). One of a kind: a config
        that still lists one (a copy made before this version) keeps its own, and a callback with the state key of
        one of ``given`` (Lightning refuses two) is left out. The CLI hands the summary its judge later."""
        wanted: list[Callback] = [LastCheckpoint(train_time_interval=self.last_every)]
        if self.every_n_epochs is not None:
            wanted.append(ModelCheckpoint(every_n_epochs=self.every_n_epochs, save_top_k=-1, filename=PERIODIC_FILENAME,
                                          auto_insert_metric_name=False))  # fmt: skip
        wanted += [LearningRateMonitor(logging_interval="step"), RunSummary()]
        single = (LastCheckpoint, LearningRateMonitor, RunSummary)
        keys, kinds = {g.state_key for g in given}, {type(g) for g in given}
        added = [c for c in wanted if c.state_key not in keys and not (isinstance(c, single) and type(c) in kinds)]
        self.last = next((c for c in [*given, *added] if isinstance(c, LastCheckpoint)), None)
        return added

    def notes(self) -> list[str]:
        """Where the engine's own files went other than their usual names, for the start line."""
        return [self.last.moved] if self.last is not None and self.last.moved else []

    def plugins(self, given: list[Any]) -> list[Any]:
        """``given`` (the config's plugins) with the atomic writer, unless one of them is a ``CheckpointIO``: the
        user's own writer is used as it is, and the start line says it is not the engine's."""
        if any(isinstance(p, CheckpointIO) for p in given):
            return given
        return [*given, AtomicCheckpointIO(background=self.background, crc32=self.crc32)]

    def off(self, trainer: Any) -> list[str]:
        """What of this policy the run does without, for the start line (``lightkeep.guarantees``)."""
        off = [] if self.every_n_epochs is not None else ["periodic checkpoints (checkpoints.every_n_epochs null)"]
        io = trainer.strategy.checkpoint_io
        if not isinstance(io, AtomicCheckpointIO):
            off.append(
                f"atomic saves: trainer.plugins' {type(io).__name__} writes the checkpoints, so a kill during a save "
                "can leave a damaged last.ckpt (--ckpt_path last then takes the newest whole one)"
            )
        return off
