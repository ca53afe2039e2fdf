"""The example through the real CLI: the README's training command, as a user runs it."""

import pytest

from tests.helpers import QUIET, cli, run_dirs, scalars

pytestmark = pytest.mark.slow  # a subprocess: the real `python -m project`


def test_default_fit_reaches_97_percent(tmp_path):
    cli("fit", *QUIET, cwd=tmp_path)  # exactly the README's training command
    (run,) = run_dirs(tmp_path, "digits")  # the run folder named after DigitsDataModule
    assert max(v for _, v in scalars(run)["val/acc"]) >= 0.97
    assert (run / "checkpoints" / "last.ckpt").is_file()
