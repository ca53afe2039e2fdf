"""Each private Lightning or torch API in engine/lightkeep/compat*.py still exists and still does what the engine
relies on; a Lightning upgrade that changes one fails here, naming it."""

import ast
import contextlib
from datetime import timedelta
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.fabric.loggers.csv_logs import _ExperimentWriter
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.utilities.exceptions import SIGTERMException

from lightkeep.compat import (
    class_args_callback_keys,
    cli_section,
    loader_with_sampler,
    request_stop_at_batch_end,
    save_last_unless_saved_at_this_step,
    shard_over_all_ranks,
    state_key_arguments,
    uses_distributed_sampler,
)
from lightkeep.compat_logging import set_csv_columns
from lightkeep.compat_torch import set_nested
from tests.fixtures.stand_in import BlobsDataModule, StandIn
from tests.helpers import STAND_IN


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
    with contextlib.suppress(SIGTERMException):
        trainer.fit(StandIn(warmup=0), BlobsDataModule())
    assert trainer.global_step == 3, "setting Trainer._signal_connector.received_sigterm no longer stops the loop"


def test_lightning_cli_get_reads_a_config_section():
    assert hasattr(LightningCLI, "_get"), "LightningCLI._get is gone"

    class Stub:
        subcommand = "fit"
        _get = LightningCLI._get

    assert cli_section(Stub(), {"fit": {"trainer": {"max_epochs": 3}}}, "trainer") == {"max_epochs": 3}
    assert cli_section(Stub(), {"fit": {}}, "trainer") == {}


def test_lightning_cli_parser_lists_the_keys_of_add_lightning_class_args_callbacks():
    """``LightningCLI._parser(subcommand).callback_keys``: the callbacks a script added with
    ``add_lightning_class_args``, which the engine counts as the user's."""

    class Script(LightningCLI):
        def add_arguments_to_parser(self, parser):
            parser.add_lightning_class_args(ModelCheckpoint, "checkpoint")

    cli = Script(StandIn, BlobsDataModule, args=["--checkpoint.monitor", "val/acc"], run=False)
    assert class_args_callback_keys(cli) == ["checkpoint"]
    ran = Script(StandIn, BlobsDataModule, args=["fit", "--trainer.fast_dev_run", "1", "--trainer.logger", "false"])
    assert class_args_callback_keys(ran) == ["checkpoint"]  # the fit subcommand's own parser


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
    from lightkeep.checkpoint_files import load_checkpoint_file

    saves = []

    class Count(L.Callback):
        def on_save_checkpoint(self, trainer, *_):
            saves.append(trainer.global_step)

    # an interval no run reaches: Lightning's own on_train_end writes last.ckpt (none written yet); then the
    # private API must skip the step it already saved and write at a new one
    checkpoint = ModelCheckpoint(dirpath=tmp_path, train_time_interval=timedelta(hours=1), save_top_k=0, save_last=True)
    trainer = L.Trainer(max_steps=3, logger=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, callbacks=[checkpoint, Count()], default_root_dir=tmp_path)  # fmt: skip
    trainer.fit(StandIn(warmup=0), BlobsDataModule())
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
    from lightkeep.checkpoint_files import load_checkpoint_file
    from lightkeep.last_checkpoint import LastCheckpoint

    class Interval(LastCheckpoint):  # a refresh at step 2 only, as a 10-minute interval gives on a long run
        def on_train_batch_end(self, trainer, *args):
            if trainer.global_step == 2:
                super().on_train_batch_end(trainer, *args)

    model = StandIn(warmup=0)
    trainer = L.Trainer(max_steps=5, logger=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, callbacks=[Interval(timedelta(0), dirpath=str(tmp_path))])  # fmt: skip
    trainer.fit(model, BlobsDataModule())
    saved = load_checkpoint_file(tmp_path / "last.ckpt")
    assert saved["global_step"] == 5
    assert all(torch.equal(saved["state_dict"][k], v) for k, v in model.state_dict().items())


def _log_steps(result_metric_to, steps=5):
    """``self.log`` as Lightning runs it, with ``_ResultMetric.to`` set to ``result_metric_to``: the per-step and the
    epoch value of a mean over steps, plus one metric-valued log."""
    from lightning.pytorch.trainer.connectors.logger_connector.result import _ResultCollection, _ResultMetric
    from torchmetrics import MeanMetric

    saved = _ResultMetric.to
    _ResultMetric.to = result_metric_to
    try:
        results, mean = _ResultCollection(training=True), MeanMetric()
        seen = []
        for step in range(steps):
            value = torch.tensor(0.5 + step)
            mean.update(value)
            results.log("training_step", "loss", value, on_step=True, on_epoch=True, batch_size=4)
            results.log("training_step", "mean", mean, on_step=False, on_epoch=True)
            seen.append(results["training_step.loss"]._forward_cache.item())
        return results, seen, results["training_step.loss"].compute().item(), results["training_step.mean"].compute()
    finally:
        _ResultMetric.to = saved


def test_result_metric_to_is_called_at_every_log_and_skipped_once_its_values_are_there():
    """Lightning's ``_ResultCollection.log`` moves the stored result at every call, and its ``_ResultMetric.to``
    walks and rebuilds the whole object (a new ``meta`` each time): both are what ``skip_moves_already_done`` is
    for; a Lightning that no longer does either fails here and the patch can go."""
    import inspect

    from lightning.pytorch.trainer.connectors.logger_connector.result import _ResultCollection, _ResultMetric

    from lightkeep.compat_logging import skip_moves_already_done

    assert "self[key].to(value.device)" in inspect.getsource(_ResultCollection.log), (
        "_ResultCollection.log no longer moves the result at every call: drop compat.skip_moves_already_done"
    )
    undo = skip_moves_already_done()
    patched = _ResultMetric.to
    original = patched.__wrapped__
    assert skip_moves_already_done() is not undo and _ResultMetric.to is patched  # twice is once
    undo()
    assert _ResultMetric.to is original, "not put back"

    calls = []

    def counting(self, *args, **kwargs):
        calls.append(args)
        return original(self, *args, **kwargs)

    results, *_ = _log_steps(counting, steps=3)
    loss = results["training_step.loss"]
    assert len(calls) == 6, "no longer one _ResultMetric.to call per self.log"
    meta = loss.meta
    loss.to(torch.device("cpu"))
    assert loss.meta is not meta, "_ResultMetric.to no longer rebuilds the object: the patch may have no effect"

    # The oracle: the same logs through Lightning's own move give the same per-step values and epoch results.
    assert _log_steps(patched)[1:3] == _log_steps(original)[1:3]
    patched_mean, original_mean = _log_steps(patched)[3], _log_steps(original)[3]
    assert torch.equal(patched_mean, original_mean)

    # Skipped once there: the object is left as it is (no new meta).
    results, *_ = _log_steps(patched, steps=2)
    loss = results["training_step.loss"]
    meta = loss.meta
    patched(loss, torch.device("cpu"))
    assert loss.meta is meta
    # Any other move still happens (here to the meta device, the only other one a CPU has), and is then skipped.
    patched(loss, torch.device("meta"))
    assert loss.value.device.type == "meta" and loss._defaults["value"].device.type == "meta"
    meta = loss.meta
    patched(loss, torch.device("meta"))
    assert loss.meta is meta
    results, *_ = _log_steps(patched, steps=2)
    loss = results["training_step.loss"]
    patched(loss, device="meta")  # the keyword form, as _ResultCollection.cpu() calls it: Lightning's own path
    assert loss.value.device.type == "meta" and loss._defaults["value"].device.type == "meta"
    results, *_ = _log_steps(patched, steps=2)
    loss = results["training_step.loss"]
    loss._forward_cache = torch.empty(1, device="meta")  # a value left elsewhere: not skipped
    with pytest.raises(NotImplementedError, match="meta"):  # Lightning's own path tries to copy it back
        patched(loss, torch.device("cpu"))
    mean = results["training_step.mean"]
    patched(mean, torch.device("cpu"))  # a logged Metric: skipped while it stays where it is
    mean.value.to(torch.device("meta"))  # and not once it has moved
    with pytest.raises(NotImplementedError, match="meta"):
        patched(mean, torch.device("cpu"))


def test_a_fit_logs_the_same_values_with_and_without_skipped_moves(tmp_path, monkeypatch):
    """The oracle is the same fit with Lightning's own ``_ResultMetric.to``: every logged value, step and epoch,
    train and validation, is the same."""
    from lightning.pytorch.loggers import CSVLogger
    from lightning.pytorch.trainer.connectors.logger_connector.result import _ResultMetric

    from lightkeep.compat_logging import skip_moves_already_done

    undo = skip_moves_already_done()
    patched = _ResultMetric.to
    undo()

    def fit(name):
        L.seed_everything(0)
        trainer = L.Trainer(max_epochs=2, limit_train_batches=6, limit_val_batches=2, log_every_n_steps=1,
                            logger=CSVLogger(tmp_path, name=name), enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
        trainer.fit(StandIn(warmup=1), BlobsDataModule())
        return (tmp_path / name / "version_0" / "metrics.csv").read_text()

    monkeypatch.setattr(_ResultMetric, "to", patched)
    with_skips = fit("patched")
    monkeypatch.setattr(_ResultMetric, "to", patched.__wrapped__)
    lightnings = fit("lightning")
    assert "train/loss" in with_skips and "val/acc" in with_skips and len(with_skips.splitlines()) == 1 + 12 + 2 * 2
    assert with_skips == lightnings


def test_the_default_profiler_profiles_nothing_at_no_cost_and_a_chosen_one_still_profiles():
    from lightning.pytorch.profilers import PassThroughProfiler, SimpleProfiler

    from lightkeep.speed.profiler import NoProfiler
    from tests.helpers import cli_main

    profiler = NoProfiler()
    with profiler.profile("a"), profiler.profile("b"):  # nested, as Lightning's hooks are
        pass
    assert isinstance(profiler, PassThroughProfiler) and profiler.summary() == ""
    assert type(cli_main(STAND_IN, run=False).trainer.profiler) is NoProfiler
    assert type(cli_main([*STAND_IN, "--trainer.profiler", "simple"], run=False).trainer.profiler) is SimpleProfiler


def test_skip_moves_names_lightning_issue_and_installs_nothing_where_lightning_no_longer_moves(monkeypatch):
    """Lightning issue #20388 (fix proposed in PR #21769): on a Lightning whose ``self.log`` no longer moves its result
    at every call (the probe says so), nothing is replaced."""
    from lightning.pytorch.trainer.connectors.logger_connector.result import _ResultMetric

    from lightkeep import compat_logging

    doc = compat_logging.skip_moves_already_done.__doc__
    assert "#20388" in doc and "#21769" in doc
    assert compat_logging.lightning_moves_at_every_log(), (
        "Lightning 2.6 moves at every self.log: the probe no longer sees it"
    )
    own = _ResultMetric.to
    monkeypatch.setattr(compat_logging, "lightning_moves_at_every_log", lambda: False)  # as on a fixed Lightning
    compat_logging.skip_moves_already_done()()
    assert _ResultMetric.to is own


def test_result_metric_to_takes_lightnings_path_for_a_value_it_does_not_know():
    """``_values_on`` knows ``_defaults``, ``_forward_cache``, ``_computed`` and ``value``: a result holding any other
    tensor (a Lightning that adds a field) is moved by Lightning's own ``to``, never skipped."""
    from lightkeep.compat_logging import skip_moves_already_done

    undo = skip_moves_already_done()
    try:
        from lightning.pytorch.trainer.connectors.logger_connector.result import _ResultMetric

        patched = _ResultMetric.to
    finally:
        undo()
    results, *_ = _log_steps(patched, steps=2)
    loss = results["training_step.loss"]
    patched(loss, torch.device("cpu"))
    meta = loss.meta
    patched(loss, torch.device("cpu"))
    assert loss.meta is meta, "precondition: a known result is skipped"
    loss.__dict__["a_new_field"] = torch.zeros(1)
    patched(loss, torch.device("cpu"))
    assert loss.meta is not meta, "a result with a tensor field _values_on does not know was skipped"


def test_fit_loop_saved_counters_are_rewritten_and_an_unknown_layout_stops_the_engine():
    from lightkeep.compat import LightningChanged
    from lightkeep.compat_loops import reopen_an_epoch_stopped_mid_way

    def counts(n):
        return {"ready": n, "started": n, "processed": n, "completed": n}

    saved = {"epoch": 1, "loops": {"fit_loop": {
        "epoch_loop.batch_progress": {"is_last_batch": False, "current": counts(3), "total": counts(13)},
        "epoch_progress": {"current": counts(2), "total": counts(2)}}}}  # fmt: skip
    reopen_an_epoch_stopped_mid_way(saved)
    epochs = saved["loops"]["fit_loop"]["epoch_progress"]
    assert epochs["current"]["completed"] == epochs["current"]["processed"] == 1 and saved["epoch"] == 1
    reopen_an_epoch_stopped_mid_way({"state_dict": {}})  # a weights-only save: nothing to reopen
    del saved["loops"]["fit_loop"]["epoch_progress"]
    with pytest.raises(LightningChanged, match=r"epoch_progress.*Lightning \d"):
        reopen_an_epoch_stopped_mid_way(saved)


def test_model_checkpoint_file_exists_is_replaced_on_the_instance_and_restored(tmp_path):
    from types import SimpleNamespace

    from lightkeep.compat import count_pending_saves_as_files, restore_file_exists

    one_rank = SimpleNamespace(reduce_boolean_decision=lambda decision, all: decision)
    trainer = SimpleNamespace(strategy=one_rank, is_global_zero=True)
    a, b = str(tmp_path / "a.ckpt"), str(tmp_path / "b.ckpt")
    callback = ModelCheckpoint(dirpath=tmp_path)
    assert not callback.file_exists(a, trainer)
    count_pending_saves_as_files(callback, lambda path, _: path == a)
    count_pending_saves_as_files(callback, lambda path, _: path == a)  # never wrapped twice
    assert callback.file_exists(a, trainer) and not callback.file_exists(b, trainer)
    restore_file_exists(callback)
    assert "file_exists" not in vars(callback) and not callback.file_exists(a, trainer)


def test_logger_log_metrics_replaced_and_tensorboard_experiment_read(tmp_path):
    from lightning.pytorch.loggers import TensorBoardLogger

    from lightkeep.compat_logging import experiment_opened, replace_log_metrics

    logger = TensorBoardLogger(tmp_path)
    assert not experiment_opened(logger), "TensorBoardLogger._experiment no longer tells an unopened writer"
    logger.experiment  # noqa: B018  # opens it
    assert experiment_opened(logger)
    seen = []
    own = replace_log_metrics(logger, lambda metrics, step=None: seen.append(step))
    logger.log_metrics({"a": 1.0}, step=3)
    replace_log_metrics(logger, own)
    assert seen == [3] and logger.log_metrics == own


def test_lr_scheduler_last_lr_is_what_get_last_lr_returns():
    from lightkeep.compat_torch import set_last_lr

    scheduler = torch.optim.lr_scheduler.LambdaLR(torch.optim.SGD([torch.zeros(1, requires_grad=True)]), lambda _: 1)
    set_last_lr(scheduler, [0.25])
    assert scheduler.get_last_lr() == [0.25]


def test_a_loaders_unstarted_copy_starts_its_own_persistent_workers():
    """``DataLoader._iterator`` holds the persistent workers' iterator; the stream's copy must not share it."""
    from lightkeep.compat_torch import unstarted_copy

    loader = torch.utils.data.DataLoader(list(range(6)), batch_size=2, num_workers=1, persistent_workers=True)
    assert [b.tolist() for b in loader] == [[0, 1], [2, 3], [4, 5]]
    assert loader._iterator is not None  # the name the copy clears is where the workers live
    rebuilt = unstarted_copy(loader)
    assert rebuilt._iterator is None and loader._iterator is not None
    assert [b.tolist() for b in rebuilt] == [[0, 1], [2, 3], [4, 5]]
    assert rebuilt._iterator is not loader._iterator


@pytest.mark.parametrize("workers", [0, 1])
def test_a_loaders_iterators_draw_each_batchs_indices_from_its_index_sampler(workers):
    """``DataLoader._index_sampler``: the property torch's iterators read to draw each batch's indices, which
    ``lightkeep.own_orders`` puts its own in front of (a subclass's property is what the iterators use)."""
    from torch.utils.data import DataLoader

    from lightkeep.compat_torch import index_sampler

    class Reversed(DataLoader):
        @property
        def _index_sampler(self):
            return [list(reversed(b)) for b in index_sampler(self)]

    loader = Reversed(list(range(6)), batch_size=2, num_workers=workers)
    assert index_sampler(loader) is loader.batch_sampler
    assert [b.tolist() for b in loader] == [[1, 0], [3, 2], [5, 4]] and len(loader) == 3


def test_tensor_version_counts_in_place_writes():
    from lightkeep.compat_torch import version_counter

    t = torch.zeros(2)
    before = version_counter(t)
    t.add_(1)
    assert before is not None and version_counter(t) == before + 1
    with torch.inference_mode():
        assert version_counter(torch.zeros(1)) is None


def test_module_non_persistent_buffers_set_names_the_buffers_state_dict_leaves_out():
    from lightkeep.compat import LightningChanged
    from lightkeep.compat_torch import unsaved_buffers

    module = torch.nn.BatchNorm1d(2)  # its running stats are saved
    module.register_buffer("calls", torch.zeros(()), persistent=False)
    assert list(unsaved_buffers(module)) == ["calls"] and "calls" not in module.state_dict()
    del module._non_persistent_buffers_set
    with pytest.raises(LightningChanged, match="_non_persistent_buffers_set"):
        unsaved_buffers(module)


def test_torch_crc32_setting_is_per_thread_so_other_threads_keep_their_checksums(tmp_path):
    """torch's serialization config holds overrides per thread (``torch.utils._config_module``): the checkpoint
    writer's no-CRC save never reaches a ``torch.save`` on another thread."""
    import threading
    import zipfile

    from lightkeep.compat_torch import crc32_off_in_this_thread

    inside, done, results = threading.Event(), threading.Event(), {}

    def writer():
        with crc32_off_in_this_thread() as off:
            results["off"] = off
            torch.save({"x": torch.arange(1000)}, tmp_path / "writer.pt")
            inside.set()
            done.wait(10)

    thread = threading.Thread(target=writer)
    thread.start()
    inside.wait(10)
    torch.save({"x": torch.arange(1000)}, tmp_path / "main.pt")  # while the writer's setting is off
    done.set()
    thread.join()
    from packaging.version import Version

    if Version(torch.__version__.split("+")[0]) >= Version("2.13"):
        assert results["off"], "torch's CRC-32 setting is no longer per thread: checkpoints now keep their checksums"
    assert zipfile.ZipFile(tmp_path / "main.pt").testzip() is None  # the other thread's file: always checked
    # left out on the writer's thread where torch's setting is per thread; kept everywhere where it is process-wide
    assert (zipfile.ZipFile(tmp_path / "writer.pt").testzip() is not None) == results["off"]
    assert torch.serialization.get_crc32_options() is True


def test_dcp_load_planner_internals_and_reader_load_id():
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import Metadata

    from lightkeep.compat_torch import index_for_reader

    planner = DefaultLoadPlanner()
    planner.set_up_planner({"a": {"b": 1}}, Metadata(state_dict_metadata={}), is_coordinator=True)
    assert hasattr(planner, "original_state_dict") and hasattr(planner, "mappings"), "DefaultLoadPlanner changed"
    reader = FileSystemReader(".")
    reader.reset()
    assert index_for_reader(reader, Metadata(state_dict_metadata={})).storage_meta.load_id == reader.load_id


def test_ddp_launcher_procs_and_gloo_peer_messages():
    from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher

    from lightkeep.compat_torch import PEER_GONE
    from lightkeep.rank_failures import is_peer_gone

    launcher = _SubprocessScriptLauncher(cluster_environment=None, num_processes=2, num_nodes=1)  # type: ignore
    assert launcher.procs == [], "_SubprocessScriptLauncher.procs is gone (rank 0's children)"
    # gloo's messages themselves: tests/test_console.py's dead-rank runs (slow) see them
    assert all(is_peer_gone(RuntimeError(f"[../gloo/transport/tcp/pair.cc:534] {text}")) for text in PEER_GONE)


def test_ddp_launchers_child_process_observer_waits_for_the_report_before_it_kills_every_rank():
    """``child_observer_waits``: ``_ChildProcessObserver``'s ``_run``, ``_child_processes`` (the launcher's list
    itself) and its SIGKILL of ``main_pid`` and the children once one has failed, as the engine relies on them."""
    import subprocess
    import sys
    import time
    from types import SimpleNamespace

    from lightning.fabric.strategies.launchers.subprocess_script import _ChildProcessObserver

    from lightkeep.compat import child_observer_waits

    sleep = [sys.executable, "-c", "import time; time.sleep(60)"]
    main = subprocess.Popen(sleep)  # stands in for rank 0, which the observer SIGKILLs (not this test's process)
    procs = [subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"]), subprocess.Popen(sleep)]
    try:
        observer = _ChildProcessObserver(main_pid=main.pid, child_processes=procs, sleep_period=0.05)  # 5 s in fact
        observer.start()
        trainer = SimpleNamespace(strategy=SimpleNamespace(launcher=SimpleNamespace(procs=procs)))
        alive_while_waiting = []
        seen = []
        undo = child_observer_waits(
            trainer, lambda codes: (seen.append(codes), time.sleep(0.5), alive_while_waiting.append(main.poll()))
        )
        assert "_run" in vars(observer), "no _ChildProcessObserver watches the launcher's procs"
        observer.join(timeout=30)
        assert alive_while_waiting == [None], "the observer killed rank 0 before the engine's report"
        assert seen == [[3, None]], seen  # the ranks' exit codes, the one that failed among them
        assert main.wait(timeout=10) == -9 and procs[1].wait(timeout=10) == -9  # then Lightning's kill, as before
        undo()
        assert "_run" not in vars(observer)
    finally:
        for proc in (main, *procs):
            proc.kill()
            proc.wait()


def test_lightning_cli_hparam_keys_are_the_ones_the_summary_leaves_out():
    from lightkeep.compat import CLI_HPARAM_KEYS
    from tests.helpers import cli_main

    cli = cli_main(STAND_IN, run=False)
    added = {k for k in (*cli.model.hparams_initial, *cli.datamodule.hparams_initial) if k.startswith("_")}
    assert added == set(CLI_HPARAM_KEYS), f"LightningCLI's hparam keys are now {sorted(added)}"


ENGINE = Path(__file__).resolve().parent.parent / "lightkeep"
ALLOWED = {"os._exit"}  # documented by Python


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_uses(source: str) -> list[str]:
    """Private names of other packages a module uses: ``x._y`` (x not ``self``/``cls``), imports of ``_y`` or from a
    ``_module``, and ``self._y`` in a class that never sets or defines ``_y`` (its base class's)."""
    tree = ast.parse(source)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            base = node.value
            if not (isinstance(base, ast.Name) and base.id in ("self", "cls")) and ast.unparse(node) not in ALLOWED:
                found.append(f"{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.ImportFrom) and node.module and not node.module.startswith("lightkeep"):
            private_module = any(_private(part) for part in node.module.split("."))
            found += [f"{node.lineno}: from {node.module} import {a.name}" for a in node.names
                      if private_module or _private(a.name)]  # fmt: skip
        elif isinstance(node, ast.Import):
            found += [f"{node.lineno}: import {a.name}" for a in node.names if any(map(_private, a.name.split(".")))]
        elif isinstance(node, ast.ClassDef) and node.bases:
            own = {n.name for n in node.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}
            own |= {t.id for n in node.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
            own |= {n.target.id for n in node.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
            attributes = [n for n in ast.walk(node) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)]
            mine = [n for n in attributes if n.value.id in ("self", "cls")]  # type: ignore[attr-defined]
            own |= {n.attr for n in mine if isinstance(n.ctx, ast.Store)}
            found += [
                f"{n.lineno}: self.{n.attr} (a base class's)" for n in mine if _private(n.attr) and n.attr not in own
            ]
    return found


def test_the_scan_finds_each_kind_of_private_use():
    source = """
from lightning.fabric.utilities.types import _PATH
from torch.distributed.checkpoint._traverse import set_element
import torch._dynamo
class Logger(TensorBoardLogger):
    def finalize(self):
        self._mine = 1
        return self._experiment, self._mine, trainer._signal_connector, os._exit
"""
    assert sorted(use.split(": ", 1)[1] for use in private_uses(source)) == [
        "from lightning.fabric.utilities.types import _PATH",
        "from torch.distributed.checkpoint._traverse import set_element",
        "import torch._dynamo",
        "self._experiment (a base class's)",
        "trainer._signal_connector",
    ]


def test_no_engine_module_but_the_compat_ones_uses_a_private_name_of_lightning_or_torch():
    uses = {
        path.name: private_uses(path.read_text())
        for path in sorted(ENGINE.rglob("*.py"))
        if not path.name.startswith("compat")
    }
    found = [f"engine/lightkeep/{name}:{use}" for name, names in uses.items() for use in names]
    assert not found, "private APIs outside engine/lightkeep/compat*.py:\n" + "\n".join(found)


def test_update_dataloader_rebuilds_a_loader_of_the_users_class_with_another_sampler():
    from lightning.pytorch.utilities import data

    assert hasattr(data, "_update_dataloader"), "lightning.pytorch.utilities.data._update_dataloader is gone"
    from torch.utils.data import DataLoader, SequentialSampler, TensorDataset

    class Loader(DataLoader):
        def __init__(self, dataset, note: str, **kwargs):
            super().__init__(dataset, **kwargs)
            self.note = note

    dataset = TensorDataset(torch.arange(10))
    sampler = SequentialSampler(range(10))
    rebuilt = loader_with_sampler(Loader(dataset, "mine", batch_size=3, shuffle=True, drop_last=True), sampler)
    assert type(rebuilt) is Loader and rebuilt.note == "mine" and rebuilt.dataset is dataset
    assert rebuilt.sampler is sampler and rebuilt.batch_size == 3 and rebuilt.drop_last


def test_accelerator_connector_holds_the_use_distributed_sampler_flag():
    assert hasattr(L.Trainer(logger=False)._accelerator_connector, "use_distributed_sampler"), (
        "Trainer._accelerator_connector.use_distributed_sampler is gone"
    )
    assert uses_distributed_sampler(L.Trainer(logger=False, accelerator="cpu"))
    assert not uses_distributed_sampler(L.Trainer(logger=False, accelerator="cpu", use_distributed_sampler=False))


def test_torch_pytree_tree_map_and_tree_leaves_walk_nested_batches():
    from lightkeep.compat_torch import tree_leaves, tree_map

    batch = {"x": torch.ones(2), "pair": (torch.zeros(1), [3])}
    assert tree_leaves(batch)[0] is batch["x"] and len(tree_leaves(batch)) == 3
    doubled = tree_map(lambda v: v * 2, batch)
    assert doubled["pair"][1] == [6] and torch.equal(doubled["x"], torch.full((2,), 2.0))


def test_model_parallel_setup_checks_configure_model_on_the_instance_and_the_shim_is_undone():
    import inspect

    from lightning.pytorch.strategies import ModelParallelStrategy
    from lightning.pytorch.utilities.model_helpers import is_overridden

    from lightkeep.compat import configure_model_counted_as_overridden

    assert 'is_overridden("configure_model", self.lightning_module)' in inspect.getsource(ModelParallelStrategy.setup)
    module = StandIn()
    assert not is_overridden("configure_model", module)
    with configure_model_counted_as_overridden(module):
        assert is_overridden("configure_model", module)
    assert not is_overridden("configure_model", module) and "configure_model" not in vars(module)


def test_fit_loop_epoch_loop_batch_progress_counts_micro_batches_rescaled_for_another_shape():
    from types import SimpleNamespace

    from lightning.pytorch.loops.progress import _BatchProgress

    from lightkeep.compat import LightningChanged
    from lightkeep.compat_loops import rescale_batch_progress

    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False)
    progress = trainer.fit_loop.epoch_loop.batch_progress
    assert isinstance(progress, _BatchProgress)
    # a save at the end of a rank's 5th micro-batch of 8 samples over 2 ranks (13 in all): counted ready, not completed
    for tracker, n in ((progress.current, 5), (progress.total, 13)):
        tracker.ready = tracker.started = tracker.processed = n
        tracker.completed = n - 1
    rescale_batch_progress(trainer, 8, 4)  # 1 rank of 4: twice the micro-batches
    assert (progress.current.ready, progress.current.processed, progress.current.completed) == (10, 10, 9)
    assert (progress.total.started, progress.total.completed) == (26, 25)
    with pytest.raises(ValueError, match="not a whole number of micro-batches of 16"):
        rescale_batch_progress(trainer, 4, 16)  # 10 x 4 samples are not whole micro-batches of 16
    gone = SimpleNamespace(fit_loop=SimpleNamespace(epoch_loop=SimpleNamespace()))
    with pytest.raises(LightningChanged, match=r"batch_progress.*Lightning \d"):
        rescale_batch_progress(gone, 8, 4)


def test_bar_values_are_converted_at_every_batch_end_and_read_from_staged_copies_instead():
    """Lightning's ``_ResultCollection.metrics`` converts each ``prog_bar`` value with the module-level
    ``convert_tensors_to_scalars`` of ``result.py`` (a sync per value and step on a GPU), and bars read
    ``_LoggerConnector.progress_bar_metrics``: what ``read_bar_values_without_waiting`` replaces. A Lightning that
    no longer converts there fails here and the patch can go."""
    import inspect

    from lightning.pytorch.trainer.connectors.logger_connector import logger_connector, result

    from lightkeep.compat_logging import _staged_bar_values, read_bar_values_without_waiting

    assert "convert_tensors_to_scalars(value)" in inspect.getsource(result._ResultCollection.metrics), (
        "_ResultCollection.metrics no longer converts prog_bar values: drop compat.read_bar_values_without_waiting"
    )
    convert, prop = result.convert_tensors_to_scalars, logger_connector._LoggerConnector.progress_bar_metrics
    undo = read_bar_values_without_waiting()
    try:
        assert read_bar_values_without_waiting()() is None  # twice is once: the second's undo does nothing
        results = result._ResultCollection(training=True)
        results.log("training_step", "loss", torch.tensor(2.0), on_step=True, on_epoch=False, prog_bar=True)
        pbar = results.metrics(on_step=True)["pbar"]
        assert isinstance(pbar["loss"], torch.Tensor), "still converted at every batch end"
        assert logger_connector._LoggerConnector.progress_bar_metrics.fget.staged
        staged: dict = {}  # what a bar's reads show: host copies from the read before
        assert _staged_bar_values(staged, {"loss": torch.tensor(2.0), "v_num": 3}) == {"loss": 2.0, "v_num": 3}
        assert _staged_bar_values(staged, {"loss": torch.tensor(5.0)}) == {"loss": 2.0}  # one read late
        assert _staged_bar_values(staged, {"loss": torch.tensor(7.0)}) == {"loss": 5.0}
    finally:
        undo()
    assert (
        result.convert_tensors_to_scalars is convert and logger_connector._LoggerConnector.progress_bar_metrics is prop
    )


def test_fused_adamw_skips_its_step_on_the_device_while_found_inf_is_set():
    """``compat.skips_steps_on_device`` (torch's ``_step_supports_amp_scaling``) and the skip it stands for: weights,
    moments and step counts of a fused AdamW stay bit-equal under ``found_inf = 1``; a plain AdamW has no skip."""
    from lightkeep.compat_torch import skips_steps_on_device

    weight = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.AdamW([weight], lr=0.1, fused=True)
    assert skips_steps_on_device(optimizer) and not skips_steps_on_device(torch.optim.AdamW([weight]))
    weight.grad = torch.ones(3)
    optimizer.step()
    before = (weight.detach().clone(), {k: v.clone() for k, v in optimizer.state[weight].items()})
    optimizer.found_inf = torch.ones(())
    weight.grad = torch.full((3,), float("nan"))
    optimizer.step()
    assert torch.equal(weight.detach(), before[0])
    assert all(torch.equal(v, before[1][k]) for k, v in optimizer.state[weight].items())


def test_fit_loop_epoch_loop_batches_that_stepped_is_the_loggers_step_one_per_batch_not_per_optimizer_step():
    from types import SimpleNamespace

    from lightkeep.compat import LightningChanged
    from lightkeep.compat_loops import logging_step
    from tests.fixtures.kinds import KindData, TwoOptimizers

    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=1, limit_train_batches=3, limit_val_batches=0,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)  # fmt: skip
    trainer.fit(TwoOptimizers(), KindData())
    assert (logging_step(trainer), trainer.global_step) == (3, 6)  # 3 batches, 2 optimizer steps each
    gone = SimpleNamespace(fit_loop=SimpleNamespace(epoch_loop=SimpleNamespace()))
    with pytest.raises(LightningChanged, match=r"_batches_that_stepped.*Lightning \d"):
        logging_step(gone)


def test_lightning_cli_parse_ckpt_path_is_what_reads_a_checkpoints_hyperparameters():
    """ParsesPlainLightningCheckpoints overrides LightningCLI._parse_ckpt_path: it must still be the method that
    LightningCLI calls once the arguments are parsed, reading a checkpoint's hyper_parameters into the config (what
    the override does with them: tests/test_plain_lightning.py)."""
    import inspect

    from lightning.pytorch.cli import LightningCLI

    from lightkeep.cli import CLI
    from lightkeep.compat import ParsesPlainLightningCheckpoints

    assert "_parse_ckpt_path" in vars(LightningCLI), "LightningCLI no longer has _parse_ckpt_path"
    assert "self._parse_ckpt_path()" in inspect.getsource(LightningCLI), "LightningCLI no longer calls it"
    assert "hyper_parameters" in inspect.getsource(LightningCLI._parse_ckpt_path)
    assert CLI.__mro__.index(ParsesPlainLightningCheckpoints) < CLI.__mro__.index(LightningCLI)


def test_training_epoch_loop_broadcast_sigterm_tensor_and_signal_connector_sigterm_notifier_fn_replaced_for_a_fit():
    """``sigterm_without_a_broadcast_per_batch``: under DDP Lightning calls
    ``_TrainingEpochLoop._broadcast_sigterm_tensor`` at the start of every training batch (a broadcast and a host
    read), and registers the instance's ``_SignalConnector._sigterm_notifier_fn`` as its SIGTERM handler, which
    passes the signal on to the ranks the launcher started. Replaced on the instances, a batch starts without a
    collective and a SIGTERM calls the engine's function (passed on once, Lightning's flag left alone); undone,
    Lightning's own are back."""
    import inspect
    import signal
    from types import SimpleNamespace
    from unittest import mock

    from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop
    from lightning.pytorch.trainer.connectors.signal_connector import _SignalConnector

    from lightkeep.compat import LightningChanged, sigterm_without_a_broadcast_per_batch

    assert "self._broadcast_sigterm_tensor()" in inspect.getsource(_TrainingEpochLoop.advance), (
        "_TrainingEpochLoop.advance no longer broadcasts the SIGTERM flag per batch (Lightning issue #21487 fixed?)"
    )
    assert "self._sigterm_notifier_fn" in inspect.getsource(_SignalConnector.register_signal_handlers)
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False)
    loop, connector, launcher = trainer.fit_loop.epoch_loop, trainer._signal_connector, mock.Mock()
    seen: list[str] = []
    before = signal.getsignal(signal.SIGTERM)

    def sigterm_then_batch_start() -> tuple[int, bool]:
        """Two SIGTERMs, then a batch's start: the broadcasts it makes, and whether it stops."""
        connector.register_signal_handlers()
        try:
            signal.getsignal(signal.SIGTERM)(signal.SIGTERM, None)
            signal.getsignal(signal.SIGTERM)(signal.SIGTERM, None)
        finally:
            connector.teardown()
        with mock.patch("torch.distributed.broadcast") as broadcast:
            try:
                loop._broadcast_sigterm_tensor()
            except SIGTERMException:
                return broadcast.call_count, True
        return broadcast.call_count, False

    with mock.patch.object(type(trainer.strategy), "launcher", mock.PropertyMock(return_value=launcher)):
        undo = sigterm_without_a_broadcast_per_batch(trainer, lambda: seen.append("sigterm"))
        assert sigterm_then_batch_start() == (0, False)  # no broadcast at the batch's start, no stop of this rank alone
        assert seen == ["sigterm", "sigterm"] and not connector.received_sigterm
        launcher.kill.assert_called_once_with(signal.SIGTERM)  # passed on to the other ranks, once
        undo()
        assert "_broadcast_sigterm_tensor" not in vars(loop) and "_sigterm_notifier_fn" not in vars(connector)
        connector.received_sigterm = False
        assert sigterm_then_batch_start() == (1, True)  # Lightning's own: a broadcast per batch (src=0), its stop
        assert connector.received_sigterm and seen == ["sigterm", "sigterm"]  # Lightning's flag, set by its handler
    assert signal.getsignal(signal.SIGTERM) is before
    gone = SimpleNamespace(fit_loop=SimpleNamespace(epoch_loop=SimpleNamespace()), _signal_connector=connector)
    with pytest.raises(LightningChanged, match=r"_broadcast_sigterm_tensor is gone.*Lightning \d"):
        sigterm_without_a_broadcast_per_batch(gone, lambda: None)


def _logged_means(other_rank: tuple[float, int] | None = None) -> tuple[dict, list, float]:
    """Epoch values of a ``_ResultCollection`` of plain tensors (mean, sum, max, min; synced or not, ``rank_zero_only``)
    and a logged ``MeanMetric``, as Lightning computes them at an epoch's end over 11 samples; the dtypes handed to
    the sync function; the sum of the 11 values. ``other_rank``: ``(sum of values, samples)`` of a second rank whose
    state a ``"mean"`` sync adds as gloo's ``_sync_ddp`` does (sum, then ``/ 2`` copied back into the tensor)."""
    from lightning.pytorch.trainer.connectors.logger_connector.result import _ResultCollection
    from torchmetrics import MeanMetric

    g = torch.Generator().manual_seed(0)
    results, metric = _ResultCollection(training=False), MeanMetric()
    handed: list[torch.dtype] = []

    def reduce(tensor: torch.Tensor, reduce_op: str | None = None, group: object = None) -> torch.Tensor:
        handed.append(tensor.dtype)
        if other_rank is None or reduce_op != "mean":
            return tensor
        theirs = other_rank[len(handed) % 2 == 0]  # Lightning syncs a mean's value, then its count
        return tensor.copy_((tensor + theirs) / 2)

    total = 0.0
    for batch_size in (4, 4, 3):
        values = torch.rand(batch_size, generator=g) * 3
        total += values.sum().item()
        metric.update(values)
        for name, kwargs in {
            "mean": {}, "synced": {"sync_dist": True}, "rank_zero_only": {"sync_dist": True, "rank_zero_only": True},
            "sum": {"reduce_fx": "sum", "sync_dist": True}, "max": {"reduce_fx": "max"}, "min": {"reduce_fx": "min"},
        }.items():  # fmt: skip
            results.log("validation_step", name, values.mean(), sync_dist_fn=reduce, batch_size=batch_size, **kwargs)
        results.log("validation_step", "metric", metric, batch_size=batch_size)
    return results.metrics(on_step=False)["callback"], handed, total


def test_result_metric_compute_divides_by_a_synced_integer_count_and_the_patch_makes_it_a_float(monkeypatch):
    """Lightning's ``_ResultMetric.compute`` hands ``value`` and the int64 ``cumulated_batch_size`` to the ``_Sync``
    of ``_Metadata.sync`` (``should``, ``rank_zero_only``, ``group``; ``is_tensor``, ``is_mean_reduction``), and a
    mean of integers over ranks truncates: what ``weigh_synced_means_by_samples`` casts. Two ranks of 11 and 10
    samples stand in for a DDP run. A Lightning that no longer truncates fails here, and the patch can go."""
    from lightning.pytorch.trainer.connectors.logger_connector.result import _ResultMetric

    from lightkeep import compat_logging
    from lightkeep.compat_logging import lightning_truncates_synced_counts, weigh_synced_means_by_samples

    assert lightning_truncates_synced_counts(), (
        "_ResultMetric.compute no longer syncs the integer cumulated_batch_size: drop weigh_synced_means_by_samples"
    )
    other = (10 * 2.0, 10)  # rank 1: 10 samples of 2.0
    lightning, handed, total = _logged_means(other)
    assert handed == [torch.float32, torch.int64, torch.float32]  # synced: value, count; sum: value
    assert lightning["synced"].item() == pytest.approx((total + 20) / 20, rel=1e-6)  # 21 / 2 -> 10: / 20, not 21
    monkeypatch.setattr(compat_logging, "_processes", lambda group: 2)  # the patch's test for a DDP run
    own = _ResultMetric.compute
    undo = weigh_synced_means_by_samples()
    try:
        assert weigh_synced_means_by_samples()() is None and _ResultMetric.compute is not own  # twice is once
        patched, handed, _ = _logged_means(other)
    finally:
        undo()
    assert _ResultMetric.compute is own, "not put back"
    assert handed == [torch.float32, torch.float32, torch.float32]
    assert patched["synced"].item() == pytest.approx((total + 20) / 21, rel=1e-6)
    assert all(torch.equal(patched[k], lightning[k]) for k in lightning if k != "synced")  # Lightning's own path


def test_synced_means_patch_leaves_single_process_values_bit_identical():
    """On one process every logged value (mean, sum, max, min, synced or not, a ``Metric``) is bit-equal to what
    Lightning's own ``_ResultMetric.compute`` gives."""
    from lightkeep.compat_logging import weigh_synced_means_by_samples

    lightning, _, _ = _logged_means()
    undo = weigh_synced_means_by_samples()
    try:
        patched, _, _ = _logged_means()
    finally:
        undo()
    assert lightning.keys() == patched.keys() and all(torch.equal(lightning[k], patched[k]) for k in lightning)


def test_lightning_ends_an_ended_epoch_again_under_max_steps(tmp_path):
    """Plain Lightning, ``max_steps`` set: resumed from the checkpoint a monitored ModelCheckpoint wrote at epoch 0's
    end, epoch 1 draws the sampler order of epoch 2 (``start_the_epoch_after_an_ended_one`` and
    ``start_the_epoch_loop_afresh`` put it right). If this fails because Lightning now draws epoch 1 as it should,
    the fix can go."""
    from lightning.pytorch.demos.boring_classes import BoringModel, RandomDataset
    from torch.utils.data import DataLoader, DistributedSampler

    from lightkeep.compat_loops import logging_step, start_the_epoch_after_an_ended_one, start_the_epoch_loop_afresh

    class Module(BoringModel):
        def train_dataloader(self):
            data = RandomDataset(32, 16)
            return DataLoader(data, batch_size=4, sampler=DistributedSampler(data, num_replicas=1, rank=0, seed=3))

        def validation_step(self, batch, batch_idx):
            self.log("v", self.step(batch))

    class Record(L.Callback):
        def __init__(self, rewrite: bool = False) -> None:
            self.rewrite, self.seen = rewrite, []

        def on_load_checkpoint(self, trainer, pl_module, checkpoint):
            if self.rewrite:
                assert start_the_epoch_after_an_ended_one(checkpoint, trainer.max_steps)

        def on_train_start(self, trainer, pl_module):
            if self.rewrite:
                start_the_epoch_loop_afresh(trainer)

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            sampler_epoch = trainer.train_dataloader.sampler.epoch
            self.seen.append((trainer.current_epoch, sampler_epoch, batch.sum().item(), logging_step(trainer)))

    def fit(epochs: int, record: Record, ckpt: Path | None = None) -> None:
        torch.manual_seed(0)
        every_epoch = ModelCheckpoint(dirpath=tmp_path, monitor="v", save_top_k=-1, filename="{epoch}")
        trainer = L.Trainer(max_epochs=epochs, max_steps=100, callbacks=[every_epoch, record], logger=False,
                            enable_progress_bar=False, enable_model_summary=False, limit_val_batches=1)  # fmt: skip
        trainer.fit(Module(), ckpt_path=ckpt)

    fit(3, whole := Record())
    fit(3, lightning := Record(), tmp_path / "epoch=0.ckpt")
    fit(3, rewritten := Record(rewrite=True), tmp_path / "epoch=0.ckpt")
    assert [seen[0] for seen in whole.seen] == [0] * 4 + [1] * 4 + [2] * 4
    assert lightning.seen[0][:2] == (1, 2) and len(lightning.seen) == 4  # epoch 1 in epoch 2's order, then stopped
    # epochs 1 and 2: the uninterrupted run's batches, at its logging steps (the loggers' x axis)
    assert rewritten.seen == whole.seen[4:]


def test_fit_loop_data_fetcher_batches_holds_the_batch_fetched_ahead_of_a_loader_without_a_length(tmp_path):
    """``batches_fetched_ahead``: during an epoch of an unsized loader Lightning's fetcher holds one batch more than
    training took (the position Lightning saves of a stateful loader is a batch ahead); none at its last batch, none
    of a sized loader."""
    from lightning.pytorch.demos.boring_classes import BoringModel
    from torch.utils.data import DataLoader, IterableDataset

    from lightkeep.compat_loops import batches_fetched_ahead

    class Stream(IterableDataset):
        def __iter__(self):
            return iter(torch.randn(5, 32))

    class Probe(L.Callback):
        seen: list[tuple[int, int]] = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.seen.append((batch_idx, batches_fetched_ahead(trainer)))

    for data, ahead in ((Stream(), [1, 1, 1, 1, 0]), (torch.randn(5, 32), [0] * 5)):
        Probe.seen = []
        quiet = {"enable_progress_bar": False, "enable_model_summary": False, "enable_checkpointing": False}
        trainer = L.Trainer(max_epochs=1, callbacks=[Probe()], logger=False, default_root_dir=tmp_path, **quiet)
        trainer.fit(BoringModel(), DataLoader(data, batch_size=1))
        assert [a for _, a in Probe.seen] == ahead, Probe.seen


def test_a_stateful_dataloader_rebuilt_by_lightning_names_the_sampler_its_batch_sampler_draws_from():
    """``sampler_of_its_batch_sampler``: Lightning rebuilds a torchdata ``StatefulDataLoader`` (its ``BatchSampler``
    is not torch's) with ``batch_size=None`` and a ``SequentialSampler`` in ``sampler``; torch's ``DataLoader``
    refuses those attributes after ``__init__``, and after the call they are the batch sampler's."""
    from torch.utils.data import SequentialSampler
    from torchdata.stateful_dataloader import StatefulDataLoader

    from lightkeep.compat import loader_with_sampler
    from lightkeep.compat_torch import sampler_of_its_batch_sampler

    class Hook(L.LightningDataModule):
        def train_dataloader(self):
            return StatefulDataLoader(range(10), batch_size=3, shuffle=True, drop_last=True)

    from lightning.fabric.utilities.data import _replace_dunder_methods
    from torch.utils.data import DataLoader

    with _replace_dunder_methods(DataLoader, "dataset"):  # as Lightning calls the hook: the arguments recorded
        loader = Hook().train_dataloader()
    mine = SequentialSampler(range(10))
    rebuilt = loader_with_sampler(loader, mine)
    assert rebuilt.batch_sampler.sampler is mine and isinstance(rebuilt.sampler, SequentialSampler)
    assert rebuilt.sampler is not mine and rebuilt.batch_size is None
    with pytest.raises(ValueError, match="sampler"):
        rebuilt.sampler = mine  # torch's guard, which the function passes by
    sampler_of_its_batch_sampler(rebuilt)
    assert (rebuilt.sampler, rebuilt.batch_size, rebuilt.drop_last) == (mine, 3, True)
    assert [list(b) for b in rebuilt] == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]


def test_fit_loop_leaves_loader_states_unloaded_after_estimated_stepping_batches_and_the_engine_loads_them(tmp_path):
    """Lightning #20550 by name: a ``configure_optimizers`` reading ``estimated_stepping_batches`` builds the train
    loaders before the checkpoint is restored; ``fit_loop._combined_loader_states_to_load`` then still holds the
    saved position at ``on_train_start``, and ``load_the_loader_states_lightning_left`` loads it."""
    from lightning.pytorch.demos.boring_classes import BoringModel
    from torch.utils.data import DataLoader

    from lightkeep.compat_loops import load_the_loader_states_lightning_left

    class Loader(DataLoader):
        loaded: list = []

        def state_dict(self):
            return {"at": 2}

        def load_state_dict(self, state):
            Loader.loaded.append(state)

    class Counting(BoringModel):
        def configure_optimizers(self):
            self.trainer.estimated_stepping_batches  # noqa: B018
            return super().configure_optimizers()

        def train_dataloader(self):
            return Loader(torch.randn(8, 32), batch_size=2)

    class Probe(L.Callback):
        def on_train_start(self, trainer, pl_module):
            self.pending = list(trainer.fit_loop._combined_loader_states_to_load)
            self.did = load_the_loader_states_lightning_left(trainer)

    quiet = {"enable_progress_bar": False, "enable_model_summary": False, "logger": False}
    # max_epochs: with max_steps alone estimated_stepping_batches counts no loader
    L.Trainer(max_epochs=1, limit_train_batches=2, default_root_dir=tmp_path, **quiet).fit(Counting())
    (ckpt,) = tmp_path.rglob("*.ckpt")
    probe = Probe()
    again = L.Trainer(max_epochs=2, limit_train_batches=2, default_root_dir=tmp_path, callbacks=[probe], **quiet)
    again.fit(Counting(), ckpt_path=ckpt)
    assert probe.pending == [{"at": 2}] and probe.did  # Lightning left it; the engine loaded it
    assert Loader.loaded == [{"at": 2}]


def test_lightning_skips_the_plateau_step_of_a_resumed_epoch_and_says_so_at_its_end(tmp_path):
    """Plain Lightning: resumed mid-epoch 1, ``ReduceLROnPlateau`` is not stepped at that epoch's end (``FitLoop``:
    not while restarting), so the LR halves twice where the uninterrupted run halved it three times;
    ``lightning_skips_the_plateau_step`` says so at that epoch's end (and at no other), and
    ``step_the_plateau_schedulers`` at the next epoch's start gives the uninterrupted LR. If this fails because
    Lightning now steps it, the fix can go."""
    from lightning.pytorch.demos.boring_classes import BoringModel

    from lightkeep.compat_loops import lightning_skips_the_plateau_step, step_the_plateau_schedulers

    class Module(BoringModel):
        def validation_step(self, batch, batch_idx):
            self.log("v", self.step(batch))

        def configure_optimizers(self):
            optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
            # never improves by 1000 % (not even on infinity): halves at every epoch's end
            plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=0.5, patience=0, threshold=10.0)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": plateau, "monitor": "v"}}

    class Step(L.Callback):
        def __init__(self) -> None:
            self.skipped: list[int] = []

        def on_train_epoch_end(self, trainer, pl_module):
            if lightning_skips_the_plateau_step(trainer):
                self.skipped.append(trainer.current_epoch)

        def on_train_epoch_start(self, trainer, pl_module):
            if self.skipped and self.skipped[-1] == trainer.current_epoch - 1:
                step_the_plateau_schedulers(trainer, self.skipped[-1])

    def fit(*more: L.Callback, ckpt: Path | None = None) -> float:
        every_5 = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=5, save_top_k=-1, filename="{step}")
        trainer = L.Trainer(max_epochs=3, limit_train_batches=4, limit_val_batches=1, callbacks=[every_5, *more],
                            logger=False, enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
        trainer.fit(Module(), ckpt_path=ckpt)
        return trainer.optimizers[0].param_groups[0]["lr"]

    assert fit(uninterrupted := Step()) == pytest.approx(0.0125)  # 0.1, halved at the ends of epochs 0, 1 and 2
    assert uninterrupted.skipped == []
    mid_epoch = tmp_path / "step=5.ckpt"  # epoch 1, batch 0 done
    assert torch.load(mid_epoch, weights_only=True)["epoch"] == 1
    assert fit(ckpt=mid_epoch) == pytest.approx(0.025)  # Lightning: epoch 1's end not stepped
    assert fit(step := Step(), ckpt=mid_epoch) == pytest.approx(0.0125) and step.skipped == [1]


def test_validation_loop_seen_batches_per_dataloader_is_the_step_of_on_step_validation_values(tmp_path):
    """``evaluation_logging_steps``: Lightning logs a ``validation_step`` value logged with ``on_step=True`` at its
    count of this process's validation batches (over the whole fit, not the sanity check's), and
    ``continue_evaluation_logging_steps`` at a validation's start moves where the next ones go."""
    from lightning.pytorch.demos.boring_classes import BoringModel
    from lightning.pytorch.loggers.logger import Logger

    from lightkeep.compat_logging import continue_evaluation_logging_steps, evaluation_logging_steps

    class Record(Logger):
        name, version = "record", 0

        def __init__(self) -> None:
            super().__init__()
            self.steps: list[int] = []

        def log_metrics(self, metrics, step=None) -> None:
            self.steps += [step for key in metrics if key == "v_step"]

        def log_hyperparams(self, params, *args, **kwargs) -> None:
            pass

    class Module(BoringModel):
        def validation_step(self, batch, batch_idx):
            self.log("v", self.step(batch), on_step=True, on_epoch=True)

    class Continue(L.Callback):
        def on_validation_start(self, trainer, pl_module):
            if not trainer.sanity_checking and trainer.current_epoch == 0:
                continue_evaluation_logging_steps(trainer, {0: 10})

    def fit(*more: L.Callback) -> tuple[list[int], dict[int, int]]:
        record = Record()
        trainer = L.Trainer(max_epochs=2, limit_train_batches=2, limit_val_batches=2, logger=record,
                            callbacks=list(more), enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, log_every_n_steps=1)  # fmt: skip
        trainer.fit(Module())
        return record.steps, evaluation_logging_steps(trainer)

    assert fit() == ([0, 1, 2, 3], {0: 4})
    assert fit(Continue()) == ([10, 11, 12, 13], {0: 14})


def test_fit_loop_combined_loader_mode_says_whether_several_train_loaders_are_cycled(tmp_path):
    """``train_loaders_cycle``: a dict of train loaders is combined in ``max_size_cycle`` mode (the shorter iterated
    again until the longest ends); a ``CombinedLoader`` of another mode, or one loader, is not cycled."""
    from lightning.pytorch.demos.boring_classes import BoringModel, RandomDataset
    from lightning.pytorch.utilities import CombinedLoader
    from torch.utils.data import DataLoader

    from lightkeep.compat_loops import train_loaders_cycle

    class Module(BoringModel):
        def __init__(self, loaders) -> None:
            super().__init__()
            self.loaders, self.seen = loaders, None

        def train_dataloader(self):
            return self.loaders

        def training_step(self, batch, batch_idx):
            self.seen = train_loaders_cycle(self.trainer)
            first = batch["a"] if isinstance(batch, dict) else batch
            return super().training_step(first, batch_idx)

    def cycled(loaders) -> bool:
        module = Module(loaders)
        L.Trainer(max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                  enable_model_summary=False, limit_val_batches=0).fit(module)  # fmt: skip
        return module.seen

    two = {"a": DataLoader(RandomDataset(32, 16), batch_size=4), "b": DataLoader(RandomDataset(32, 8), batch_size=4)}
    assert cycled(two) is True
    assert cycled(CombinedLoader(two, mode="max_size")) is False
    assert cycled(DataLoader(RandomDataset(32, 16), batch_size=4)) is False


@pytest.mark.parametrize("val_check_interval", [1.0, 3])
def test_a_fit_stopping_mid_epoch_validates_there_and_says_whether_it_was_due_and_a_checkpoint_can_skip_it(
    tmp_path, val_check_interval
):
    """Plain Lightning: ``trainer.should_stop`` set after batch 3 of an epoch of 4 validates there (and runs the
    epoch's end hooks); ``stopping_mid_epoch`` says so at that validation's start (not at the epoch end's), and
    ``validation_due_without_the_stop`` says whether Lightning would have validated there anyway (with
    ``val_check_interval`` 3, yes). ``skip_saves_at_this_step`` keeps a ``ModelCheckpoint`` by a monitor from
    saving at that step. If this fails because Lightning no longer validates at a stop, the engine's keeping the
    judges out of it (``lightkeep.monitored_values``) can go."""
    from lightning.pytorch.demos.boring_classes import BoringModel

    from lightkeep.compat import skip_saves_at_this_step
    from lightkeep.compat_loops import stopping_mid_epoch, validation_due_without_the_stop

    class Module(BoringModel):
        def validation_step(self, batch, batch_idx):
            self.log("v", self.step(batch))

    class Probe(L.Callback):
        def __init__(self) -> None:
            self.seen: list[tuple[int, bool, bool]] = []

        def on_train_batch_end(self, trainer, *_):
            trainer.should_stop = trainer.global_step == 7  # epoch 1, batch 2 of 0..3

        def on_validation_start(self, trainer, pl_module):
            if not trainer.sanity_checking:
                stopping, due = stopping_mid_epoch(trainer), validation_due_without_the_stop(trainer)
                self.seen.append((trainer.global_step, stopping, due))
                if stopping and not due:
                    skip_saves_at_this_step(best, trainer)

    probe = Probe()
    best = ModelCheckpoint(dirpath=tmp_path, monitor="v", save_top_k=-1, filename="{step}")
    quiet = {"logger": False, "enable_progress_bar": False, "enable_model_summary": False}
    trainer = L.Trainer(max_epochs=3, limit_train_batches=4, limit_val_batches=1, val_check_interval=val_check_interval,
                        callbacks=[probe, best], **quiet)  # fmt: skip
    trainer.fit(Module())
    files = sorted(p.name for p in tmp_path.glob("*.ckpt"))
    if val_check_interval == 3:  # after the 3rd batch of each epoch: step 7 is one
        assert probe.seen == [(3, False, True), (7, True, True)] and files == ["step=3.ckpt", "step=7.ckpt"]
    else:  # at each epoch's end
        assert probe.seen == [(4, False, True), (7, True, False)] and files == ["step=4.ckpt"], (probe.seen, files)


def test_a_batch_end_says_whether_it_stepped_and_a_max_steps_end_mid_epoch_is_a_stop_mid_epoch():
    """Plain Lightning, 7 batches an epoch accumulated by 3: ``accumulating`` is true at exactly the batch ends
    that took no optimizer step (the global step unchanged; the epoch's last batch steps), ``batches_accumulated``
    counts the batches summed since the last step, and
    ``stop_requested`` reads what ``request_stop_at_batch_end`` sets. ``max_steps`` 4 ends the fit after epoch 1's
    batch 3 of 7: ``stopping_mid_epoch`` says so at the epoch's end hooks Lightning runs there."""
    from lightning.pytorch.demos.boring_classes import BoringModel

    from lightkeep.compat import request_stop_at_batch_end, stop_requested
    from lightkeep.compat_loops import accumulating, batches_accumulated, stopping_mid_epoch

    class Probe(L.Callback):
        def __init__(self) -> None:
            self.steps_seen, self.said, self.ends, self.counted = [], [], [], []

        def on_train_batch_start(self, trainer, *_):
            self.steps_seen.append(trainer.global_step)

        def on_train_batch_end(self, trainer, *_):
            stepped = trainer.global_step != self.steps_seen[-1]
            self.said.append((accumulating(trainer), stepped))
            self.counted.append(batches_accumulated(trainer))
            request_stop_at_batch_end(trainer)
            assert stop_requested(trainer)
            request_stop_at_batch_end(trainer, stop=False)
            assert not stop_requested(trainer)

        def on_train_epoch_end(self, trainer, pl_module):
            self.ends.append((trainer.global_step, stopping_mid_epoch(trainer)))

    probe = Probe()
    quiet = {"logger": False, "enable_progress_bar": False, "enable_model_summary": False}
    trainer = L.Trainer(max_steps=4, limit_train_batches=7, limit_val_batches=0, accumulate_grad_batches=3,
                        enable_checkpointing=False, callbacks=[probe], **quiet)  # fmt: skip
    trainer.fit(BoringModel())
    assert [stepped for _, stepped in probe.said] == [False, False, True, False, False, True, True, False, False, True]
    assert all(accumulating_ is not stepped for accumulating_, stepped in probe.said), probe.said
    assert probe.counted == [1, 2, 0, 1, 2, 0, 0, 1, 2, 0], probe.counted  # summed in .grad, not yet stepped
    assert probe.ends == [(3, False), (4, True)], probe.ends


def test_ddp_strategy_setup_model_and_register_ddp_hooks_wrap_the_module_again_with_what_trains_now(tmp_path):
    """``rewrap_ddp``: ``DDPStrategy._setup_model`` builds a new ``DistributedDataParallel`` around the strategy's
    module and ``_register_ddp_hooks`` takes no argument. DDP keeps the parameters that required a gradient when it
    was built (``_get_ddp_logging_data``'s count): 1 of the layer's 2 with its bias frozen, both once built again.
    One process in a gloo group of one (no Lightning launcher)."""
    from types import SimpleNamespace

    import torch.distributed as dist
    from lightning.pytorch.accelerators import CPUAccelerator
    from lightning.pytorch.demos.boring_classes import BoringModel
    from lightning.pytorch.strategies import DDPStrategy
    from torch.nn.parallel import DistributedDataParallel

    from lightkeep.compat import LightningChanged, rewrap_ddp

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        module = BoringModel()
        strategy = DDPStrategy(accelerator=CPUAccelerator(), parallel_devices=[torch.device("cpu")])
        strategy.connect(module)
        module.layer.bias.requires_grad_(False)
        strategy.model = first = strategy._setup_model(module)  # as configure_ddp before the fit
        assert first._get_ddp_logging_data()["num_parameter_tensors"] == 1
        module.layer.bias.requires_grad_(True)
        rewrap_ddp(SimpleNamespace(strategy=strategy))  # type: ignore[arg-type]
        again = strategy.model
        assert isinstance(again, DistributedDataParallel) and again is not first and again.module is module
        assert again._get_ddp_logging_data()["num_parameter_tensors"] == 2
    finally:
        dist.destroy_process_group()
    with pytest.raises(LightningChanged, match="_setup_model is gone"):
        rewrap_ddp(SimpleNamespace(strategy=SimpleNamespace()))  # type: ignore[arg-type]


def test_a_batch_fetched_and_not_yet_trained_is_under_way_until_its_step_is_done():
    """``batch_under_way``: Lightning counts a training batch ready before ``on_train_batch_start`` and processed
    after its step, so from that hook until the step is done the batch's index is under way (what an exception's
    save, ``OnExceptionCheckpoint``'s, sees), and at the batch end nothing is."""
    from lightning.pytorch.demos.boring_classes import BoringModel

    from lightkeep.compat_loops import batch_under_way

    class Probe(L.Callback):
        def __init__(self) -> None:
            self.seen: list[tuple[int, int | None, int | None]] = []
            self.in_step: int | None = None

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.at_start = batch_under_way(trainer)

        def on_before_backward(self, trainer, pl_module, loss):
            self.in_step = batch_under_way(trainer)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.seen.append((batch_idx, self.at_start, self.in_step))
            assert batch_under_way(trainer) is None

    probe = Probe()
    quiet = {"logger": False, "enable_progress_bar": False, "enable_model_summary": False}
    trainer = L.Trainer(max_epochs=2, limit_train_batches=3, limit_val_batches=0, callbacks=[probe],
                        enable_checkpointing=False, **quiet)  # fmt: skip
    trainer.fit(BoringModel())
    assert probe.seen == [(i, i, i) for i in (0, 1, 2)] * 2


@pytest.mark.parametrize("step", [6, 4], ids=["mid-epoch", "last-batch-end"])
def test_fit_loop_restarted_mid_epoch_says_at_train_start_that_lightning_skips_the_epoch_start(step, tmp_path):
    """Plain Lightning, 4 batches an epoch: resumed from step 6 (epoch 1, batch 2) or step 4 (epoch 0's last batch
    end), the fit loop starts epoch 1 without ``on_train_epoch_start``, and ``lightning_skips_the_epoch_start`` says
    so at ``on_train_start`` (``current_epoch`` already 1); a fresh fit calls it and is not flagged. If this fails
    because Lightning calls the hook on such a resume, the engine's call of the module's can go."""
    from lightning.pytorch.demos.boring_classes import BoringModel

    from lightkeep.compat_loops import lightning_skips_the_epoch_start

    class Module(BoringModel):
        def __init__(self) -> None:
            super().__init__()
            self.seen: list[tuple[str, int, bool | None]] = []

        def on_train_start(self) -> None:
            self.seen.append(("train_start", self.current_epoch, lightning_skips_the_epoch_start(self.trainer)))

        def on_train_epoch_start(self) -> None:
            self.seen.append(("epoch_start", self.current_epoch, None))

    quiet = {"logger": False, "enable_progress_bar": False, "enable_model_summary": False, "limit_val_batches": 0,
             "limit_train_batches": 4, "max_epochs": 3}  # fmt: skip
    saves = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=step, save_top_k=-1, filename="{step}")
    fresh = Module()
    L.Trainer(max_steps=step, callbacks=[saves], **quiet).fit(fresh)
    assert fresh.seen[:2] == [("train_start", 0, False), ("epoch_start", 0, None)]
    resumed = Module()
    L.Trainer(enable_checkpointing=False, **quiet).fit(resumed, ckpt_path=str(tmp_path / f"step={step}.ckpt"))
    assert resumed.seen == [("train_start", 1, True), ("epoch_start", 2, None)]


def test_the_modules_batch_end_and_validation_end_run_once_before_the_checkpoint_callbacks(tmp_path):
    """Lightning lists the checkpoint callbacks after all others, calls each callback's hook and then the module's,
    looked up on the instance: ``call_the_modules_hook_before_the_saves``, from a callback, runs the module's hook
    before the checkpoint callbacks' and Lightning's own call is then a no-op (each hook once per point). If
    Lightning stops calling the module's hook after the callbacks', the next early call says so."""
    from lightning.pytorch.demos.boring_classes import BoringModel

    from lightkeep.compat import LightningChanged
    from lightkeep.compat_loops import call_the_modules_hook_before_the_saves, forget_the_early_calls

    seen: list[tuple] = []

    class Module(BoringModel):
        def on_train_batch_end(self, outputs, batch, batch_idx):
            seen.append(("module", batch_idx))

        def on_validation_end(self):
            seen.append(("module", "validation"))

    class Saves(ModelCheckpoint):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            seen.append(("checkpoint", batch_idx))

        def on_validation_end(self, trainer, pl_module):
            seen.append(("checkpoint", "validation"))

    class Early(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            call_the_modules_hook_before_the_saves(pl_module, "on_train_batch_end", outputs, batch, batch_idx)

        def on_validation_end(self, trainer, pl_module):
            call_the_modules_hook_before_the_saves(pl_module, "on_validation_end")

    module = Module()
    trainer = L.Trainer(max_epochs=1, limit_train_batches=2, limit_val_batches=1, num_sanity_val_steps=0,
                        callbacks=[Saves(dirpath=tmp_path), Early()], logger=False, enable_progress_bar=False,
                        enable_model_summary=False)  # fmt: skip
    trainer.fit(module)
    assert seen == [("module", 0), ("checkpoint", 0), ("module", 1), ("checkpoint", 1), ("module", "validation"),
                    ("checkpoint", "validation")]  # fmt: skip
    assert not {"on_train_batch_end", "on_validation_end"} & set(vars(module))
    call_the_modules_hook_before_the_saves(module, "on_validation_end")  # and Lightning's call of it never comes
    with pytest.raises(LightningChanged, match="did not call the module's on_validation_end after the callbacks'"):
        call_the_modules_hook_before_the_saves(module, "on_validation_end")
    call_the_modules_hook_before_the_saves(module, "on_train_batch_end", None, None, 0)
    forget_the_early_calls(module)
    assert not {"on_train_batch_end", "on_validation_end"} & set(vars(module))


def test_a_tuner_callbacks_search_takes_the_fits_checkpoint_for_its_own_and_sets_the_rate_it_found(tmp_path):
    """What ``lightkeep.tuners`` works around, in plain Lightning: after a ``LearningRateFinder``'s search (in its
    ``on_fit_start``) ``trainer.ckpt_path`` is the search's temporary file, the rate it found is on every param group,
    and on a resume the search consumed the loaded checkpoint, so training starts at step 0, not at the checkpoint's
    step 4. If this fails because Lightning restores the resume's state after the search, ``lightkeep.tuners`` can
    let a resume search again. And ``BatchSizeFinder._batch_arg_name``."""
    from lightning.pytorch.callbacks import BatchSizeFinder, LearningRateFinder
    from lightning.pytorch.demos.boring_classes import BoringModel

    from lightkeep.compat import batch_size_finders_attribute

    assert batch_size_finders_attribute(BatchSizeFinder(batch_arg_name="per_device")) == "per_device"
    seen: dict = {}

    class Probe(L.Callback):
        def on_fit_start(self, trainer, pl_module):  # after the finder's: Lightning lists tuners first
            seen["ckpt_path"] = trainer.ckpt_path
            seen["lrs"] = [group["lr"] for group in trainer.optimizers[0].param_groups]

        def on_train_start(self, trainer, pl_module):
            seen["step"] = trainer.global_step

    class Module(BoringModel):
        def __init__(self) -> None:
            super().__init__()
            self.lr = 0.1

        def configure_optimizers(self):
            return torch.optim.SGD(self.layer.parameters(), lr=self.lr)

    quiet = {"logger": False, "enable_progress_bar": False, "enable_model_summary": False, "limit_val_batches": 0}
    finder = LearningRateFinder(num_training_steps=20)
    saves = ModelCheckpoint(dirpath=tmp_path / "saves", every_n_train_steps=4, save_top_k=-1, filename="{step}")
    L.Trainer(max_steps=4, callbacks=[Probe(), finder, saves], default_root_dir=tmp_path, **quiet).fit(Module())
    assert Path(seen["ckpt_path"]).name.startswith(".lr_find_")
    found = finder.optimal_lr.suggestion()
    assert found is not None and seen["lrs"] == [found]
    trainer = L.Trainer(max_steps=8, callbacks=[Probe(), LearningRateFinder(num_training_steps=20)],
                        default_root_dir=tmp_path, enable_checkpointing=False, **quiet)  # fmt: skip
    trainer.fit(Module(), ckpt_path=tmp_path / "saves" / "step=4.ckpt")
    assert seen["step"] == 0


def test_the_training_loops_logged_values_keep_their_running_sums_in_result_metrics_that_a_resume_continues():
    """``epoch_accumulators`` reads each ``_ResultMetric``'s ``value`` and ``cumulated_batch_size`` of a tensor logged
    with ``on_epoch=True`` from ``fit_loop.epoch_loop._results``; ``continue_epoch_accumulators`` gives them to a fresh
    collection's metric before its first ``update_metrics``, so the epoch's mean covers the batches of both."""
    from types import SimpleNamespace

    from lightning.pytorch.trainer.connectors.logger_connector.result import _ResultCollection

    from lightkeep.compat_logging import continue_epoch_accumulators, epoch_accumulators

    def trainer_of(results):
        return SimpleNamespace(fit_loop=SimpleNamespace(epoch_loop=SimpleNamespace(_results=results)))

    before = _ResultCollection(training=True)
    for value in (1.0, 2.0):
        before.log("training_step", "loss", torch.tensor(value), on_step=False, on_epoch=True, batch_size=2)
    before.log("training_step", "top", torch.tensor(5.0), on_step=False, on_epoch=True, reduce_fx="max")
    before.log("training_step", "now", torch.tensor(7.0), on_step=True, on_epoch=False)  # no epoch value: left out
    saved = epoch_accumulators(trainer_of(before))
    assert saved == {"training_step.loss": {"value": torch.tensor(6.0), "cumulated_batch_size": torch.tensor(4)},
                     "training_step.top": {"value": torch.tensor(5.0)}}  # fmt: skip
    after = _ResultCollection(training=True)
    continue_epoch_accumulators(trainer_of(after), saved)
    after.log("training_step", "loss", torch.tensor(3.0), on_step=False, on_epoch=True, batch_size=2)
    assert "update_metrics" in vars(after)  # "top" not logged again yet
    after.log("training_step", "top", torch.tensor(4.0), on_step=False, on_epoch=True, reduce_fx="max")
    assert "update_metrics" not in vars(after)
    assert after["training_step.loss"].compute() == 2.0 and after["training_step.top"].compute() == 5.0


def test_a_checkpoint_holds_the_data_modules_state_under_its_class_qualname(tmp_path):
    """``datamodule_state_in``: Lightning saves a data module's ``state_dict`` under ``type(dm).__qualname__``."""
    from lightning.pytorch.demos.boring_classes import BoringDataModule, BoringModel

    from lightkeep.compat import datamodule_state_in

    class Staged(BoringDataModule):
        def state_dict(self):
            return {"stage": 3}

    data = Staged()
    trainer = L.Trainer(max_steps=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, default_root_dir=tmp_path)  # fmt: skip
    trainer.fit(BoringModel(), datamodule=data)
    trainer.save_checkpoint(tmp_path / "saved.ckpt")
    saved = torch.load(tmp_path / "saved.ckpt", weights_only=True)
    assert datamodule_state_in(saved, data) == {"stage": 3} and datamodule_state_in(saved, None) is None


def test_a_spike_detection_loads_its_own_state_with_the_engines_help():
    """``compat.spike_detection_loads_its_state``: Lightning 2.6's ``SpikeDetection.load_state_dict`` reads
    ``self.running`` (PR #21752); with the engine's help an instance loads what another saved, on any Lightning."""
    from lightning.pytorch.callbacks import SpikeDetection

    from lightkeep.compat import spike_detection_loads_its_state

    saved = SpikeDetection(warmup=3)
    saved.last_val, saved.bad_batches = 0.25, [7]
    loaded = SpikeDetection()
    spike_detection_loads_its_state(loaded)
    loaded.load_state_dict(saved.state_dict())
    assert (loaded.last_val, loaded.bad_batches, loaded.warmup) == (0.25, [7], 3)
    assert not hasattr(loaded, "running")  # the name is lent for the call only


def test_torchruns_exit_barrier_runs_on_a_thread_the_launcher_waits_for():
    """``exit_barrier_waits`` (``lightkeep.torchrun``): torchrun's ``SimpleElasticAgent._exit_barrier``, its wait for
    every node's agent once its workers finished, runs on a thread the caller's ``wait`` joins; as it was after."""
    from types import SimpleNamespace

    import torch.distributed as dist
    from torch.distributed.elastic.agent.server.api import SimpleElasticAgent

    from lightkeep.compat_torch import exit_barrier_waits

    before = SimpleElasticAgent.__dict__["_exit_barrier"]
    group = SimpleNamespace(state="SUCCEEDED", group_world_size=1)  # one agent: its barrier passes at once
    agent = SimpleNamespace(_worker_group=group, _store=dist.HashStore(), _exit_barrier_timeout=10,
                            _in_exit_barrier=False)  # fmt: skip
    waited: list[bool] = []

    def wait(thread) -> None:
        thread.join(10)
        waited.append(thread.is_alive())

    with exit_barrier_waits(wait):
        SimpleElasticAgent._exit_barrier(agent)  # type: ignore[arg-type]
    assert waited == [False], "SimpleElasticAgent._exit_barrier did not run on the thread handed to wait"
    assert SimpleElasticAgent.__dict__["_exit_barrier"] is before
