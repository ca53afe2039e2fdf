"""Installs are part of security: every install path of this project takes the engine from its own ``engine/``
folder, never a package of the engine's name from a registry (PyPI's ``steadfast``, the engine's old name, is
another author's). Each install runs with the registry out of reach and a decoy index that serves a wheel of each
of the engine's names at version 99: an install that asked for the engine by name would take it."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ENGINE_NAMES, PROGRAM, QUIET, REPO, decoy_index, offline_venv, outside_env, pip_install

pytestmark = pytest.mark.slow


def _copy_of_this_checkout(dest: Path) -> Path:
    """The project's files as a fresh clone has them (no .venv, runs or caches), so the install builds from them."""
    ignore = shutil.ignore_patterns(".git", ".venv*", "runs", "__pycache__", "*.egg-info", "build", ".ruff_cache")
    shutil.copytree(REPO, dest, ignore=ignore)
    return dest


def test_the_decoy_index_is_taken_by_an_install_that_asks_for_the_engine_by_name(tmp_path):
    """The oracle of the tests below: asked for by name, the engine comes from the decoy."""
    python = offline_venv(tmp_path / "venv")
    proc = pip_install(python, ENGINE_NAMES[0], decoy_index(tmp_path / "index"), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    found = subprocess.run(
        [str(python), "-c", "import lightkeep"], cwd=tmp_path, env=outside_env(), capture_output=True, text=True
    )
    assert "a stranger's package" in found.stderr


@pytest.mark.parametrize("target", ["-e .", ".", "-e .[dev]"])
def test_pip_install_takes_the_engine_from_its_folder_and_trains(tmp_path, target):
    """``pip install -e .`` / ``.`` / ``-e ".[dev]"`` in a fresh copy of the project: no package of the engine's name
    installed from the index, ``lightkeep`` imported from the project's own engine/, and a short fit runs."""
    source = _copy_of_this_checkout(tmp_path / "source")
    python = offline_venv(tmp_path / "venv")
    proc = pip_install(python, target, decoy_index(tmp_path / "index"), cwd=source)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "99.0" not in proc.stdout, proc.stdout  # pip names what it installs: never a decoy
    where = tmp_path / "elsewhere"  # not the source folder, whose project/ python -m would find without the install
    where.mkdir()
    show = f"import json, lightkeep, {PROGRAM}; print(json.dumps([lightkeep.__file__, {PROGRAM}.__file__]))"
    out = subprocess.run([str(python), "-c", show], cwd=where, env=outside_env(), capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    engine, package = map(Path, json.loads(out.stdout))
    if target.startswith("-e"):  # editable: the source's own files
        assert engine.is_relative_to(source / "engine" / "lightkeep") and package.is_relative_to(source), out.stdout
    else:  # a wheel built from the source: the same files, byte for byte
        assert "site-packages" in engine.parts and not engine.is_relative_to(source), out.stdout
        assert engine.read_bytes() == (source / "engine" / "lightkeep" / "__init__.py").read_bytes()
    if target == "-e .":
        fit = [str(python), "-m", PROGRAM, "fit", *QUIET, "--trainer.max_epochs", "1",
               "--trainer.limit_train_batches", "2", "--trainer.limit_val_batches", "1"]  # fmt: skip
        run = subprocess.run(fit, cwd=source, env=outside_env(), capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        assert list((source / "runs").glob("*/version_0/checkpoints/last.ckpt")), run.stdout[-2000:]


def test_the_engine_folder_installs_alone_for_an_existing_project(tmp_path):
    """The README's path for an existing project, ``pip install path/to/engine``: the engine from that folder."""
    source = _copy_of_this_checkout(tmp_path / "source")
    python = offline_venv(tmp_path / "venv")
    proc = pip_install(python, str(source / "engine"), decoy_index(tmp_path / "index"), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = subprocess.run(
        [str(python), "-m", "lightkeep", "fit", "--help"],
        cwd=tmp_path,
        env=outside_env(),
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0 and "--run." in out.stdout, out.stderr[-2000:]


def test_no_requirement_names_the_engine(tmp_path):
    """What any installer reads (pip, uv, poetry): the built metadata's requirements, extras included, name no
    package of the engine's names; they would be looked up on the registry."""
    source = _copy_of_this_checkout(tmp_path / "source")
    report = tmp_path / "report.json"
    cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--no-index", "--no-build-isolation", "--no-deps",
           "--report", str(report), "--quiet", f"{source}[dev]"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (item,) = json.loads(report.read_text())["install"]
    requires = item["metadata"]["requires_dist"]
    assert any(r.startswith("lightning") for r in requires), requires  # the engine's own needs are there
    assert not [r for r in requires if r.split()[0].split("[")[0].split(">")[0] in ENGINE_NAMES], requires
