"""A sweep's worker (``lightkeep.sweep.study``): takes trials one at a time under the sweep's lock (a new one, or
one a dead worker left RUNNING, whose ``trial_N/worker.lock`` is free), runs each as a ``fit`` process of its own
and tells the study how it ended.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import optuna

from lightkeep.config import entry
from lightkeep.sweep.space import Sweep, suggest
from lightkeep.sweep.trial import ReportToStudy, open_storage, trial_id

RESUMABLE = (128 + signal.SIGINT, 128 + signal.SIGTERM)  # the trial saved last.ckpt and stopped: resume it


@contextlib.contextmanager
def sweep_lock(folder: Path) -> Iterator[None]:
    """One worker at a time takes a trial (new or orphaned), so two never take the same one."""
    with open(folder / "sweep.lock", "a") as f:
        fcntl.lockf(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.lockf(f, fcntl.LOCK_UN)


def _lock_trial(folder: Path, number: int) -> Any | None:
    """The open, locked ``trial_N/worker.lock`` (held while the trial runs), or None if a live worker holds it.

    POSIX locks: the kernel (or the NFS server) drops them when their process dies, however it dies.
    """
    path = folder / f"trial_{number}" / "worker.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    f = open(path, "a+")  # noqa: SIM115 (held open for the whole trial)
    try:
        fcntl.lockf(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.close()
        return None
    f.truncate(0)
    f.write(f"{os.uname().nodename} {os.getpid()}\n")
    f.flush()
    return f


def take_trial(sweep: Sweep, study: optuna.Study, storage: optuna.storages.BaseStorage) -> tuple[int, Any] | None:
    """A RUNNING trial left by a dead worker, else a new trial while the study has fewer than ``trials``; with
    its lock held and its parameters set. Called under ``sweep_lock``."""
    for frozen in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
        lock = _lock_trial(sweep.folder, frozen.number)
        if lock is not None:
            print(f"sweep {sweep.name}: trial {frozen.number} was left running by a dead worker; resuming it")
            return _set_params(sweep, study, storage, frozen.number), lock
    # Enqueued trials wait in the study until asked for: they count once taken, or ``trials`` of them (or more)
    # would end the sweep before any ran.
    waiting = optuna.trial.TrialState.WAITING
    if sum(t.state != waiting for t in study.get_trials(deepcopy=False)) >= sweep.trials:
        return None
    trial = study.ask()  # the first enqueued trial still waiting, else a new one
    lock = _lock_trial(sweep.folder, trial.number)
    assert lock is not None, "a new trial's lock is free: the sweep lock is held"
    return _set_params(sweep, study, storage, trial.number), lock


def _set_params(sweep: Sweep, study: optuna.Study, storage: optuna.storages.BaseStorage, number: int) -> int:
    # A sampler seeded by the trial number: the sample depends on the finished trials only, not on how many
    # samples this process drew before (a restarted sweep draws what the uninterrupted one did). Parameters
    # already in the study (a trial taken over) are returned as they are.
    study.sampler = optuna.samplers.TPESampler(seed=sweep.seed + number, n_startup_trials=sweep.startup_trials)
    trial = optuna.trial.Trial(study, trial_id(storage, sweep.name, number))
    for key, spec in sweep.space.items():
        suggest(trial, key, spec)
    return number


def trial_command(sweep: Sweep, number: int, params: dict[str, Any]) -> list[str]:
    report_to_study = {
        "class_path": f"{ReportToStudy.__module__}.{ReportToStudy.__qualname__}",
        "init_args": {"storage": sweep.storage, "study": sweep.name, "trial": number, "monitor": sweep.monitor},
    }
    if sweep.pruner_config is not None:
        report_to_study["init_args"]["pruner"] = sweep.pruner_config
    # a class path (model.init_args.net) before its own arguments (model.init_args.net.init_args.dropout), which
    # jsonargparse would otherwise apply to the class it replaces
    values = [f"--{key}={value}" for key, value in sorted(params.items(), key=lambda item: item[0].count("."))]
    return [
        *(sys.executable, *entry().launch, "fit", *sweep.fit, "--run.root", str(sweep.folder)),
        *("--run.name", f"trial_{number}", *values, f"--trainer.callbacks+={json.dumps(report_to_study)}"),
        *("--run.monitor", str(sweep.monitor), "--run.mode", "max" if sweep.direction == "maximize" else "min"),
        *("--ckpt_path", "last"),  # a new trial starts from scratch; a taken-over one resumes
    ]


def die_with_parent() -> None:
    # Linux: SIGTERM the trial when the sweep dies (kill -9 included), so no orphan trains on; SIGTERM makes the
    # trial save last.ckpt, which the restarted sweep resumes from.
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def run_trial(command: list[str], log: Path) -> int:
    with open(log, "a") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, preexec_fn=die_with_parent)
        while True:
            try:
                return process.wait()
            except KeyboardInterrupt:
                continue  # Ctrl-C reached the trial too: it saves last.ckpt and exits 130; wait for that


def work(sweep: Sweep) -> int:
    """Takes and runs trials until the study has ``trials``; returns 0, or the exit code of a trial that was
    stopped by a signal (it stays RUNNING and the next sweep resumes it)."""
    storage = open_storage(sweep.storage)
    while True:
        with sweep_lock(sweep.folder):
            study = optuna.load_study(study_name=sweep.name, storage=storage)
            taken = take_trial(sweep, study, storage)
        if taken is None:
            return 0
        number, lock = taken
        try:
            frozen = study.get_trials(deepcopy=False)[number]
            if "pruned_at_epoch" not in frozen.user_attrs:  # else it was pruned, then killed before being told
                log = sweep.folder / f"trial_{number}" / "fit.log"
                print(f"sweep {sweep.name}: trial {number} {frozen.params} -> {log}", flush=True)
                code = run_trial(trial_command(sweep, number, frozen.params), log)
                if code < 0 or code in RESUMABLE:
                    print(f"sweep {sweep.name}: trial {number} stopped (exit {code}); run again to resume it")
                    return code if code > 0 else 128 - code
                frozen = study.get_trials(deepcopy=False)[number]
            else:
                code = 0
            _tell(sweep, study, frozen, code)
        finally:
            lock.close()


def _tell(sweep: Sweep, study: optuna.Study, frozen: optuna.trial.FrozenTrial, code: int) -> None:
    values = list(frozen.intermediate_values.values())
    log = sweep.folder / f"trial_{frozen.number}" / "fit.log"
    if code == 0 and "pruned_at_epoch" in frozen.user_attrs:
        study.tell(frozen.number, state=optuna.trial.TrialState.PRUNED)
        outcome = f"pruned after epoch {frozen.user_attrs['pruned_at_epoch']}"
    elif code == 0 and values:
        value = max(values) if sweep.direction == "maximize" else min(values)
        study.tell(frozen.number, value)
        outcome = f"{sweep.monitor} {value:.4f}"
    else:
        study.tell(frozen.number, state=optuna.trial.TrialState.FAIL)
        reason = f"exit code {code}" if code else f"never logged {sweep.monitor}"
        outcome = f"failed ({reason}; see {log})"
    print(f"sweep {sweep.name}: trial {frozen.number} {outcome}", flush=True)
