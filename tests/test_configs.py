"""Every YAML under configs/ parses with the CLI, so a renamed argument breaks the build, not a user's run."""

import sys

import pytest
import yaml

from tests.conftest import REPO


@pytest.mark.parametrize("config", sorted((REPO / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_config_parses(config, monkeypatch, capsys):
    from project.engine.cli import cli_main

    monkeypatch.setattr(sys, "argv", ["project"])
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["fit", "--config", str(config), "--print_config"])
    assert exit_info.value.code in (0, None)
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["model"]["class_path"] and printed["data"]["class_path"]
