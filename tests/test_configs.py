"""Every YAML under configs/ parses with the CLI, so a renamed argument breaks the build, not a user's run."""

import sys
from pathlib import Path

import pytest
import yaml

from tests.helpers import REPO

FIT_CONFIGS = sorted(p for p in (REPO / "configs").glob("*.yaml") if not p.name.startswith("sweep"))


@pytest.mark.parametrize("config", FIT_CONFIGS, ids=lambda p: p.name)
def test_every_config_parses(config, monkeypatch, capsys):
    from project.engine.cli import cli_main

    monkeypatch.setattr(sys, "argv", ["project"])
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["fit", "--config", str(config), "--print_config"])
    assert exit_info.value.code in (0, None)
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["model"]["class_path"] and printed["data"]["class_path"]


@pytest.mark.parametrize("config", sorted((REPO / "configs").glob("sweep*.yaml")), ids=lambda p: p.name)
def test_every_sweep_config_parses_and_its_space_fits_the_fit_parser(config, monkeypatch):
    from project.engine.sweep import build_parser, sweep_from
    from project.engine.sweep_space import check_space

    parser = build_parser()
    sweep = sweep_from(parser, parser.parse_args(["--config", str(config)]))
    check_space(sweep.space, sweep.fit)  # raises ValueError naming a key or value that fit refuses


@pytest.mark.slow
@pytest.mark.parametrize("preset", sorted(p.name for p in (REPO / "configs").glob("debug_*.yaml")))
def test_each_debug_preset_runs(preset, tmp_path):
    from tests.helpers import QUIET, cli_in_process

    cli = cli_in_process("fit", "--config", str(REPO / "configs" / preset), *QUIET, "--trainer.max_epochs", "2",
                         "--trainer.limit_val_batches", "1", root=tmp_path / "runs")  # fmt: skip
    assert cli.trainer.global_step > 0
    assert cli.trainer.state.finished


@pytest.mark.long  # CI and make test-all; a non-editable install
@pytest.mark.slow  # two interpreters with another sys.path: what `pip install .` gives
def test_installed_without_editable_the_base_config_is_the_project_folders_or_named(tmp_path):
    """`pip install .` puts `project` in site-packages, with no configs/ beside it: the project folder's is used
    when run from there; elsewhere one line says where it looked (and the parser names what is missing)."""
    import os
    import shutil
    import subprocess

    site, folder, elsewhere = tmp_path / "site-packages", tmp_path / "my_project", tmp_path / "elsewhere"
    shutil.copytree(REPO / "project", site / "project", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(REPO / "configs", folder / "configs")
    elsewhere.mkdir()
    env = {**os.environ, "PYTHONPATH": str(site), "PYTHONWARNINGS": "ignore"}

    def run(cwd, *args):
        args = [sys.executable, "-m", "project", "fit", *args]
        return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)

    found = run(folder, "--print_config")
    assert found.returncode == 0, found.stderr[-2000:]
    assert yaml.safe_load(found.stdout)["model"]["class_path"] == "project.module.Classifier"
    lost = run(elsewhere, "--trainer.fast_dev_run", "true")
    assert lost.returncode != 0
    default = Path("configs") / "default.yaml"
    note = f"note: no base config at {site / default} or {elsewhere / default}"
    assert lost.stdout.splitlines()[0].startswith(note), lost.stdout
    assert "error:" in lost.stderr and "model" in lost.stderr and "Traceback" not in lost.stderr, lost.stderr[-2000:]
    assert not (elsewhere / "runs").exists()
