"""Each private Lightning API in project/engine/compat.py still exists and still does what the engine relies on;
a Lightning upgrade that changes one fails here, naming it."""

import contextlib

import lightning as L
from lightning.fabric.loggers.csv_logs import _ExperimentWriter
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.utilities.exceptions import SIGTERMException

from project.engine.compat import (
    cli_section,
    request_stop_at_batch_end,
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
