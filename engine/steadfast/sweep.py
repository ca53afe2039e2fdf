"""``python -m steadfast sweep --config configs/sweep.yaml``: an Optuna study whose trials are ordinary ``fit`` runs.

Each trial is ``python -m steadfast fit FIT_ARGS --run.root <root>/<name> --run.name trial_N --KEY VALUE ...
--ckpt_path last`` in a process of its own, so DDP, launchers and every engine guarantee apply to it, and its run
folder is ``<root>/<name>/trial_N/version_0``. The study lives in ``<root>/<name>/study.db``. A worker holds a lock
on ``trial_N/worker.lock`` while trial N runs; a RUNNING trial whose lock is free was left by a dead worker (a
kill -9, a lost node), and the next worker to look takes it over: same number, parameters and run folder, resumed
from its ``last.ckpt``. Trial N is sampled with seed ``seed + N`` from the trials finished before it, so a sweep
killed and started again samples what the uninterrupted one would have.
"""

import json
import subprocess
import sys
from pathlib import Path
from typing import Any, Literal

import optuna
from jsonargparse import ActionConfigFile, ArgumentParser

from steadfast.config import entry
from steadfast.errors import root_cause
from steadfast.runs import check_save_dir
from steadfast.sweep_report import report
from steadfast.sweep_space import check_space, check_spec, fit_objective
from steadfast.sweep_trial import open_storage
from steadfast.sweep_worker import die_with_parent, sweep_lock, work


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
            monitor, mode = fit_objective(sweep.fit)
            if sweep.monitor is None and monitor is None:
                raise ValueError("monitor: the fit config monitors nothing (run.monitor null); give the sweep one")
            sweep.monitor = sweep.monitor or monitor
            sweep.direction = sweep.direction or ("maximize" if mode == "max" else "minimize")
        if not config.show:
            check_space(sweep.space, sweep.fit)  # every key and range against the real fit parser
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
    helpers = [_start_helper(argv) for _ in range(config.workers - 1)]
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


def _start_helper(argv: list[str]) -> subprocess.Popen:
    # Another worker on the same study: the same command, one worker; it dies with this process.
    command = [sys.executable, "-m", entry().program, "sweep", *argv, "--workers", "1", "--report", "false"]
    return subprocess.Popen(command, preexec_fn=die_with_parent)
