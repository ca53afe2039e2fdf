"""What a sweep shows a person: a table of trials best first, ``sweep.png`` (optimisation history and parameter
importances) and one line naming the best trial's run folder and checkpoint."""

from pathlib import Path

import optuna
from optuna.trial import FrozenTrial, TrialState

ORDER = {TrialState.COMPLETE: 0, TrialState.PRUNED: 1, TrialState.RUNNING: 2, TrialState.WAITING: 3, TrialState.FAIL: 4}


def ranked(study: optuna.Study) -> list[FrozenTrial]:
    """Finished trials best first, then pruned ones (by their last value), running, waiting and failed ones."""
    sign = -1 if study.direction == optuna.study.StudyDirection.MAXIMIZE else 1

    def key(trial: FrozenTrial) -> tuple:
        return (ORDER[trial.state], 0 if trial.value is None else sign * trial.value, trial.number)

    return sorted(study.get_trials(deepcopy=False), key=key)


def table(study: optuna.Study, monitor: str) -> str:
    trials = ranked(study)
    keys = sorted({k for t in trials for k in t.params})
    header = ["trial", "state", monitor, *keys, "run folder"]
    rows = [
        [
            str(t.number),
            t.state.name.lower(),
            "" if t.value is None else f"{t.value:.4f}",
            *(_short(t.params.get(k, "")) for k in keys),
            t.user_attrs.get("run_dir", ""),
        ]
        for t in trials
    ]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in [header, *rows])


def _short(value: object) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def best_line(study: optuna.Study, monitor: str) -> str:
    done = [t for t in study.get_trials(deepcopy=False) if t.state == TrialState.COMPLETE]
    if not done:
        return f"Sweep best: no finished trial yet ({len(study.trials)} trials)"
    best = study.best_trial
    return (
        f"Sweep best: trial {best.number} {monitor} {best.value:.4f} | checkpoint {best.user_attrs.get('checkpoint')}"
        f" | run folder {best.user_attrs.get('run_dir')}"
    )


def plot(study: optuna.Study, monitor: str, path: Path) -> str:
    """Writes the PNG; returns a note on what it holds."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a cluster node
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, (history, importance) = plt.subplots(1, 2, figsize=(11, 4))
    maximize = study.direction == optuna.study.StudyDirection.MAXIMIZE
    done = [t for t in study.get_trials(deepcopy=False) if t.state == TrialState.COMPLETE]
    pruned = [t for t in study.get_trials(deepcopy=False) if t.state == TrialState.PRUNED and t.value is not None]
    history.scatter([t.number for t in done], [t.value for t in done], label="finished")
    history.scatter([t.number for t in pruned], [t.value for t in pruned], marker="x", color="grey", label="pruned")
    best, running = [], None
    for t in done:
        running = t.value if running is None else (max if maximize else min)(running, t.value)
        best.append(running)
    history.step([t.number for t in done], best, where="post", color="C1", label="best so far")
    history.set(xlabel="trial", ylabel=monitor, title="Optimisation history")
    history.xaxis.set_major_locator(MaxNLocator(integer=True))
    history.legend()
    note, importances = "history and importances", {}
    if len(done) < 2:
        note = "history only (importances need 2 finished trials)"
    else:
        try:
            importances = optuna.importance.get_param_importances(study)
        except (ValueError, RuntimeError) as error:  # e.g. a space of one value
            note = f"history only (importances: {error})"
    names = list(importances)[::-1]
    importance.barh(names, [importances[n] for n in names])
    importance.set(xlabel="importance (Optuna's default evaluator)", title="Parameter importances")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return note


def report(study: optuna.Study, folder: Path, monitor: str) -> str:
    png = folder / "sweep.png"
    note = plot(study, monitor, png)
    return f"{table(study, monitor)}\n{png}: {note}\n{best_line(study, monitor)}"
