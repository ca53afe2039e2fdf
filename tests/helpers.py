"""What this project's tests share: its command line run for real (``python -m project``), and the run's files."""

import os
import subprocess
from pathlib import Path

import project
from lightkeep.testing import DDP2, QUIET, run_cli, run_dirs, scalars

REPO = Path(__file__).resolve().parent.parent
PROGRAM = project.__name__  # python -m <this package>
__all__ = [
    "DDP2",
    "ENGINE_NAMES",
    "PROGRAM",
    "QUIET",
    "REPO",
    "cli",
    "decoy_index",
    "offline_venv",
    "pip_install",
    "run_dirs",
    "scalars",
]


def cli(*args: str, cwd: Path, **kwargs):
    """``python -m project ARGS`` in ``cwd``: the base config's model and data unless ``args`` name others."""
    return run_cli(PROGRAM, *args, cwd=cwd, pythonpath=str(REPO), **kwargs)


ENGINE_NAMES = ("lightkeep", "steadfast")  # the engine's name, and its old one (another author's on PyPI)


def decoy_index(folder: Path) -> Path:
    """A package index of one folder holding a wheel for each of the engine's names at version 99, whose import
    fails: what the registry would serve if someone registered the name. An install that looks the engine up by
    name takes it (the highest version), so an install without it never asked."""
    import zipfile

    folder.mkdir(parents=True, exist_ok=True)
    for name in ENGINE_NAMES:
        with zipfile.ZipFile(folder / f"{name}-99.0-py3-none-any.whl", "w") as wheel:
            wheel.writestr(f"{name}/__init__.py", "raise ImportError('a stranger\\'s package from the registry')\n")
            info = f"{name}-99.0.dist-info"
            wheel.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: 99.0\n")
            wheel.writestr(
                f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
            )
            wheel.writestr(f"{info}/RECORD", "")
    return folder


def offline_venv(folder: Path) -> Path:
    """A new virtual environment whose third-party packages (torch, lightning, ...) are this one's, seen through a
    path entry: pip finds them installed and downloads nothing; this environment's ``.pth`` files (its editable
    installs of the project and the engine) are not read there. Returns its python."""
    import site
    import sys

    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(folder)], check=True)
    (purelib,) = folder.glob("lib/python*/site-packages")
    (purelib / "borrowed.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    return folder / "bin" / "python"


def pip_install(python: Path, target: str, index: Path, cwd: Path) -> subprocess.CompletedProcess:
    """``pip install TARGET`` (``-e .``: split at spaces) into ``python``'s environment with the registry out of
    reach: no index but ``index`` (``decoy_index``)."""
    import sys

    # no build isolation: setuptools from the borrowed packages, as the index has none
    pip = [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-index", "--find-links", str(index),
           "--no-build-isolation"]  # fmt: skip
    env = {**outside_env(), "PIP_CONFIG_FILE": os.devnull}  # the machine's pip.conf (extra indexes) is not under test
    return subprocess.run([*pip, *target.split()], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def outside_env() -> dict[str, str]:
    """This environment without ``PYTHONPATH`` and pip's settings: an installed environment imports what it holds."""
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and not k.startswith("PIP_")}
