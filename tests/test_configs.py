"""The configs with the example's classes: the base config names them, and every other config applies on top of
them; the sweep's space turns the example's arguments and nets."""

import sys

import pytest
import yaml

from tests.helpers import REPO

FIT_CONFIGS = sorted(p for p in (REPO / "configs").glob("*.yaml") if not p.name.startswith("sweep"))


@pytest.mark.parametrize("config", FIT_CONFIGS, ids=lambda p: p.name)
def test_every_config_parses_with_the_example(config, monkeypatch, capsys):
    from project.__main__ import main

    monkeypatch.setattr(sys, "argv", ["project"])
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(config), "--print_config"])
    assert exit_info.value.code in (0, None)
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["model"]["class_path"] == "project.module.Classifier"
    assert printed["data"]["class_path"] == "project.data.DigitsDataModule"


@pytest.mark.parametrize("config", sorted((REPO / "configs").glob("sweep*.yaml")), ids=lambda p: p.name)
def test_every_sweep_config_parses_and_its_space_fits_the_fit_parser(config):
    from lightkeep.config import entered
    from lightkeep.sweep.space import check_space
    from lightkeep.sweep.study import build_parser, fit_cli, sweep_from
    from project.__main__ import BASE_CONFIGS, main

    parser = build_parser()
    sweep = sweep_from(parser, parser.parse_args(["--config", str(config)]))
    with entered(main.__module__.split(".")[0], BASE_CONFIGS):  # as `python -m project sweep` checks it
        check_space(sweep.space, sweep.fit, fit_cli(sweep.fit))  # raises ValueError naming what fit refuses
