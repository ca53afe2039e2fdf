"""``python -m lightkeep sweep --config configs/sweep.yaml``: an Optuna study whose trials are ordinary ``fit`` runs,
each ``python -m lightkeep fit FIT_ARGS --run.root <root>/<name> --run.name trial_N --KEY VALUE ... --ckpt_path last``
in a process of its own, so DDP, launchers and every engine guarantee apply to it (its run folder
``<root>/<name>/trial_N/version_0``). Where the study lives, how workers share it and what a killed sweep continues:
docs/sweeps.md.
"""

import io
import json
import subprocess
import sys
from contextlib import redirect_stderr, redirect_stdout
from typing import Any
from unittest import mock

import optuna
from jsonargparse import ActionConfigFile, ArgumentParser

from lightkeep.cli import CLI
from lightkeep.config import entry
from lightkeep.errors import root_cause
from lightkeep.runs import check_save_dir
from lightkeep.sweep.report import report
from lightkeep.sweep.space import Sweep, check_space, fit_objective
from lightkeep.sweep.trial import open_storage
from lightkeep.sweep.worker import die_with_parent, sweep_lock, work


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(prog=f"{entry().command} sweep", description="Runs an Optuna study of fit runs.")
    parser.add_argument("-c", "--config", action=ActionConfigFile, help="The sweep's YAML (configs/sweep.yaml).")
    parser.add_class_arguments(Sweep, fail_untyped=True)
    parser.add_argument("--workers", type=int, default=1, help="Worker processes sharing the study on this machine.")
    parser.add_argument("--show", action="store_true", help="Print the results so far; run nothing.")
    parser.add_argument("--report", type=bool, default=True, help="Print the results when done (helper workers: no).")
    return parser


def sweep_from(parser: ArgumentParser, config: Any) -> Sweep:
    """The ``Sweep`` of a parsed command line; raises ``ValueError`` for a bad one."""
    init = parser.instantiate_classes(config)
    sweep = Sweep(**{k: v for k, v in vars(init).items() if k not in ("config", "workers", "show", "report")})
    sweep.pruner_config = config.pruner.as_dict() if config.pruner is not None else None
    return sweep


def sweep_main(argv: list[str]) -> None:
    parser = build_parser()
    config = parser.parse_args(argv)
    try:
        sweep = sweep_from(parser, config)
        if config.workers < 1:
            raise ValueError(f"--workers ({config.workers}) must be >= 1")
        check_save_dir(sweep.folder)
        if sweep.monitor is None or sweep.direction is None:  # what the trials' fit monitors
            monitor, mode = fit_objective(fit_cli(sweep.fit))
            if sweep.monitor is None and monitor is None:
                raise ValueError("monitor: the fit config monitors nothing (run.monitor null); give the sweep one")
            sweep.monitor = sweep.monitor or monitor
            sweep.direction = sweep.direction or ("maximize" if mode == "max" else "minimize")
        if not config.show:
            check_space(sweep.space, sweep.fit, fit_cli(sweep.fit))  # each key and range against the fit parser
    except ValueError as error:
        parser.error(" ".join(str(root_cause(error)).split()))
    if config.show and not sweep.folder.is_dir():
        parser.error(f"--show: no sweep in {sweep.folder} yet; run it without --show first")
    sweep.folder.mkdir(parents=True, exist_ok=True)
    with sweep_lock(sweep.folder):
        study = open_study(sweep, create=not config.show, error=parser.error)
    if config.show:
        print(report(study, sweep.folder, sweep.monitor))
        return
    # other workers on the same study: the same command, one worker each; they die with this process
    command = [sys.executable, *entry().launch, "sweep", *argv, "--workers", "1", "--report", "false"]
    helpers = [subprocess.Popen(command, preexec_fn=die_with_parent) for _ in range(config.workers - 1)]
    code = work(sweep)
    codes = [code] + [helper.wait() for helper in helpers]
    study = optuna.load_study(study_name=sweep.name, storage=open_storage(sweep.storage))
    if config.report:
        print(report(study, sweep.folder, sweep.monitor), flush=True)
    code = next((c for c in codes if c), 0)
    states = [t.state for t in study.get_trials(deepcopy=False)]
    if code == 0 and states and all(s == optuna.trial.TrialState.FAIL for s in states):
        # a sweep that found nothing is not a success: a job array or script must see it
        sys.exit(f"error: every trial of sweep {sweep.name!r} failed (each trial's fit.log in {sweep.folder} says why)")
    sys.exit(code)


def open_study(sweep: Sweep, create: bool, error: Any) -> optuna.Study:
    """The sweep's study; created (and its ``enqueue`` added) on the first run. Refuses a changed space or fit."""
    storage = open_storage(sweep.storage)
    try:
        study = optuna.load_study(study_name=sweep.name, storage=storage)
    except KeyError:
        if not create:
            error(f"no sweep {sweep.name!r} in {sweep.storage} yet; run it without --show first")
        study = optuna.create_study(study_name=sweep.name, storage=storage, direction=sweep.direction)
        study.set_user_attr("sweep", sweep.identity())
        for params in sweep.enqueue:
            study.enqueue_trial(params)
    started_as = study.user_attrs.get("sweep")
    if started_as is not None and json.loads(json.dumps(sweep.identity())) != started_as:
        changed = [k for k, v in sweep.identity().items() if json.loads(json.dumps(v)) != started_as.get(k)]
        error(
            f"sweep {sweep.name!r} in {sweep.folder} was started with another {', '.join(changed)}; its trials would"
            f" not compare. Restore them, or give the new search another name."
        )
    return study


def fit_cli(fit: list[str]) -> Any:
    """``fit FIT`` parsed and its classes built by the real CLI, run=False; ``ValueError`` with its error line."""
    # Quiet ("Seed set to ...", "GPU available ..." are not the sweep's output), with the sweep's own command line
    # out of sys.argv, where LightningCLI would warn about it. A refused `fit` list ends in its own error line.
    output = io.StringIO()
    try:
        with mock.patch.object(sys, "argv", sys.argv[:1]), redirect_stdout(output), redirect_stderr(output):
            cli = CLI(args=fit, run=False)
    except SystemExit:
        lines = [line for line in output.getvalue().splitlines() if line.startswith("error:")]
        raise ValueError(f"fit: {lines[-1][7:] if lines else output.getvalue()[-500:]}") from None
    return cli
