"""What the console says: the run's own lines, Lightning's results and progress, and warnings worth acting on.

Silenced here, each by its exact message (and category, for warnings), never all of a kind:

- warnings the template causes by design, or that come from inside a dependency and that a user can do nothing
  about (``SILENCED_WARNINGS``);
- Lightning's INFO lines that advertise or that repeat what the run's start line (``lightkeep.guarantees``)
  and end line (``lightkeep.judge``) say (``SILENCED_INFO``).

``PROJECT_VERBOSE=1`` turns this off and brings every line back. A warning not listed here is shown: after a
dependency upgrade it is either acted on or added here on purpose (``tests/test_console.py`` lists every line).
"""

import contextlib
import logging
import os
import re
import warnings
from collections.abc import Iterator

from lightning.fabric.utilities.warnings import PossibleUserWarning

VERBOSE_ENV = "PROJECT_VERBOSE"

# (message regex matched at the start of the message, category)
SILENCED_WARNINGS: list[tuple[str, type[Warning]]] = [
    # Lightning 2.6 uses torch's deprecated LeafSpec on every batch it moves (lightning/pytorch/utilities/_pytree.py)
    (r"`isinstance\(treespec, LeafSpec\)` is deprecated", FutureWarning),
    # Lightning's all_gather (torchmetrics syncs under DDP) calls torch's deprecated functional collective
    (r"torch\.distributed\.nn\.functional\.all_gather is deprecated", FutureWarning),
    # validate/test/predict of another run's checkpoint write into a run folder of their own (lightkeep.runs);
    # the ModelCheckpoint state they do not reload is never used by an evaluation
    (r"The dirpath has changed from ", UserWarning),
    # fit --ckpt_path last continues the run's own folder, checkpoints included, on purpose
    (r"Checkpoint directory .* exists and is not empty\.", UserWarning),
    # the engine keeps the positions of plain train loaders itself (streams, the user's own samplers): the start line
    # says what a resume did with each, and names one that restarts its epoch under opts out
    (
        r"You're resuming from a checkpoint that ended before the epoch ended and your dataloader is not resumable",
        PossibleUserWarning,
    ),
    # configs/default.yaml logs every 50 steps (fewer host-device syncs), more than a small data set's batches an
    # epoch: such runs would all say this, and it misleads: Lightning logs every 50 global steps, across epochs
    (
        r"The number of training batches \(\d+\) is smaller than the logging interval Trainer\(log_every_n_steps=",
        PossibleUserWarning,
    ),
]

# Lightning's INFO lines that are dropped, by how the message starts ("[rank: N] " prefix removed).
SILENCED_INFO = (
    "💡 Tip: ",  # advertisements for litlogger / litmodels
    "GPU available: ",  # the start line names the device and the number of ranks
    "TPU available: ",
    "Seed set to ",  # the seed is in the run's config.yaml
    "Initializing distributed: ",  # one per rank; the start line gives the count
    "-" * 100 + "\ndistributed_backend=",  # the "All distributed processes registered" banner
    "LOCAL_RANK: ",  # "LOCAL_RANK: 0 - CUDA_VISIBLE_DEVICES: [...]", one per rank
    # the start line names the checkpoint a run resumes from or evaluates
    "Restoring states from the checkpoint path at ",
    "Loaded model weights from the checkpoint at ",
    "Restored all states from the checkpoint at ",
    "`Trainer.fit` stopped: `max_epochs=",  # the planned end; the run summary follows
    "`Trainer.fit` stopped: `max_steps=",
)
_RANK_PREFIX = re.compile(r"^\[rank: \d+\] ")


class _DropInfo(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno != logging.INFO or not _RANK_PREFIX.sub("", record.getMessage()).startswith(SILENCED_INFO)


LOGGERS = (  # the loggers that create the records (a logger's filter does not see its children's records)
    "lightning.fabric.utilities.rank_zero",  # rank_zero_info's
    "lightning.pytorch.utilities.rank_zero",
    "lightning.fabric.utilities.seed",
    "lightning.fabric.utilities.distributed",
    "lightning.pytorch.accelerators.cuda",
)


@contextlib.contextmanager
def quiet_console() -> Iterator[None]:
    """The filters, while the block runs (every rank's run is one); nothing when ``PROJECT_VERBOSE`` is set. After
    it, ``warnings.filters`` is the list it was before, and the logging filters are gone."""
    if os.environ.get(VERBOSE_ENV, "") not in ("", "0"):
        yield
        return
    drop = _DropInfo()
    with warnings.catch_warnings():
        for message, category in SILENCED_WARNINGS:
            warnings.filterwarnings("ignore", message=message, category=category)
        for name in LOGGERS:
            logging.getLogger(name).addFilter(drop)
        try:
            yield
        finally:
            for name in LOGGERS:
                logging.getLogger(name).removeFilter(drop)


def first_line(error: BaseException) -> str:
    """``error`` in one line: its type and its message's first line."""
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0]}" if text else type(error).__name__
