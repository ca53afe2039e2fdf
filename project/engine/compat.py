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
  move when the values are already on the device (``skip_moves_already_done``, installed by ``cli_main``).
"""

import ast
from typing import Any

import lightning as L
import torch
from torchmetrics import Metric


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


def skip_moves_already_done() -> None:
    """``self.log`` moves its stored result to the logged value's device at every call
    (``_ResultCollection.log``: ``self[key].to(value.device)``), and ``_ResultMetric.to`` walks and deep-copies the
    whole metric object to do it: ~280 us a call here, paid by every per-step ``self.log``, although after the first
    call everything is already there. Skip it when the last move went to that device and the values are still on
    it; any other move (Lightning's ``_results.cpu()``, a new device) takes Lightning's own path."""
    from lightning.pytorch.trainer.connectors.logger_connector.result import _ResultMetric

    move = _ResultMetric.to
    if getattr(move, "skips_moves_already_done", False):
        return

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


def _values_on(result: Any, device: torch.device) -> bool:
    """Whether the values a ``_ResultMetric`` accumulates or caches are on ``device`` (the defaults it resets to were
    moved with the last full move)."""
    for name in (*result._defaults, "_forward_cache", "_computed"):
        value = result.__dict__.get(name)
        if isinstance(value, torch.Tensor | Metric) and value.device != device:
            return False
    return result.is_tensor or result.value.device == device
