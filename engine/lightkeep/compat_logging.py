"""The private Lightning APIs of ``self.log``, the progress bar and the loggers that the engine relies on, each behind a
function whose docstring says what it reads and why (the Lightning issue, where a function replaces a method for the
run). tests/test_compat.py tests each name; on a layout these functions do not know they raise ``LightningChanged``
(``lightkeep.compat``).
"""

import functools
from collections.abc import Callable
from typing import Any

import torch
from torchmetrics import Metric

from lightkeep.compat import LightningChanged, reads


def set_csv_columns(writer: Any, columns: list[str]) -> None:
    writer.metrics_keys = list(columns)


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


def weigh_synced_means_by_samples() -> Callable[[], None]:
    """Makes the epoch mean of a plain tensor logged with ``sync_dist=True`` the mean over all ranks' samples;
    returns what puts Lightning's own ``_ResultMetric.compute`` back.

    Lightning issue #21859 (upstream fix proposed in PR #21839, the same cast): at an epoch's end
    ``_ResultMetric.compute`` mean-reduces the sum of ``value * batch_size`` and the int64 ``cumulated_batch_size``
    across ranks, and a mean of integers truncates (gloo: ``_sync_ddp`` copies ``sum / world`` back into the integer
    tensor; NCCL's AVG divides integers). Ranks of 51 and 50 samples (the engine's exactly-once evaluation split)
    then divide by 100, not 101. Here Lightning's own compute runs on the count as a float of the value's dtype, in
    the collective it already runs there: nothing per step. Every other case takes Lightning's path untouched (one
    process, no sync, ``rank_zero_only``, min/max/sum, a logged torchmetrics ``Metric``), so those values are
    bit-identical. Nothing is installed where Lightning no longer truncates (a probe, once).
    """
    from lightning.pytorch.trainer.connectors.logger_connector.result import _ResultMetric

    own = _ResultMetric.compute
    if getattr(own, "weighs_synced_means", False) or not lightning_truncates_synced_counts():
        return lambda: None

    def compute(self: Any) -> Any:
        if not (self.is_tensor and self.meta.is_mean_reduction and _reduced_across_ranks(self.meta.sync)):
            return own(self)
        counts = self.cumulated_batch_size
        self.cumulated_batch_size = counts.to(self.value.dtype)  # Lightning syncs it in place: the state stays
        try:
            return own(self)
        finally:
            self.cumulated_batch_size = counts

    compute.weighs_synced_means = True  # type: ignore[attr-defined]
    compute.__wrapped__ = own  # type: ignore[attr-defined]
    _ResultMetric.compute = compute  # results made from now on wrap it (torchmetrics wraps compute per instance)

    def undo() -> None:
        if _ResultMetric.__dict__.get("compute") is compute:  # else replaced since by someone else: theirs stays
            _ResultMetric.compute = own

    return undo


def _reduced_across_ranks(sync: Any) -> bool:
    """Whether a ``_Sync`` reduces across more than one process (Lightning's no-op otherwise)."""
    return sync.should and not sync.rank_zero_only and _processes(sync.group) > 1


def _processes(group: Any) -> int:
    """The processes of a process group (``None``: the default one); 1 outside a distributed run."""
    dist = torch.distributed
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


@functools.cache
def lightning_truncates_synced_counts() -> bool:
    """Whether ``_ResultMetric.compute`` still hands the integer ``cumulated_batch_size`` to the sync function."""
    from lightning.pytorch.trainer.connectors.logger_connector.result import _Metadata, _ResultMetric, _Sync

    handed: list[torch.dtype] = []

    def reduce(value: torch.Tensor, *_: Any, **__: Any) -> torch.Tensor:
        handed.append(value.dtype)
        return value

    try:
        result = _ResultMetric(_Metadata(fx="probe", name="probe"), is_tensor=True)
        result.meta.sync = _Sync(fn=reduce, _should=True)
        result.update(torch.tensor(1.0), batch_size=3)
        mean = getattr(_ResultMetric.compute, "__wrapped__", _ResultMetric.compute)(result)
    except (TypeError, AttributeError) as error:
        raise LightningChanged(f"_ResultMetric.compute no longer works as it did ({error})") from error
    if mean.item() != 1.0 or len(handed) != 2:
        raise LightningChanged(f"_ResultMetric.compute no longer syncs a value and a count (synced {handed})")
    return not handed[1].is_floating_point


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


@reads("fit_loop.epoch_loop.val_loop has no {}")
def _seen_validation_batches(trainer: Any) -> dict[int, int]:
    return trainer.fit_loop.epoch_loop.val_loop._seen_batches_per_dataloader


def evaluation_logging_steps(trainer: Any) -> dict[int, int]:
    """Per validation loader, the step of the next ``on_step`` value a fit's validation logs."""
    return dict(_seen_validation_batches(trainer))


def continue_evaluation_logging_steps(trainer: Any, steps: dict[int, int]) -> None:
    """Sets them (``evaluation_logging_steps`` of a checkpoint) on this fit's validation loop. Call it at the start
    of a validation, after the loop set up its loaders (which starts the count at 0)."""
    _seen_validation_batches(trainer).update({int(k): int(v) for k, v in steps.items()})


# A tensor value's running state in a ``_ResultMetric``: its sum (or max, min) and, for a mean, its samples
_ACCUMULATORS = ("value", "cumulated_batch_size")


@reads("the training loop's logged values have no {}")
def epoch_accumulators(trainer: Any) -> dict[str, dict[str, torch.Tensor]]:
    """The running state of each tensor the training hooks logged with ``on_epoch=True`` this epoch, by its key in
    the training epoch loop's ``_ResultCollection`` (``fit_loop.epoch_loop._results``): Lightning sums it there
    (``_ResultMetric.update``) and saves none of it, so after a mid-epoch resume an epoch value such as
    ``train/loss_epoch`` covered the resumed batches only. A torchmetrics ``Metric`` logged so is not here: its own
    state is (``lightkeep.resume``)."""
    from lightning.pytorch.trainer.connectors.logger_connector.result import _ResultMetric

    results = trainer.fit_loop.epoch_loop._results
    logged = {key: m for key, m in results.items() if isinstance(m, _ResultMetric) and m.is_tensor}
    return {key: {name: getattr(m, name).detach().to("cpu", copy=True) for name in _ACCUMULATORS
                  if hasattr(m, name)}
            for key, m in logged.items() if m.meta.on_epoch and m.update_called}  # fmt: skip


@reads("the training loop's logged values have no {}")
def continue_epoch_accumulators(trainer: Any, saved: dict[str, dict[str, torch.Tensor]]) -> None:
    """Gives each key of ``saved`` (``epoch_accumulators`` of a checkpoint) its running state back right before its
    first update of the resumed epoch, so the sum goes on in the uninterrupted run's order (bit-equal):
    ``_ResultCollection.update_metrics``, which ``log`` calls after it made the key's ``_ResultMetric``, is replaced
    on the training loop's instance until each key has had it (``stop_continuing_epoch_accumulators`` at the epoch's
    end for a key not logged again)."""
    results = trainer.fit_loop.epoch_loop._results
    update = type(results).update_metrics
    pending = dict(saved)

    def update_metrics(key: str, value: Any, batch_size: int) -> None:
        state = pending.pop(key, None)
        if state is not None:
            metric = results[key]
            for name, tensor in state.items():
                setattr(metric, name, tensor.to(getattr(metric, name).device))
        if not pending:
            vars(results).pop("update_metrics", None)
        update(results, key, value, batch_size)

    if pending:
        results.update_metrics = update_metrics


def stop_continuing_epoch_accumulators(trainer: Any) -> None:
    results = getattr(getattr(trainer.fit_loop, "epoch_loop", None), "_results", None)
    if results is not None:
        vars(results).pop("update_metrics", None)
