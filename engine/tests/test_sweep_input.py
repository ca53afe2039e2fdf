"""A sweep's bad input ends in one `error:` line naming the key and the fix, before any trial or folder exists."""

import json
import sys

import pytest

from tests.helpers import STAND_IN

FIT = ["--fit", json.dumps(STAND_IN)]  # the trials' fit arguments: the stand-in, whose constructors check the values
SPACE_OK = "{model.init_args.lr: {type: float, low: 1.0e-3, high: 1.0e-2, log: true}}"


@pytest.mark.parametrize(
    ("space", "expected"),
    [
        # a misspelt key: the fit parser itself refuses it
        ("{model.init_args.lrr: {type: float, low: 1.0e-3, high: 1.0e-2}}", "model.init_args.lrr"),
        # an end of the range that the model's constructor refuses
        ("{model.init_args.lr: {type: float, low: 0.0, high: 1.0e-2}}", "lr (0.0) must be a finite number > 0"),
        # a range Optuna would refuse, and a spec field it does not know
        ("{model.init_args.lr: {type: float, low: 1.0e-2, high: 1.0e-3}}", "low (0.01) must be <= high (0.001)"),
        ("{model.init_args.lr: {type: float, low: 1.0e-3, hi: 1.0e-2}}", "unknown field(s) ['hi']"),
        ("{data.init_args.batch_size: {type: categorical, choices: [32, 0]}}", "data.init_args.batch_size = 0"),
    ],
    ids=["unknown-key", "refused-value", "low>high", "unknown-field", "refused-choice"],
)
def test_bad_space_fails_in_one_line_before_anything_is_written(space, expected, tmp_path, monkeypatch, capsys):
    from tests.helpers import cli_main

    monkeypatch.setattr(sys, "argv", ["project"])
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["sweep", "--name", "s", "--root", str(tmp_path / "runs"), *FIT, "--space", space])
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert exit_info.value.code == 2
    assert len(errors) == 1 and expected in errors[0], errors
    assert not (tmp_path / "runs").exists(), "a refused sweep wrote something"


def test_a_restart_with_another_space_is_refused_and_the_study_kept(tmp_path, monkeypatch, capsys):
    import optuna

    from tests.helpers import cli_main

    monkeypatch.setattr(sys, "argv", ["project"])
    root = tmp_path / "runs"
    storage = f"sqlite:///{root / 's' / 'study.db'}"
    (root / "s").mkdir(parents=True)
    study = optuna.create_study(study_name="s", storage=storage)
    started = {
        "space": {"other": {}},
        "fit": STAND_IN,
        "monitor": "val/acc",
        "direction": "maximize",
    }  # the space alone
    study.set_user_attr("sweep", started)
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["sweep", "--name", "s", "--root", str(root), *FIT, "--space", SPACE_OK, "--trials", "1"])
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert exit_info.value.code == 2
    assert len(errors) == 1 and "started with another space" in errors[0], errors
    assert optuna.load_study(study_name="s", storage=storage).trials == [], "a trial ran on a refused restart"
