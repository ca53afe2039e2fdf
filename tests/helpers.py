"""What this project's tests share: its command line run for real (``python -m project``), and the run's files."""

from pathlib import Path

import project
from lightkeep.testing import DDP2, QUIET, run_cli, run_dirs, scalars

REPO = Path(__file__).resolve().parent.parent
PROGRAM = project.__name__  # python -m <this package>
__all__ = ["DDP2", "PROGRAM", "QUIET", "REPO", "cli", "run_dirs", "scalars"]


def cli(*args: str, cwd: Path, **kwargs):
    """``python -m project ARGS`` in ``cwd``: the base config's model and data unless ``args`` name others."""
    return run_cli(PROGRAM, *args, cwd=cwd, pythonpath=str(REPO), **kwargs)
