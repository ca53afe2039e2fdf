"""The private Lightning APIs the engine relies on, in one place; tests/test_compat.py fails, naming the attribute,
on a Lightning version where one changed.

- ``Trainer._signal_connector.received_sigterm``: set at a batch end, it makes every rank stop there through
  Lightning's own SIGTERM path (``project.engine.signals``: Ctrl-C agreed by all ranks).
- ``LightningCLI._get``: reads the trainer section of the parsed config (``project.engine.cli``).
- CSV writer's ``metrics_keys`` (``lightning.fabric.loggers.csv_logs._ExperimentWriter``): the columns a continued
  ``metrics.csv`` already has (``project.engine.runs.keep_csv_history``).
"""

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
