"""The private Lightning APIs the engine relies on, in one place; tests/test_compat.py fails, naming the attribute,
on a Lightning version where one changed.

- ``Trainer._signal_connector.received_sigterm``: set at a batch end, it makes every rank stop there through
  Lightning's own SIGTERM path (``project.engine.signals``: Ctrl-C agreed by all ranks).
- ``LightningCLI._get``: reads the trainer section of the parsed config (``project.engine.cli``).
- CSV writer's ``metrics_keys`` (``lightning.fabric.loggers.csv_logs._ExperimentWriter``): the columns a continued
  ``metrics.csv`` already has (``project.engine.runs.keep_csv_history``).
- ``ModelParallelStrategy._data_parallel_size`` / ``_tensor_parallel_size``: the mesh sizes its
  ``setup_environment`` reads; ``auto`` data parallelism is set to every rank (``project.engine.sharded``).
- torch's ``torch.distributed.checkpoint._traverse.set_element``: how DCP's own load planner puts a non-tensor value
  into a nested state dict; the engine's planner does the same, reading the value with ``weights_only=True``.
- ``Callback._generate_state_key``'s format, ``ClassName{'monitor': ..., 'mode': ...}``: the key a checkpoint files
  each callback's state under, read back for a ``ModelCheckpoint``'s ``mode`` (``project.engine.best``).
- ``ModelCheckpoint._should_skip_saving_checkpoint`` / ``_save_last_checkpoint`` / ``_monitor_candidates``: the
  end-of-fit refresh of ``last.ckpt`` (``project.engine.last_checkpoint``), with Lightning's own bookkeeping of
  ``last_model_path`` and its skips (``fast_dev_run``, not fitting, already saved at this step).
- ``lightning.pytorch.utilities.data._update_dataloader``: re-creates a loader (a ``DataLoader`` subclass too) from
  the arguments its ``*_dataloader`` hook gave it, with another sampler, as Lightning puts in its
  ``DistributedSampler`` (``project.engine.user_loaders``).
- ``Trainer._accelerator_connector.use_distributed_sampler``: the Trainer's ``use_distributed_sampler`` flag after
  Lightning resolved it (``project.engine.user_loaders``).
- ``_ResultMetric.to``, called by ``_ResultCollection.log`` at every ``self.log``: replaced by one that skips the
  move when the values are already on the device (``skip_moves_already_done``, installed for a run by
  ``project.engine.run_scope`` and put back after; Lightning issue #20388).
- ``_ResultCollection.metrics``' conversion of ``prog_bar`` values (``result.convert_tensors_to_scalars``) and
  ``_LoggerConnector.progress_bar_metrics``: the values stay tensors until a bar reads them, then come from host
  copies staged at its previous read (``read_bar_values_without_waiting``, installed for a run by
  ``project.engine.run_scope``).
- torch's ``Optimizer._step_supports_amp_scaling``: the optimizer's step takes GradScaler's ``found_inf`` and skips
  itself on the device when it is set (fused ``Adam``/``AdamW``/``SGD``...; ``skips_steps_on_device``,
  ``project.engine.guards``).
- The fit loop's saved counters (``loops.fit_loop``: ``epoch_loop.batch_progress``, ``epoch_progress``), rewritten
  when a fit stopped mid-epoch (``reopen_an_epoch_stopped_mid_way``, ``project.engine.resume``).
- The fit loop's live micro-batch counters (``fit_loop.epoch_loop.batch_progress``: ``current`` and ``total``, each
  ``ready``/``started``/``processed``/``completed``), rescaled on a resume on another number of ranks
  (``rescale_batch_progress``, ``project.engine.resume``).
- ``on_train_epoch_start`` skipped by Lightning 2.6 on a resume from an epoch's last batch end
  (``start_the_epoch_lightning_skipped``, ``project.engine.resume``).
- ``ModelCheckpoint.file_exists`` replaced on an instance, so that a save still being written counts as a file
  (``count_pending_saves_as_files``, ``project.engine.one_file_per_point``).
- A logger's ``log_metrics`` replaced on an instance (``replace_log_metrics``, ``project.engine.loggers.StepGate``);
  ``TensorBoardLogger._experiment``, whether its writer was ever opened (``experiment_opened``).
- torch's ``LRScheduler._last_lr``, what ``get_last_lr()`` returns (``set_last_lr``, ``project.engine.schedule``).
- ``Tensor._version``, the in-place version counter (``version_counter``, ``project.engine.host_snapshot``).
- torch's per-thread config overrides (``torch.utils._config_module``): ``crc32_off_in_this_thread`` leaves the
  CRC-32 of this thread's ``torch.save`` out without touching any other thread's.
- DCP's ``DefaultLoadPlanner`` internals (``original_state_dict``, ``mappings``) and ``FileSystemReader.load_id``
  (``load_bytes_weights_only``, ``index_for_reader``, ``project.engine.sharded``).
- The ``ddp`` launcher's ``procs`` (``launched_children``) and gloo's messages for a lost peer (``PEER_GONE``,
  ``project.engine.rank_failures``).
- The keys LightningCLI adds to ``hparams`` (``CLI_HPARAM_KEYS``, ``project.engine.summary``).

On a layout these functions do not know they raise ``LightningChanged``, one line naming the attribute and the
Lightning (or torch) version: the engine stops rather than continue inexactly.
"""

import ast
import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from typing import Any

import lightning as L
import torch
from torchmetrics import Metric


class LightningChanged(RuntimeError):
    """A private API the engine relies on is not what it was: the engine stops rather than run inexactly."""

    def __init__(self, what: str) -> None:
        super().__init__(
            f"{what} (Lightning {L.__version__}, torch {torch.__version__}): this version changed a private API the "
            "engine relies on (project/engine/compat.py; tests/test_compat.py names it). Install a lightning/torch "
            "that pyproject.toml allows, or update compat.py"
        )


def request_stop_at_batch_end(trainer: L.Trainer, stop: bool = True) -> None:
    """Every rank raises Lightning's ``SIGTERMException`` at the end of the current training batch (``stop=False``
    withdraws the request; validation also raises it after each of its batches but the last)."""
    trainer._signal_connector.received_sigterm = stop


def cli_section(cli: Any, config: Any, key: str) -> Any:
    """``config[subcommand][key]`` of a LightningCLI's parsed or instantiated config (``{}`` when absent)."""
    return cli._get(config, key, default={})


def set_csv_columns(writer: Any, columns: list[str]) -> None:
    writer.metrics_keys = list(columns)


def shard_over_all_ranks(strategy: Any) -> None:
    """``data_parallel_size="auto"`` of a ``ModelParallelStrategy``: every rank divided by the tensor-parallel size
    (Lightning's ``auto`` is one group per node). Call before ``setup_environment``."""
    if strategy._data_parallel_size == "auto":
        strategy._data_parallel_size = (
            strategy.num_nodes * strategy.num_processes // int(strategy._tensor_parallel_size)
        )


@contextlib.contextmanager
def configure_model_counted_as_overridden(module: L.LightningModule) -> Iterator[None]:
    """``ModelParallelStrategy.setup`` refuses a module that does not override ``configure_model`` (it checks with
    ``is_overridden`` on the instance); ``ShardedStrategy`` shards such a module itself. For the duration, the
    instance has a ``configure_model`` of its own that does nothing; the class is untouched."""
    module.configure_model = _already_sharded  # type: ignore[method-assign]
    try:
        yield
    finally:
        vars(module).pop("configure_model", None)


def _already_sharded() -> None:
    """Sharded by ``project.engine.sharded.shard_each_layer``."""


def set_nested(state_dict: dict[str, Any], path: Any, value: Any) -> None:
    from torch.distributed.checkpoint._traverse import set_element

    set_element(state_dict, path, value)


def state_key_arguments(state_key: str) -> dict[str, Any]:
    """The arguments a callback's ``state_key`` holds (``ModelCheckpoint``: ``monitor``, ``mode``, ...); ``{}`` for a
    key of another shape."""
    _, brace, arguments = state_key.partition("{")
    try:
        parsed = ast.literal_eval(brace + arguments)
    except (ValueError, SyntaxError):
        return {}
    return parsed if isinstance(parsed, dict) else {}


def save_last_unless_saved_at_this_step(callback: Any, trainer: L.Trainer) -> None:
    """``callback`` (a ``ModelCheckpoint`` with ``save_last``) writes ``last.ckpt`` now, unless it already did at this
    global step or Lightning would not save here at all."""
    if callback.save_last and not callback._should_skip_saving_checkpoint(trainer):
        callback._save_last_checkpoint(trainer, callback._monitor_candidates(trainer))


def loader_with_sampler(loader: Any, sampler: Any) -> Any:
    """A new loader of ``loader``'s class, built from the arguments it was built with but ``sampler`` (``shuffle``
    off), as Lightning injects its ``DistributedSampler``; raises Lightning's ``MisconfigurationException`` (or a
    ``TypeError``) when the class does not expose those arguments. Call it inside a ``*_dataloader`` hook, where
    Lightning records them."""
    from lightning.pytorch.utilities.data import _update_dataloader

    return _update_dataloader(loader, sampler)


def uses_distributed_sampler(trainer: L.Trainer) -> bool:
    """The Trainer's ``use_distributed_sampler``: whether Lightning puts a ``DistributedSampler`` into loaders."""
    return bool(trainer._accelerator_connector.use_distributed_sampler)


def skip_moves_already_done() -> Callable[[], None]:
    """Makes ``self.log`` skip moves already done; returns what puts Lightning's own ``_ResultMetric.to`` back.

    Lightning issue #20388: ``self.log`` moves its stored result to the logged value's device at every call
    (``_ResultCollection.log``: ``self[key].to(value.device)``), and ``_ResultMetric.to`` walks and deep-copies the
    whole metric object to do it: ~280 us a call here, paid by every per-step ``self.log``, although after the first
    call everything is already there (an upstream fix is proposed in Lightning PR #21769). Skipped when the last
    move went to that device and the values are still on it; any other move (Lightning's ``_results.cpu()``, a new
    device), and any result holding a value this does not know, takes Lightning's own path. Nothing is installed
    where Lightning no longer moves at every call (a probe, once), or where it already is (the undo then does
    nothing).
    """
    from lightning.pytorch.trainer.connectors.logger_connector.result import _ResultMetric

    move = _ResultMetric.to
    if getattr(move, "skips_moves_already_done", False) or not lightning_moves_at_every_log():
        return lambda: None

    def to(self: Any, *args: Any, **kwargs: Any) -> Any:
        device = args[0] if len(args) == 1 and not kwargs else None
        if isinstance(device, torch.device) and self.__dict__.get("_moved_to") == device and _values_on(self, device):
            return self
        move(self, *args, **kwargs)
        self.__dict__["_moved_to"] = device if isinstance(device, torch.device) else None
        return self

    to.skips_moves_already_done = True  # type: ignore[attr-defined]
    to.__wrapped__ = move  # type: ignore[attr-defined]
    _ResultMetric.to = to

    def undo() -> None:
        if _ResultMetric.__dict__.get("to") is to:  # else replaced since by someone else: theirs stays
            _ResultMetric.to = move

    return undo


def moves_skipped() -> bool:
    """Whether ``skip_moves_already_done`` is in force."""
    from lightning.pytorch.trainer.connectors.logger_connector.result import _ResultMetric

    return getattr(_ResultMetric.to, "skips_moves_already_done", False)


@functools.cache
def lightning_moves_at_every_log() -> bool:
    """Whether ``_ResultCollection.log`` still calls ``_ResultMetric.to`` when the same key is logged again."""
    from lightning.pytorch.trainer.connectors.logger_connector.result import _ResultCollection, _ResultMetric

    calls: list[int] = []
    move = _ResultMetric.to

    def counting(self: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return move(self, *args, **kwargs)

    _ResultMetric.to = counting
    try:
        results = _ResultCollection(training=True)
        results.log("training_step", "probe", torch.tensor(0.0), on_step=True, on_epoch=True, batch_size=1)
        calls.clear()
        results.log("training_step", "probe", torch.tensor(1.0), on_step=True, on_epoch=True, batch_size=1)
    except (TypeError, AttributeError) as error:
        raise LightningChanged(f"_ResultCollection.log no longer works as it did ({error})") from error
    finally:
        _ResultMetric.to = move
    return bool(calls)


# What a _ResultMetric holds besides its states (``_defaults``): Metric's caches, and the logged Metric itself.
_KNOWN_VALUES = ("_forward_cache", "_computed", "value")


def _values_on(result: Any, device: torch.device) -> bool:
    """Whether the values a ``_ResultMetric`` accumulates or caches are on ``device`` (the defaults it resets to were
    moved with the last full move). ``False`` for one holding a tensor or metric this does not know of."""
    known = (*result._defaults, *_KNOWN_VALUES)
    for name, value in vars(result).items():
        if isinstance(value, torch.Tensor | Metric) and (name not in known or value.device != device):
            return False
    if result._modules or result._parameters or result._buffers:  # children this does not know
        return False
    return result.is_tensor or result.value.device == device


def skips_steps_on_device(optimizer: Any) -> bool:
    """Whether ``optimizer.step`` reads ``optimizer.found_inf`` and leaves everything as it was while it is 1."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


def read_bar_values_without_waiting() -> Callable[[], None]:
    """Makes ``prog_bar`` values reach the host only when a bar reads them, without waiting; returns the undo.

    Lightning converts every ``prog_bar=True`` value to a float at every batch end (``_ResultCollection.metrics``,
    called by ``_LoggerConnector.on_batch_end``), whatever the bar's refresh rate: a host-device sync per value and
    step on a GPU. Here the values stay tensors, and ``trainer.progress_bar_metrics`` (what bars read at a refresh)
    returns floats from host copies started at its previous read (non-blocking, into pinned memory on a GPU): a
    bar shows each value one refresh late and never makes the host wait; a key's first read waits once.
    """
    from lightning.pytorch.trainer.connectors.logger_connector import logger_connector, result

    connector = logger_connector._LoggerConnector
    read = connector.progress_bar_metrics
    if getattr(read.fget, "staged", False):
        return lambda: None
    convert = result.convert_tensors_to_scalars

    def keep(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.numel() != 1:
            return convert(value)  # Lightning's error for a value that is no scalar
        return value.detach() if isinstance(value, torch.Tensor) else convert(value)

    def progress_bar_metrics(self: Any) -> dict[str, Any]:
        return _staged_bar_values(self.__dict__.setdefault("_staged_bar_values", {}), read.fget(self))

    progress_bar_metrics.staged = True  # type: ignore[attr-defined]
    result.convert_tensors_to_scalars = keep
    connector.progress_bar_metrics = property(progress_bar_metrics)

    def undo() -> None:
        if result.convert_tensors_to_scalars is keep:
            result.convert_tensors_to_scalars = convert
        if getattr(connector.__dict__.get("progress_bar_metrics"), "fget", None) is progress_bar_metrics:
            connector.progress_bar_metrics = read

    return undo


def _staged_bar_values(staged: dict[str, Any], metrics: dict[str, Any]) -> dict[str, Any]:
    """``metrics`` with each tensor replaced by the float its copy staged at the previous call holds."""
    shown = {}
    for key, value in metrics.items():
        if not isinstance(value, torch.Tensor):
            shown[key] = value
            continue
        host, event = staged.get(key, (None, None))
        if host is None or (event is not None and not event.query()):
            host, event = value.detach().to("cpu"), None  # the first read of this key (or a copy not done): waits
        shown[key] = host.item()  # a host tensor
        cuda = value.is_cuda
        copy = torch.empty(value.shape, dtype=value.dtype, pin_memory=cuda).copy_(value.detach(), non_blocking=cuda)
        event = torch.cuda.Event() if cuda else None
        if event is not None:
            event.record()
        staged[key] = (copy, event)
    return shown


def reopen_an_epoch_stopped_mid_way(checkpoint: dict) -> None:
    """A fit stopped mid-epoch (``max_time``, ``max_steps``, an early stop) counts that epoch as done before its
    end-of-fit save, so ``--ckpt_path last`` would start the next epoch (its data order, its epoch number) at the
    batch where this one stopped. The checkpoint is written as a save during that epoch would be: the epoch
    started and not yet processed. A weights-only save (no ``loops``) has nothing to reopen."""
    if "loops" not in checkpoint:
        return
    try:
        fit = checkpoint["loops"]["fit_loop"]
        batches, epochs = fit["epoch_loop.batch_progress"], fit["epoch_progress"]
        mid_epoch = not batches["is_last_batch"] and batches["current"]["completed"] > 0
        current, total = epochs["current"], epochs["total"]
        counted = current["completed"] == current["ready"] > 0
        for counts in (current, total):
            counts["processed"], counts["completed"]  # both there before either is changed
    except (KeyError, TypeError) as error:
        raise LightningChanged(f"the checkpoint's loops.fit_loop has no {error} where the engine expects it") from None
    if mid_epoch and counted:
        for counts in (current, total):
            counts["processed"] -= 1
            counts["completed"] -= 1
        checkpoint["epoch"] = current["completed"]


COUNTS = ("ready", "started", "processed", "completed")


def rescale_batch_progress(trainer: L.Trainer, before: int, after: int) -> None:
    """Rewrites the fit loop's micro-batch counters, restored from a checkpoint whose micro-batches held ``before``
    samples over all ranks, to micro-batches of ``after`` samples: each rank then counts the batches it would have
    run had the run had this shape from the start (the loop decides from them where the epoch and each accumulation
    end). Offsets between the counts (a save at a batch end counts that batch ready, not completed) are kept. Call it
    after the loops are restored and before the epoch loop resets (``on_train_start``)."""
    try:
        progress = trainer.fit_loop.epoch_loop.batch_progress
        trackers = {"current": progress.current, "total": progress.total}
        counts = {name: {c: int(getattr(t, c)) for c in COUNTS} for name, t in trackers.items()}
    except AttributeError as error:
        raise LightningChanged(f"fit_loop.epoch_loop.batch_progress has no {error.name}") from None
    for name, tracker in trackers.items():
        samples = counts[name]["processed"] * before
        if samples % after:
            raise ValueError(
                f"the checkpoint was taken after {samples} samples ({name} count of the fit loop), not a whole number "
                f"of micro-batches of {after} samples over all ranks: resume it on a shape whose micro-batch divides it"
            )
        for count in COUNTS:
            setattr(tracker, count, samples // after + counts[name][count] - counts[name]["processed"])


def start_the_epoch_lightning_skipped(pl_module: L.LightningModule) -> None:
    """Lightning 2.6 starts the epoch after a resume from a checkpoint taken at the previous epoch's last batch end
    without calling ``on_train_epoch_start``: the module's epoch-start work (e.g. resetting train metrics) would be
    skipped and the resumed run would differ from the uninterrupted one. The caller calls this only when the hook
    did not run for this epoch, so on a Lightning that calls it, this is never reached."""
    pl_module.on_train_epoch_start()


def count_pending_saves_as_files(callback: Any, pending: Callable[[Any, L.Trainer], bool]) -> None:
    """``callback.file_exists(path, trainer)`` (a ``ModelCheckpoint``'s, asked before it names a file ``-v1``) also
    answers yes for ``pending(path, trainer)``; ``restore_file_exists`` takes it back. Once per instance."""
    if not callable(getattr(type(callback), "file_exists", None)):
        raise LightningChanged("ModelCheckpoint.file_exists is gone")
    vars(callback).pop("file_exists", None)  # a failed fit skips teardown: never wrapped twice
    on_disk = callback.file_exists

    def file_exists(filepath: Any, trainer: L.Trainer) -> bool:
        return pending(filepath, trainer) or on_disk(filepath, trainer)

    callback.file_exists = file_exists


def restore_file_exists(callback: Any) -> None:
    vars(callback).pop("file_exists", None)


def replace_log_metrics(logger: Any, log_metrics: Callable[..., None]) -> Callable[..., None]:
    """Puts ``log_metrics`` in place of ``logger.log_metrics`` (what Lightning calls for every logged step) on this
    instance; returns the logger's own, which ``replace_log_metrics(logger, own)`` puts back."""
    own = logger.log_metrics
    logger.log_metrics = log_metrics
    return own


def experiment_opened(logger: Any) -> bool:
    """Whether a ``TensorBoardLogger``'s writer exists (``.experiment`` would create one, and its folder)."""
    if "_experiment" not in vars(logger):
        raise LightningChanged("TensorBoardLogger._experiment is gone")
    return logger._experiment is not None


def set_last_lr(scheduler: Any, lrs: list[float]) -> None:
    """What ``scheduler.get_last_lr()`` returns (torch's ``LRScheduler._last_lr``; it has no public setter)."""
    if not hasattr(scheduler, "_last_lr"):
        raise LightningChanged("torch's LRScheduler._last_lr (what get_last_lr returns) is gone")
    scheduler._last_lr = list(lrs)


def version_counter(t: torch.Tensor) -> int | None:
    """``t``'s in-place version counter (bumped by every in-place write); ``None`` for an inference tensor, which
    has none."""
    try:
        return t._version
    except RuntimeError:
        return None


@functools.cache
def _config_is_per_thread() -> bool:
    from torch.utils.serialization import config

    seen: list[bool] = []
    inside, done = threading.Event(), threading.Event()

    def other() -> None:
        with config.patch({"save.compute_crc32": not config.save.compute_crc32}):
            inside.set()
            done.wait(5)

    before = config.save.compute_crc32
    thread = threading.Thread(target=other, daemon=True)
    thread.start()
    inside.wait(5)
    seen.append(config.save.compute_crc32)
    done.set()
    thread.join()
    return seen == [before]


@contextlib.contextmanager
def crc32_off_in_this_thread() -> Iterator[bool]:
    """Inside it, ``torch.save`` on this thread writes no CRC-32 (yields ``True``), where torch keeps its
    serialization config per thread (2.13 does): a ``torch.save`` on another thread meanwhile keeps its checksums.
    Where the setting is process-wide, nothing changes (yields ``False``)."""
    if not _config_is_per_thread():
        yield False
        return
    before = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        yield True
    finally:
        torch.serialization.set_crc32_options(before)


def load_bytes_weights_only(planner: Any, read_item: Any, value: Any) -> None:
    """DCP's ``DefaultLoadPlanner.load_bytes`` (which reads with ``weights_only=False``), reading with ``True``."""
    try:
        state_dict, path = planner.original_state_dict, planner.mappings[read_item.dest_index.fqn]
    except AttributeError as error:
        raise LightningChanged(f"DCP's DefaultLoadPlanner has no {error.name}") from None
    set_nested(state_dict, path, torch.load(value, weights_only=True))


def index_for_reader(reader: Any, metadata: Any) -> Any:
    """DCP's ``Metadata`` as ``FileSystemReader.read_metadata`` returns it: with the reader's ``load_id``."""
    from torch.distributed.checkpoint.metadata import StorageMeta

    if getattr(metadata, "storage_meta", None) is None:
        metadata.storage_meta = StorageMeta()
    metadata.storage_meta.load_id = reader.load_id
    return metadata


def launched_children(trainer: L.Trainer) -> list[Any]:
    """The other ranks' processes, when Lightning's ``ddp`` launcher started them from this one (else ``[]``)."""
    return list(getattr(trainer.strategy.launcher, "procs", None) or [])


# What gloo's collectives raise when another rank's process is gone.
PEER_GONE = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "pair.cc")

# Keys LightningCLI adds to a module's and a data module's hparams: bookkeeping, not hyperparameters.
CLI_HPARAM_KEYS = ("_class_path", "_instantiator")


def tree_map(fn: Any, tree: Any) -> Any:
    """torch's ``tree_map`` (``torch.utils._pytree``, which torch has no public name for): ``fn`` on every leaf of
    nested lists, tuples and dicts, the structure kept."""
    from torch.utils._pytree import tree_map as torch_tree_map

    return torch_tree_map(fn, tree)


def tree_leaves(tree: Any) -> list[Any]:
    """torch's ``tree_leaves`` (``torch.utils._pytree``): the leaves of nested lists, tuples and dicts, in order."""
    from torch.utils._pytree import tree_leaves as torch_tree_leaves

    return torch_tree_leaves(tree)
