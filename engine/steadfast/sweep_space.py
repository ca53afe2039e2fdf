"""A sweep's search space: ``{dotted CLI name: spec}``, checked before the first trial, sampled per trial.

Specs: ``{type: float, low, high, log: false, step: null}``, ``{type: int, low, high, log: false, step: 1}``,
``{type: categorical, choices: [...]}`` (numbers, strings, booleans; a class path such as ``my_lab.nets.ResNet`` is a
string). Each key is checked against the real ``fit`` parser with the value at each end of its range (each choice),
and the constructors it reaches run, so a misspelt key, a wrong type or a value the model refuses
(``lr (0.0) must be > 0``) fails before the first trial, not in trial 7.
"""

import argparse
import io
import sys
from contextlib import redirect_stderr, redirect_stdout
from typing import Any
from unittest import mock

import optuna

from steadfast.errors import root_cause

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


def fit_objective(fit: list[str]) -> tuple[str | None, str]:
    """The monitor and mode of ``fit FIT``, as the trials' own runs read them: their first ``ModelCheckpoint`` with
    a monitor (``run.monitor``'s, or the config's own), else ``(None, run.mode)``."""
    cli = _fit_cli(fit)
    checkpoint = next((c for c in cli.trainer.checkpoint_callbacks if getattr(c, "monitor", None)), None)
    return (checkpoint.monitor, checkpoint.mode) if checkpoint is not None else (None, cli.config["run"].mode)


def check_space(space: dict[str, dict[str, Any]], fit: list[str]) -> None:
    """Parses ``fit FIT --KEY=VALUE`` with the CLI's own parser for each end of each range and builds the model and
    data; raises ``ValueError`` naming the key and value that fail, and why."""
    cli = _fit_cli(fit)
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


def _fit_cli(fit: list[str]) -> Any:
    """``fit FIT`` parsed and its classes built by the real CLI, run=False; ``ValueError`` with its error line."""
    from steadfast.cli import cli_main

    # Quiet ("Seed set to ...", "GPU available ..." are not the sweep's output), with the sweep's own command line
    # out of sys.argv, where LightningCLI would warn about it. A refused `fit` list ends in its own error line.
    output = io.StringIO()
    try:
        with mock.patch.object(sys, "argv", sys.argv[:1]), redirect_stdout(output), redirect_stderr(output):
            cli = cli_main(fit, run=False)
    except SystemExit:
        lines = [line for line in output.getvalue().splitlines() if line.startswith("error:")]
        raise ValueError(f"fit: {lines[-1][7:] if lines else output.getvalue()[-500:]}") from None
    return cli
