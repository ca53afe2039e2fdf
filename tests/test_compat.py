"""Each private Lightning API in project/engine/compat.py still exists and still does what the engine relies on;
a Lightning upgrade that changes one fails here, naming it."""

import contextlib
from datetime import timedelta

import lightning as L
import torch
from lightning.fabric.loggers.csv_logs import _ExperimentWriter
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.utilities.exceptions import SIGTERMException

from project.engine.compat import (
    cli_section,
    request_stop_at_batch_end,
    save_last_unless_saved_at_this_step,
    set_csv_columns,
    set_nested,
    shard_over_all_ranks,
    state_key_arguments,
)
from project.module import Classifier
from project.nets import MLP


def test_trainer_signal_connector_received_sigterm_stops_every_rank_at_the_batch_end(tmp_path):
    class StopAtThree(L.Callback):
        def on_train_batch_end(self, trainer, *_):
            if trainer.global_step == 3:
                request_stop_at_batch_end(trainer)

    trainer = L.Trainer(max_steps=10, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, callbacks=[StopAtThree()],
                        default_root_dir=tmp_path)  # fmt: skip
    assert hasattr(trainer, "_signal_connector") and hasattr(trainer._signal_connector, "received_sigterm"), (
        "Trainer._signal_connector.received_sigterm is gone"
    )
    from project.data import DigitsDataModule

    with contextlib.suppress(SIGTERMException):
        trainer.fit(Classifier(MLP(), warmup=0), DigitsDataModule())
    assert trainer.global_step == 3, "setting Trainer._signal_connector.received_sigterm no longer stops the loop"


def test_lightning_cli_get_reads_a_config_section():
    assert hasattr(LightningCLI, "_get"), "LightningCLI._get is gone"

    class Stub:
        subcommand = "fit"
        _get = LightningCLI._get

    assert cli_section(Stub(), {"fit": {"trainer": {"max_epochs": 3}}}, "trainer") == {"max_epochs": 3}
    assert cli_section(Stub(), {"fit": {}}, "trainer") == {}


def test_csv_experiment_writer_keeps_the_columns_it_is_given(tmp_path):
    writer = _ExperimentWriter(str(tmp_path))
    assert hasattr(writer, "metrics_keys"), "_ExperimentWriter.metrics_keys is gone"
    (tmp_path / "metrics.csv").write_text("a,step\n1.0,0\n")
    set_csv_columns(writer, ["a", "step"])
    writer.log_metrics({"a": 2.0}, step=1)
    writer.save()
    assert (tmp_path / "metrics.csv").read_text().splitlines() == ["a,step", "1.0,0", "2.0,1"]


def test_model_parallel_strategy_data_parallel_size_becomes_every_rank():
    from lightning.pytorch.strategies import ModelParallelStrategy

    strategy = ModelParallelStrategy(data_parallel_size="auto", tensor_parallel_size=2)
    assert strategy._data_parallel_size == "auto" and strategy._tensor_parallel_size == 2
    strategy.parallel_devices = [None] * 8  # 8 processes on each of 2 nodes
    strategy.num_nodes = 2
    shard_over_all_ranks(strategy)
    assert strategy._data_parallel_size == 8


def test_dcp_traverse_set_element_sets_a_nested_value():
    state = {"optimizer_0": {"param_groups": [{"lr": 0.0}]}}
    set_nested(state, ("optimizer_0", "param_groups", 0, "lr"), 0.5)
    assert state == {"optimizer_0": {"param_groups": [{"lr": 0.5}]}}


def test_model_checkpoint_state_key_holds_its_monitor_and_mode():
    key = ModelCheckpoint(monitor="val/loss", mode="min").state_key
    assert key.startswith("ModelCheckpoint{"), f"Callback._generate_state_key's format changed: {key}"
    assert {k: state_key_arguments(key).get(k) for k in ("monitor", "mode")} == {"monitor": "val/loss", "mode": "min"}
    assert state_key_arguments(ModelCheckpoint(monitor="val/acc", mode="max").state_key)["mode"] == "max"
    assert state_key_arguments("NotACallbackKey") == {}


def test_model_checkpoint_saves_last_at_the_end_once_and_not_again_at_the_same_step(tmp_path):
    from project.data import DigitsDataModule
    from project.engine.checkpoints import load_checkpoint_file

    saves = []

    class Count(L.Callback):
        def on_save_checkpoint(self, trainer, *_):
            saves.append(trainer.global_step)

    # an interval no run reaches: Lightning's own on_train_end writes last.ckpt (none written yet); then the
    # private API must skip the step it already saved and write at a new one
    checkpoint = ModelCheckpoint(dirpath=tmp_path, train_time_interval=timedelta(hours=1), save_top_k=0, save_last=True)
    trainer = L.Trainer(max_steps=3, logger=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, callbacks=[checkpoint, Count()], default_root_dir=tmp_path)  # fmt: skip
    trainer.fit(Classifier(MLP(), warmup=0), DigitsDataModule())
    assert saves == [3] and load_checkpoint_file(tmp_path / "last.ckpt")["global_step"] == 3
    save_last_unless_saved_at_this_step(checkpoint, trainer)
    assert saves == [3], "ModelCheckpoint._should_skip_saving_checkpoint no longer skips a step already saved"
    checkpoint._last_global_step_saved = 2  # as if last saved at an earlier step
    save_last_unless_saved_at_this_step(checkpoint, trainer)
    assert saves == [3, 3], "ModelCheckpoint._save_last_checkpoint(trainer, _monitor_candidates) no longer saves"
    assert checkpoint.last_model_path == str(tmp_path / "last.ckpt")


def test_last_checkpoint_holds_the_final_step_after_a_refresh_during_the_fit(tmp_path):
    """The default's LastCheckpoint: refreshed during the fit (here after every step: interval 0) and still at the
    final step when fit ends, as the saved global step and the weights say."""
    from project.data import DigitsDataModule
    from project.engine.checkpoints import load_checkpoint_file
    from project.engine.last_checkpoint import LastCheckpoint

    class Interval(LastCheckpoint):  # a refresh at step 2 only, as a 10-minute interval gives on a long run
        def on_train_batch_end(self, trainer, *args):
            if trainer.global_step == 2:
                super().on_train_batch_end(trainer, *args)

    model = Classifier(MLP(), warmup=0)
    trainer = L.Trainer(max_steps=5, logger=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, callbacks=[Interval(timedelta(0), dirpath=str(tmp_path))])  # fmt: skip
    trainer.fit(model, DigitsDataModule())
    saved = load_checkpoint_file(tmp_path / "last.ckpt")
    assert saved["global_step"] == 5
    assert all(torch.equal(saved["state_dict"][k], v) for k, v in model.state_dict().items())
