"""The private Lightning APIs the engine relies on, in one place; tests/test_compat.py fails, naming the attribute,
on a Lightning version where one changed.

- ``Trainer._signal_connector.received_sigterm``: set at a batch end, it makes every rank stop there through
  Lightning's own SIGTERM path (``project.engine.signals``: Ctrl-C agreed by all ranks).
- ``LightningCLI._get``: reads the trainer section of the parsed config (``project.engine.cli``).
- CSV writer's ``metrics_keys`` (``lightning.fabric.loggers.csv_logs._ExperimentWriter``): the columns a continued
  ``metrics.csv`` already has (``project.engine.runs.keep_csv_history``).
- ``Callback._generate_state_key``'s format, ``ClassName{'monitor': ..., 'mode': ...}``: the key a checkpoint files
  each callback's state under, read back for a ``ModelCheckpoint``'s ``mode`` (``project.engine.best``).
"""

import ast
from typing import Any

import lightning as L


def request_stop_at_batch_end(trainer: L.Trainer) -> None:
    """Every rank raises Lightning's ``SIGTERMException`` at the end of the current training batch."""
    trainer._signal_connector.received_sigterm = True


def cli_section(cli: Any, config: Any, key: str) -> Any:
    """``config[subcommand][key]`` of a LightningCLI's parsed or instantiated config (``{}`` when absent)."""
    return cli._get(config, key, default={})


def set_csv_columns(writer: Any, columns: list[str]) -> None:
    writer.metrics_keys = list(columns)


def state_key_arguments(state_key: str) -> dict[str, Any]:
    """The arguments a callback's ``state_key`` holds (``ModelCheckpoint``: ``monitor``, ``mode``, ...); ``{}`` for a
    key of another shape."""
    _, brace, arguments = state_key.partition("{")
    try:
        parsed = ast.literal_eval(brace + arguments)
    except (ValueError, SyntaxError):
        return {}
    return parsed if isinstance(parsed, dict) else {}
