"""``last.ckpt`` on a time interval, and always at the end of ``fit``: the default checkpoint policy's refresh."""

from datetime import timedelta

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint

from steadfast.compat import save_last_unless_saved_at_this_step


class LastCheckpoint(ModelCheckpoint):
    """A ``ModelCheckpoint`` that writes only ``last.ckpt``: every ``train_time_interval`` of training and once
    more when ``fit`` ends, so the file always holds the final state of a finished run.

    A time, not a step count: a save costs the same whatever the step takes, so a 1 GB model is not saved every
    few seconds and a 2 ms step not every 50 steps. Between refreshes, a hard crash resumes from the newest of the
    other checkpoints (``--ckpt_path last`` takes the newest file of the run); SIGTERM, SIGUSR1 and Ctrl-C save
    ``last.ckpt`` first (``steadfast.signals``). Lightning's own end-of-fit save writes ``last.ckpt`` only if
    none was written during the fit, which leaves it up to ``train_time_interval`` old.

    Args:
        train_time_interval: How often ``last.ckpt`` is refreshed, e.g. ``"0:10:00"``.
        dirpath: Where; ``None``: the run's ``checkpoints/`` folder.
    """

    def __init__(self, train_time_interval: timedelta = timedelta(minutes=10), dirpath: str | None = None) -> None:
        super().__init__(
            dirpath=dirpath,
            train_time_interval=train_time_interval,  # jsonargparse reads "0:10:00" as a timedelta
            save_top_k=0,
            save_last=True,
            enable_version_counter=False,  # ModelCheckpoints writing last.ckpt share the file, never last-v1.ckpt
        )

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        save_last_unless_saved_at_this_step(self, trainer)
