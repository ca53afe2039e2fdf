"""An existing project's own ``LightningCLI`` script with one import changed (``from lightkeep import LightningCLI``)
runs what plain Lightning runs: its data or model section as a file of its own, a module that skips logging during
the sanity check, and the callbacks Lightning adds to the Trainer itself (``add_lightning_class_args``, the module's
``configure_callbacks``), which judge the run as the config's own would. Plain Lightning's CLI, run beside it, is the
oracle; everything runs in this process, on the fixtures of ``tests/fixtures/kinds.py``."""

import sys
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from lightning.pytorch.cli import LightningCLI as PlainCLI
from torch import nn

from lightkeep import LightningCLI
from tests.fixtures.kinds import Classify, KindData

QUIET = {"enable_progress_bar": False, "enable_model_summary": False}
SUBCLASS, KIND_DATA = "tests.fixtures.kinds.Classify", "tests.fixtures.kinds.KindData"
SUBCLASS_DICT = f"{{class_path: {SUBCLASS}, init_args: {{lr: 0.3}}}}"
OMEGACONF = {"parser_mode": "omegaconf"}


@pytest.fixture
def script(tmp_path, monkeypatch):
    """A script's working folder (its runs/ land there) and its arguments: pytest's are not the CLI's."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["main.py"])
    (tmp_path / "data.yaml").write_text("batch_size: 4\n")
    (tmp_path / "model.yaml").write_text("lr: 0.05\n")
    (tmp_path / "sub_data.yaml").write_text("class_path: tests.fixtures.kinds.KindData\ninit_args:\n  n_val: 11\n")
    (tmp_path / "fixed.yaml").write_text("model:\n  lr: 0.2\ndata: data.yaml\n")
    return tmp_path


def built(cli_class, classes: tuple, args: list[str], parser_kwargs: dict) -> tuple:
    cli = cli_class(*classes, args=args, run=False, parser_kwargs=parser_kwargs)
    return type(cli.model).__name__, dict(cli.model.hparams), dict(cli.datamodule.hparams)


@pytest.mark.parametrize(
    ("classes", "args", "parser_kwargs"),
    [
        pytest.param((Classify, KindData), ["--data", "data.yaml"], {}, id="fixed-data-file"),
        pytest.param((Classify, KindData), ["--data=data.yaml"], {}, id="fixed-data-file-equals"),
        pytest.param((Classify, KindData), ["--model", "model.yaml"], {}, id="fixed-model-file"),
        pytest.param((Classify, KindData), ["--model", "{lr: 0.3}"], {}, id="fixed-model-dict"),
        pytest.param((Classify, KindData), ["--config", "fixed.yaml"], {}, id="fixed-config-naming-a-data-file"),
        pytest.param((Classify, KindData), ["--data", "data.yaml"], OMEGACONF, id="fixed-data-file-omegaconf"),
        pytest.param((Classify, KindData), ["--model", "model.yaml"], OMEGACONF, id="fixed-model-file-omegaconf"),
        pytest.param((), ["--model", SUBCLASS_DICT, "--data", KIND_DATA], {}, id="subclass-model-dict"),
        pytest.param((), ["--model", SUBCLASS, "--data", "sub_data.yaml"], {}, id="subclass-data-file"),
        pytest.param((), ["--model", SUBCLASS, "--data", "sub_data.yaml"], OMEGACONF, id="subclass-omegaconf"),
    ],
)
def test_a_scripts_model_or_data_given_as_a_file_or_dict_parses_as_in_plain_lightning(script, classes, args,
                                                                                     parser_kwargs):  # fmt: skip
    assert built(LightningCLI, classes, args, parser_kwargs) == built(PlainCLI, classes, args, parser_kwargs)


class SkipsSanityCheck(Classify):
    """Logs ``val_loss`` outside the sanity check only, as Lightning's docs allow."""

    def validation_step(self, batch, batch_idx: int) -> None:
        x, label, _, _ = batch
        if not self.trainer.sanity_checking:
            self.log("val_loss", nn.functional.cross_entropy(self(x), label))


def fit_skipping_the_sanity_check(cli_class, monitor: str):
    early, best = EarlyStopping(monitor=monitor, patience=5), ModelCheckpoint(monitor=monitor)
    cli = cli_class(SkipsSanityCheck, KindData, args=["fit", "--trainer.max_epochs", "2"],
                    trainer_defaults={**QUIET, "logger": False, "callbacks": [early, best]})  # fmt: skip
    return cli, early, best


def test_a_monitor_the_module_logs_only_after_the_sanity_check_is_judged_where_lightning_judges_it(script):
    for cli_class in (PlainCLI, LightningCLI):  # plain Lightning runs it: the oracle
        cli, early, best = fit_skipping_the_sanity_check(cli_class, "val_loss")
        assert cli.trainer.num_sanity_val_steps > 0, "precondition: a sanity check ran"
        assert cli.trainer.current_epoch == 2 and early.best_score.isfinite(), cli_class
        assert best.best_model_path and best.best_model_score == early.best_score


def test_a_monitor_never_logged_is_refused_at_the_first_validation_with_the_keys_it_logs(script):
    with pytest.raises(RuntimeError, match="val_los"):  # plain Lightning: EarlyStopping's own, at the same point
        fit_skipping_the_sanity_check(PlainCLI, "val_los")
    with pytest.raises(SystemExit) as exited:
        fit_skipping_the_sanity_check(LightningCLI, "val_los")
    message = str(exited.value.code)
    assert message.startswith(
        "error: the monitor of a EarlyStopping in trainer.callbacks is 'val_los', which the module did not log by the "
        "end of the first validation (it logs: train/loss, val_loss): change that monitor to one of those"
    ), message


class CheckpointArgsCLI(LightningCLI):
    """A script's own ModelCheckpoint, its arguments on the command line (``--checkpoint.monitor``)."""

    def add_arguments_to_parser(self, parser) -> None:
        parser.add_lightning_class_args(ModelCheckpoint, "checkpoint")


def test_a_checkpoint_of_add_lightning_class_args_judges_the_run_and_picks_ckpt_path_best(script, capsys):
    own = ["--checkpoint.monitor", "val/acc", "--checkpoint.mode", "max", "--checkpoint.save_top_k", "-1"]
    fit = CheckpointArgsCLI(Classify, KindData, args=["fit", *own, "--trainer.max_epochs", "4"],
                            trainer_defaults=QUIET)  # fmt: skip
    (theirs,) = [c for c in fit.trainer.callbacks if isinstance(c, ModelCheckpoint) and c.monitor]
    assert fit.judge is theirs and theirs is fit.config_init["fit"]["checkpoint"]
    out = capsys.readouterr().out
    assert f"Run summary: best val/acc {theirs.best_model_score.item():.4f} | best checkpoint " in out, out
    last = torch.load(Path(theirs.dirpath) / "last.ckpt", weights_only=True)
    recorded = last["callbacks"][theirs.state_key]  # the oracle: the callback's own record of its best
    scores = recorded["best_k_models"].values()
    assert len(scores) == 4 and max(scores) > min(scores), "precondition: the files rank by the mode"
    assert last["callbacks"]["ExactResume"]["judge"]["state_key"] == theirs.state_key  # what ranks the run's files

    validate = CheckpointArgsCLI(Classify, KindData, args=["validate", "--ckpt_path", "best"], trainer_defaults=QUIET)
    assert validate.trainer.ckpt_path == recorded["best_model_path"], (validate.trainer.ckpt_path, recorded)


class ConfiguresItsCheckpoint(Classify):
    def configure_callbacks(self) -> list:
        return [ModelCheckpoint(monitor="val/acc", mode="max", filename="own-{epoch}")]


def test_a_checkpoint_of_the_modules_configure_callbacks_judges_the_run(script, capsys):
    fit = LightningCLI(ConfiguresItsCheckpoint, KindData, args=["fit", "--trainer.max_epochs", "2"],
                       trainer_defaults=QUIET)  # fmt: skip
    (theirs,) = [c for c in fit.trainer.callbacks if isinstance(c, ModelCheckpoint) and c.monitor]
    assert theirs.filename == "own-{epoch}" and fit.judge is theirs
    assert f"Run summary: best val/acc {theirs.best_model_score.item():.4f}" in capsys.readouterr().out
