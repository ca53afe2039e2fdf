"""Every YAML under configs/ parses with the CLI, so a renamed argument breaks the build, not a user's run. Here on
the stand-in; the configs that name the example (the base config's classes, the sweep's nets) are parsed with it in
tests/test_configs.py."""

import sys
from pathlib import Path

import pytest
import yaml
from lightning.pytorch import callbacks

from tests.helpers import ENGINE, REPO, STAND_IN

BASE = REPO / "configs" / "default.yaml"  # always read first; it names the example's classes
# The configs given after the base config: none names a model or data class, so they apply to the stand-in too.
FIT_CONFIGS = sorted(p for p in (REPO / "configs").glob("*.yaml") if not p.name.startswith("sweep") and p != BASE)


@pytest.mark.parametrize("config", FIT_CONFIGS, ids=lambda p: p.name)
def test_every_config_parses(config, monkeypatch, capsys):
    from tests.helpers import cli_main

    monkeypatch.setattr(sys, "argv", ["project"])
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["fit", *STAND_IN, "--config", str(config), "--print_config"])
    assert exit_info.value.code in (0, None)
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["model"]["class_path"] == STAND_IN[1] and printed["data"]["class_path"] == STAND_IN[3]


@pytest.mark.parametrize("config", sorted((REPO / "configs").glob("sweep*.yaml")), ids=lambda p: p.name)
def test_every_sweep_config_parses(config):
    """The sweep's own keys (its space against the fit parser: tests/test_configs.py, the space turns the
    example's arguments)."""
    from lightkeep.sweep.study import build_parser, sweep_from

    parser = build_parser()
    sweep = sweep_from(parser, parser.parse_args(["--config", str(config)]))  # each spec checked as it is built
    assert sweep.space == yaml.safe_load(config.read_text())["space"]


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
    # the stand-in beside it, importable as tests.fixtures.stand_in: what the run below is given to train
    shutil.copytree(
        ENGINE / "tests" / "fixtures", site / "tests" / "fixtures", ignore=shutil.ignore_patterns("__pycache__")
    )
    shutil.copytree(REPO / "configs", folder / "configs")
    elsewhere.mkdir()
    env = {**os.environ, "PYTHONPATH": str(site), "PYTHONWARNINGS": "ignore"}

    def run(cwd, *args):
        args = [sys.executable, "-m", "project", "fit", *args]
        return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)

    found = run(folder, *STAND_IN, "--print_config")
    assert found.returncode == 0, found.stderr[-2000:]
    # the base config's Trainer settings, which no class default or flag above gives (Lightning's max_epochs is
    # None, deterministic False): the project folder's base config was read
    base = yaml.safe_load(BASE.read_text())["trainer"]
    printed = yaml.safe_load(found.stdout)["trainer"]
    assert (printed["max_epochs"], printed["deterministic"]) == (base["max_epochs"], base["deterministic"]), printed
    assert base["max_epochs"] is not None and base["deterministic"] is True  # else the check above proves nothing
    lost = run(elsewhere, "--trainer.fast_dev_run", "true")
    assert lost.returncode != 0
    default = Path("configs") / "default.yaml"
    note = f"note: no base config at {site / default} or {elsewhere / default}"
    assert lost.stdout.splitlines()[0].startswith(note), lost.stdout
    assert "error:" in lost.stderr and "model" in lost.stderr and "Traceback" not in lost.stderr, lost.stderr[-2000:]
    assert not (elsewhere / "runs").exists()


def test_the_engines_version_is_the_one_its_package_declares():
    """``lightkeep.__version__`` (what a copy's ``.template.json`` and the start of a bug report quote) is
    ``engine/pyproject.toml``'s, and the CHANGELOG has an entry for it (1.3.0 shipped saying 1.2.0)."""
    import tomllib

    import lightkeep

    declared = tomllib.loads((ENGINE / "pyproject.toml").read_text())["project"]["version"]
    assert lightkeep.__version__ == declared
    assert f"\n## {declared} (" in (ENGINE / "CHANGELOG.md").read_text()


# what each of Lightning's callbacks must be given; the rest take their signature's defaults
REQUIRED = {
    "EarlyStopping": {"monitor": "val/loss"},
    "GradientAccumulationScheduler": {"scheduling": {0: 1, 2: 2}},
    "ModelPruning": {"pruning_fn": "l1_unstructured"},
    "OnExceptionCheckpoint": {"dirpath": "on_exception"},
    "StochasticWeightAveraging": {"swa_lrs": 0.01},
    "ThroughputMonitor": {"batch_size_fn": "builtins.len"},
}
LIGHTNING_CALLBACKS = [
    # jsonargparse writes a str given to ``Union[Callable, str]`` as "Unable to serialize instance l1_unstructured":
    # the run prunes as asked, its config.yaml does not say how (docs/upstream.md, ModelPruning's pruning_fn)
    pytest.param(name, marks=pytest.mark.xfail(strict=True, reason="jsonargparse")) if name == "ModelPruning" else name
    for name in sorted(callbacks.__all__)
    if isinstance(getattr(callbacks, name), type) and name != "Callback"
]


@pytest.mark.parametrize("name", LIGHTNING_CALLBACKS)
def test_each_of_lightnings_callbacks_named_in_a_config_parses_and_its_written_config_starts_the_same_run(
    name, tmp_path, capsys, monkeypatch
):
    """The Lightning way of adding a callback, a ``trainer.callbacks`` entry with its defaults, parses; the config
    the run saves (``--print_config`` writes it as the run folder's ``config.yaml`` is written) parses back to
    itself and builds the callback. Timer's default ``interval``, a ``str`` Enum, once stopped every command."""
    from tests.helpers import cli_main

    monkeypatch.setattr(sys, "argv", ["project"])

    def written(config: Path) -> str:
        with pytest.raises(SystemExit) as exit_info:
            cli_main(["fit", *STAND_IN, "--config", str(config), "--print_config"])
        assert exit_info.value.code in (0, None), capsys.readouterr().err
        return capsys.readouterr().out

    entry = {"class_path": f"lightning.pytorch.callbacks.{name}", "init_args": REQUIRED.get(name, {})}
    (tmp_path / "given.yaml").write_text(yaml.safe_dump({"trainer": {"callbacks": [entry]}}))
    (tmp_path / "saved.yaml").write_text(written(tmp_path / "given.yaml"))
    assert written(tmp_path / "saved.yaml") == (tmp_path / "saved.yaml").read_text()

    saved = yaml.safe_load((tmp_path / "saved.yaml").read_text())
    for key in ("ckpt_path", "weights_only"):  # fit's own arguments: a parser without subcommands has none
        del saved[key]
    (tmp_path / "saved.yaml").write_text(yaml.safe_dump(saved))
    trainer = cli_main(["--config", str(tmp_path / "saved.yaml")], run=False).trainer
    built = [callback for callback in trainer.callbacks if type(callback) is getattr(callbacks, name)]
    assert built
    if name == "Timer":
        assert built[0]._interval == "step"  # the default Lightning documents: the time is checked at each step
