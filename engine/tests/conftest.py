"""pytest fixtures shared by the tests; helpers they import are in ``tests/helpers.py``."""

from pathlib import Path

import pytest


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    return tmp_path
