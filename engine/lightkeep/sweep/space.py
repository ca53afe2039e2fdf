"""A sweep (``Sweep``, its definition) and its search space: ``{dotted CLI name: spec}``, checked before the first
trial, sampled per trial.

Specs: ``{type: float, low, high, log: false, step: null}``, ``{type: int, low, high, log: false, step: 1}``,
``{type: categorical, choices: [...]}`` (numbers, strings, booleans; a class path such as ``my_lab.nets.ResNet`` is a
string). Each key is checked against the real ``fit`` parser with the value at each end of its range (each choice),
and the constructors it reaches run, so a misspelt key, a wrong type or a value the model refuses
(``lr (0.0) must be > 0``) fails before the first trial, not in trial 7.
"""

import argparse
import io
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any, Literal

import optuna

from lightkeep.errors import root_cause

FIELDS = {"float": {"type", "low", "high", "log", "step"}, "int": {"type", "low", "high", "log", "step"}}
FIELDS["categorical"] = {"type", "choices"}


def check_spec(key: str, spec: dict[str, Any]) -> None:
    """Raises ``ValueError`` naming the key and the fix for a spec Optuna would refuse or misread."""
    kind = spec.get("type")
    if kind not in FIELDS:
        raise ValueError(f"space: {key}: type ({kind!r}) must be one of float, int, categorical")
    if unknown := set(spec) - FIELDS[kind]:
        allowed = ", ".join(sorted(FIELDS[kind]))
        raise ValueError(f"space: {key}: unknown field(s) {sorted(unknown)} for type {kind}; allowed: {allowed}")
    if kind == "categorical":
        choices = spec.get("choices")
        if not isinstance(choices, list) or not choices:
            raise ValueError(f"space: {key}: choices must be a non-empty list")
        if bad := [c for c in choices if not isinstance(c, (type(None), bool, int, float, str))]:
            raise ValueError(f"space: {key}: choices {bad} are not numbers, strings or booleans")
        return
    low, high, step = spec.get("low"), spec.get("high"), spec.get("step")
    number = (int,) if kind == "int" else (int, float)
    if not all(isinstance(v, number) and not isinstance(v, bool) for v in (low, high)):
        raise ValueError(f"space: {key}: low and high must be {kind}s (got {low!r}, {high!r})")
    if low > high:
        raise ValueError(f"space: {key}: low ({low}) must be <= high ({high})")
    if spec.get("log") and low <= 0:
        raise ValueError(f"space: {key}: a log range needs low > 0 (got {low})")
    if spec.get("log") and step not in (None, 1):
        raise ValueError(f"space: {key}: give either log or step, not both")
    if step is not None and (not isinstance(step, number) or step <= 0):
        raise ValueError(f"space: {key}: step ({step!r}) must be a {kind} > 0")


def suggest(trial: optuna.Trial, key: str, spec: dict[str, Any]) -> Any:
    if spec["type"] == "categorical":
        return trial.suggest_categorical(key, spec["choices"])
    if spec["type"] == "int":
        return trial.suggest_int(key, spec["low"], spec["high"], step=spec.get("step") or 1, log=bool(spec.get("log")))
    return trial.suggest_float(key, spec["low"], spec["high"], step=spec.get("step"), log=bool(spec.get("log")))


def candidates(spec: dict[str, Any]) -> list[Any]:
    return list(spec["choices"]) if spec["type"] == "categorical" else [spec["low"], spec["high"]]


def fit_objective(cli: Any) -> tuple[str | None, str]:
    """The monitor and mode of a trial's fit (``cli``: its LightningCLI, built, not run), as the trials' own runs
    read them: the checkpoint that judges them (``run.monitor``'s, or the config's own), else ``(None, run.mode)``."""
    checkpoint = cli.judge
    return (checkpoint.monitor, checkpoint.mode) if checkpoint is not None else (None, cli.config["run"].mode)


def check_space(space: dict[str, dict[str, Any]], fit: list[str], cli: Any) -> None:
    """Parses ``fit FIT --KEY=VALUE`` with the parser of ``cli`` (the trials' LightningCLI) for each end of each range
    and builds the model and data; raises ``ValueError`` naming the key and value that fail, and why."""
    parser = cli.parser
    parser.exit_on_error = False  # argparse's switch: raise instead of printing usage and exiting
    for key, spec in space.items():
        for value in candidates(spec):
            try:
                with redirect_stdout(io.StringIO()):
                    parser.instantiate_classes(parser.parse_args([*fit, f"--{key}={value}"]))
            except (argparse.ArgumentError, ValueError, TypeError) as error:
                message = " ".join(str(root_cause(error)).split())
                raise ValueError(f"space: {key} = {value!r} is refused by fit: {message}") from None


class Sweep:
    """A hyper-parameter search: an Optuna study whose trials are ordinary ``fit`` runs.

    Args:
        name: The sweep's folder under ``root``: the study database, ``trial_N/`` run folders, ``sweep.png``.
        space: Search space keyed by the CLI's dotted names: ``{type: float|int, low, high, log, step}`` or
            ``{type: categorical, choices: [...]}`` (numbers, strings, booleans, class paths).
        trials: Trials in the study, all workers together. Run again with more to extend a finished sweep.
        monitor: Metric to optimise, as the run logs it; ``None``: the ``fit`` config's ``run.monitor``. A trial's
            value is its best over the run's validations (the score of its best checkpoint: the trials run with
            ``--run.monitor`` set to it); the pruner sees it after each epoch.
        direction: Whether a larger (``maximize``) or smaller ``monitor`` is better; ``None``: from the ``fit``
            config's ``run.mode`` (``max``: ``maximize``).
        fit: Arguments every trial's ``fit`` gets, as on the command line, e.g. ``[--trainer.max_epochs, "10"]``.
        pruner: Optuna pruner, deciding after each epoch's validation; ``null``: every trial runs to its end.
        seed: Sampler seed; trial N is sampled with ``seed + N``.
        startup_trials: Random trials before TPE (Optuna's default sampler) takes over.
        enqueue: Parameter sets tried first (e.g. your current best config), each ``{dotted name: value}``; they
            count among the ``trials``.
        root: Folder that holds the sweeps.
        storage: Optuna storage; ``null``: ``sqlite:///<root>/<name>/study.db``. When workers on several machines
            share a disk on which SQLite's locks are unreliable (NFS), a ``.journal`` file path, or a database
            server's URL (``postgresql://...``).
    """

    def __init__(
        self,
        name: str,
        space: dict[str, dict[str, Any]],
        trials: int = 20,
        monitor: str | None = None,
        direction: Literal["maximize", "minimize"] | None = None,
        fit: list[str] | None = None,
        pruner: optuna.pruners.BasePruner | None = None,
        seed: int = 0,
        startup_trials: int = 10,
        enqueue: list[dict[str, Any]] | None = None,
        root: str = "runs",
        storage: str | None = None,
    ) -> None:
        if not name or "/" in name or name in (".", ".."):
            raise ValueError(f"name ({name!r}) must be one folder name, without '/'")
        if trials < 1:
            raise ValueError(f"trials ({trials}) must be >= 1")
        if not space:
            raise ValueError("space is empty: give at least one `dotted.name: {type: ...}`")
        for key, spec in space.items():
            check_spec(key, spec)
        for params in enqueue or []:
            if unknown := set(params) - set(space):
                raise ValueError(f"enqueue: {sorted(unknown)} not in the space; enqueue only keys of the space")
        self.name, self.space, self.trials, self.monitor, self.direction = name, space, trials, monitor, direction
        self.fit, self.pruner, self.seed, self.startup_trials = list(fit or []), pruner, seed, startup_trials
        self.enqueue, self.folder = list(enqueue or []), Path(root) / name
        self.storage = storage or f"sqlite:///{(self.folder / 'study.db').resolve()}"
        self.pruner_config: dict[str, Any] | None = None  # the pruner as class_path/init_args, for the trials

    def identity(self) -> dict[str, Any]:
        """What a restart must not change: what the finished trials ran and were judged by."""
        return {"space": self.space, "fit": self.fit, "monitor": self.monitor, "direction": self.direction}
