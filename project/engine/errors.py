"""How bad input is reported: one ``error:`` line that names the problem and the fix, not a traceback wall.

Exit code 2 when the problem is found before anything is written (arguments, config files, checkpoints, devices,
the output folder: the CLI calls jsonargparse's ``parser.error``), exit code 1 when it shows up during the run
(data too small for a batch, a full disk). ``JSONARGPARSE_DEBUG=1``, jsonargparse's own switch, brings the
tracebacks back.
"""

import itertools
import os
import sys
import traceback
from collections.abc import Iterator
from contextlib import contextmanager

import yaml
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.cli import ArgsType, LightningArgumentParser
from lightning.pytorch.utilities import rank_zero_only

from project.engine.checkpoint_io import CheckpointWriteError
from project.engine.compat import LightningChanged
from project.engine.rank_failures import resume_command

# What bad input raises once a run has started; anything else is a bug and keeps its traceback.
# LightningChanged: a private API that moved (project.engine.compat) stops the run in one line, too
RUN_ERRORS = (ValueError, OSError, MisconfigurationException, LightningChanged)


def check_yaml_files(parser: LightningArgumentParser, args: ArgsType) -> None:
    """Each ``--config`` file must be valid YAML: jsonargparse's message for one that is not names neither the
    file nor the line."""
    if not isinstance(args, list | tuple):
        return
    pairs = [*itertools.pairwise(args), *(a.split("=", 1) for a in args if a.startswith("--config="))]
    for flag, value in pairs:
        if flag in ("-c", "--config") and os.path.isfile(value):
            try:
                with open(value) as f:
                    yaml.safe_load(f)
            except yaml.YAMLError as error:
                parser.error(f"--config {value} is not valid YAML: {' '.join(str(error).split())}. Fix the file.")


def root_cause(error: BaseException) -> BaseException:
    """The constructor's own error under jsonargparse's wrapping (e.g. "lr (-0.1) must be > 0")."""
    while error.__cause__ is not None:
        error = error.__cause__
    return error


@contextmanager
def one_line_errors() -> Iterator[None]:
    """Turns a ``RUN_ERRORS`` exception into ``error: MESSAGE (raised at FILE:LINE ...)`` on rank 0 and exit code 1
    on every rank."""
    try:
        yield
    except RUN_ERRORS as error:
        if os.environ.get("JSONARGPARSE_DEBUG"):
            raise
        message = error.strerror if isinstance(error, OSError) and error.strerror else str(error)
        if isinstance(error, OSError) and error.filename:
            message += f": {error.filename}"
        if rank_zero_only.rank != 0:
            # Raised alike on every rank, it is said once, by rank 0. An error of this rank alone is named by rank
            # 0's report of a failed rank (project.engine.rank_failures) from the note this rank left.
            sys.exit(1)
        if isinstance(error, CheckpointWriteError):  # a full disk, not a place in the code: the command to resume
            sys.exit(f"error: {message}: {resume_command(sys.argv)}")
        sys.exit(f"error: {message} (raised at {_raised_at(error)}; JSONARGPARSE_DEBUG=1 shows the traceback)")


def _raised_at(error: BaseException) -> str:
    # The innermost frame outside installed packages: where to look, without the traceback of the whole stack.
    frames = traceback.extract_tb(error.__traceback__)
    frame = next((f for f in reversed(frames) if "site-packages" not in f.filename), frames[-1] if frames else None)
    if frame is None:
        return "?"
    relative = os.path.relpath(frame.filename)
    return f"{frame.filename if relative.startswith('..') else relative}:{frame.lineno}"
