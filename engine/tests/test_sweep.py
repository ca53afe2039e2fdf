"""Sweeps through the real CLI: trials are ordinary fit runs, a bad trial is pruned (on every rank under DDP), and a
sweep killed mid-trial and started again ends with the trial results of an uninterrupted sweep."""

import itertools
import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import optuna
import pytest
import torch
import yaml

from tests.helpers import DDP2, PYTHONPATH, QUIET, STAND_IN, cli

pytestmark = pytest.mark.slow

# 2 epochs of 4 batches: a trial is two validations; the pruner sees the first.
FIT = [*QUIET, "--trainer.max_epochs", "2", "--trainer.limit_train_batches", "4", "--model.warmup", "0"]
STEPS_PER_EPOCH = 4
BAD_LR = 1e-5  # four steps at this rate leave the stand-in at chance (~0.1 val/acc), far under the pruner's 0.3


def write_sweep(tmp_path: Path, name: str, trials: int, fit: list[str], lower: float = 0.3) -> Path:
    config = {
        "name": name,
        "root": str(tmp_path / "runs"),
        "trials": trials,
        "seed": 3,
        "startup_trials": 2,  # trial 2 on is TPE's, from the finished trials: a restart must not change them
        "fit": [*STAND_IN, *fit],  # every trial trains the stand-in
        "space": {
            "model.init_args.lr": {"type": "float", "low": BAD_LR, "high": 1e-2, "log": True},
            "model.init_args.net.init_args.dropout": {"type": "float", "low": 0.0, "high": 0.2},
        },
        "enqueue": [{"model.init_args.lr": BAD_LR, "model.init_args.net.init_args.dropout": 0.0}],  # trial 0: bad
        "pruner": {"class_path": "optuna.pruners.ThresholdPruner", "init_args": {"lower": lower}},
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def load(tmp_path: Path, name: str) -> optuna.Study:
    storage = f"sqlite:///{tmp_path / 'runs' / name / 'study.db'}"
    return optuna.load_study(study_name=name, storage=storage)


def results(study: optuna.Study, below: int) -> list[tuple]:
    return [(t.number, t.state, t.params, t.value, t.intermediate_values) for t in study.trials if t.number < below]


def show(config: str) -> str:
    """``python -m project sweep --config CONFIG --show``, in this process; what it printed."""
    from contextlib import redirect_stdout
    from io import StringIO
    from unittest import mock

    from tests.helpers import cli_main

    out = StringIO()
    with mock.patch.object(sys, "argv", ["project"]), redirect_stdout(out):
        cli_main(["sweep", "--config", config, "--show"])
    return out.getvalue()


def table_rows(output: str) -> list[str]:
    return [line for line in output.splitlines() if re.match(r"^\d+\s+(complete|pruned|fail|running)", line)]


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]


@pytest.mark.long  # CI and make test-all; ~140 s: two 4- and 3-trial sweeps
def test_sweep_runs_trials_as_runs_prunes_the_bad_one_and_a_killed_sweep_continues_exactly(tmp_path):
    # The uninterrupted sweep: the oracle, and the 4-trial sweep the table is checked on.
    out = cli("sweep", "--config", str(write_sweep(tmp_path, "calm", 4, FIT)), cwd=tmp_path, timeout=900).stdout
    calm = load(tmp_path, "calm")
    assert [t.number for t in calm.trials] == [0, 1, 2, 3]
    for trial in calm.trials:  # each trial an ordinary run with its own folder, config and trial record
        run = tmp_path / "runs" / "calm" / f"trial_{trial.number}" / "version_0"
        assert Path(trial.user_attrs["run_dir"]).resolve() == run.resolve()
        assert json.loads((run / "trial.json").read_text())["params"] == trial.params
        assert yaml.safe_load((run / "config.yaml").read_text())["model"]["init_args"]["lr"] == pytest.approx(
            trial.params["model.init_args.lr"]
        )
    assert calm.trials[0].state == optuna.trial.TrialState.PRUNED, "the deliberately bad trial was not pruned"
    assert list(calm.trials[0].intermediate_values) == [0], "the pruned trial went on after its first epoch"
    done = [t for t in calm.trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert done, f"precondition: some trial finishes ({[t.state for t in calm.trials]})"
    # The table: best first, every trial once; the best trial's checkpoint named in one line
    rows = [line.split() for line in out.splitlines() if re.match(r"^\d+\s+(complete|pruned|fail)", line)]
    assert [int(r[0]) for r in rows][: len(done)] == [t.number for t in sorted(done, key=lambda t: -t.value)]
    assert sorted(int(r[0]) for r in rows) == [0, 1, 2, 3]
    best = re.search(r"Sweep best: trial (\d+) val/acc ([\d.]+) \| checkpoint (\S+) \| run folder (\S+)", out)
    assert best and int(best[1]) == calm.best_trial.number and Path(tmp_path / best[3]).is_file(), out[-2000:]
    assert (tmp_path / "runs" / "calm" / "sweep.png").stat().st_size > 10_000

    # The same sweep, killed (sweep and trial, kill -9) at a seeded step of the second epoch of a finished trial
    seed = random.randrange(10_000)
    rng = random.Random(seed)
    victim = rng.choice([t.number for t in done if t.number < 3])
    step = rng.randrange(STEPS_PER_EPOCH + 1, 2 * STEPS_PER_EPOCH)  # after the epoch-end checkpoint
    print(f"kill seed {seed}: trial {victim} at step {step}")
    kill = [
        "--trainer.callbacks+=tests.faults.KillGroupAt",
        f"--trainer.callbacks.step={step}",
        f"--trainer.callbacks.run_part=trial_{victim}/",
        f"--trainer.callbacks.once_marker={tmp_path / 'killed'}",
    ]
    config = str(write_sweep(tmp_path, "killed", 3, [*FIT, *kill]))
    env = {**os.environ, "PYTHONPATH": PYTHONPATH, "PYTHONWARNINGS": "ignore"}
    command = [sys.executable, "-m", "project", "sweep", "--config", config]
    first = subprocess.run(
        command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900, start_new_session=True
    )
    assert first.returncode == -9 and (tmp_path / "killed").exists(), f"seed {seed}: not killed\n{first.stdout[-2000:]}"
    assert load(tmp_path, "killed").trials[victim].state == optuna.trial.TrialState.RUNNING
    shown = show(config)  # on demand, between the kill and the restart: the trial shows as running
    assert re.search(rf"^{victim}\s+running", shown, re.M), shown
    second = cli("sweep", "--config", config, cwd=tmp_path, timeout=900).stdout  # the same command again
    assert f"trial {victim} was left running by a dead worker; resuming it" in second, f"seed {seed}\n{second[-2000:]}"
    log = (tmp_path / "runs" / "killed" / f"trial_{victim}" / "fit.log").read_text()
    resumed = rf"resuming from \S*trial_{victim}/version_0/checkpoints/\S+\.ckpt \(global step {STEPS_PER_EPOCH}\)"
    assert re.search(resumed, log), f"seed {seed}: not resumed from its epoch-end checkpoint\n{log}"
    assert sorted(p.name for p in (tmp_path / "runs" / "killed" / f"trial_{victim}").glob("version_*")) == ["version_0"]

    killed = load(tmp_path, "killed")
    assert table_rows(show(config)) == table_rows(second)  # --show prints the table the sweep ended with
    assert results(killed, 3) == results(calm, 3), f"seed {seed}: trial results differ from the uninterrupted sweep"
    for number in range(3):  # every trial's weights, the resumed one's included, bit-equal
        a, b = (weights(tmp_path / "runs" / s / f"trial_{number}" / "version_0") for s in ("calm", "killed"))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), f"seed {seed}: trial {number}"


@pytest.mark.long  # CI and make test-all; pruning as above, under DDP
def test_a_pruned_ddp_trial_stops_every_rank_at_the_same_step(tmp_path):
    probe = ["--trainer.callbacks+=tests.faults.StepsPerRank", f"--trainer.callbacks.out_dir={tmp_path / 'ranks'}"]
    fit = [*QUIET, *DDP2, "--trainer.max_epochs", "3", "--trainer.limit_train_batches", "2", *probe]
    # val/acc never reaches 2: the first validation prunes; without pruning the run would take 3 * 2 steps
    config = write_sweep(tmp_path, "ddp", 1, fit, lower=2.0)
    cli("sweep", "--config", str(config), "--enqueue", "[]", cwd=tmp_path, timeout=900)
    trial = load(tmp_path, "ddp").trials[0]
    assert trial.state == optuna.trial.TrialState.PRUNED and trial.user_attrs["pruned_at_epoch"] == 0
    ranks = [yaml.safe_load((tmp_path / "ranks" / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks == [{"global_step": 2, "epoch": 1}] * 2, ranks


@pytest.mark.long  # CI and make test-all; ~60 s: the same 3 trials by two workers and by one
def test_two_workers_run_trials_at_once_each_once_with_one_workers_results(tmp_path):
    # Every trial enqueued: which worker takes a trial does not change its parameters, so one worker is the oracle.
    trials = [{"model.init_args.lr": lr, "model.init_args.net.init_args.dropout": 0.1} for lr in (3e-3, 1e-2, 5e-3)]
    enqueue = ["--enqueue", json.dumps(trials)]
    for name, workers in (("two", "2"), ("one", "1")):
        config = str(write_sweep(tmp_path, name, 3, FIT, lower=0.0))  # none pruned
        cli("sweep", "--config", config, *enqueue, "--workers", workers, cwd=tmp_path, timeout=900)
    two, one = load(tmp_path, "two"), load(tmp_path, "one")
    assert [t.number for t in two.trials] == [0, 1, 2]  # each trial taken once
    assert all(t.state == optuna.trial.TrialState.COMPLETE for t in two.trials)
    assert results(two, 3) == results(one, 3)  # same parameters, same values at every epoch
    for number in range(3):
        a, b = (weights(tmp_path / "runs" / s / f"trial_{number}" / "version_0") for s in ("two", "one"))
        assert all(torch.equal(a[k], b[k]) for k in a), f"trial {number}"
    # Both workers took trials, and two trials ran at the same time.
    pids = {(tmp_path / "runs" / "two" / f"trial_{n}" / "worker.lock").read_text().split()[1] for n in range(3)}
    assert len(pids) == 2, pids
    spans = sorted((t.datetime_start, t.datetime_complete) for t in two.trials)
    assert any(later[0] < earlier[1] for earlier, later in itertools.pairwise(spans)), spans


def _sweep(tmp_path: Path, name: str, monitor: str) -> subprocess.CompletedProcess:
    """Two trials of a module without validation_step, one epoch each, optimising ``monitor``."""
    config = {
        "name": name, "root": str(tmp_path / "runs"), "trials": 2, "seed": 0, "monitor": monitor,
        "direction": "minimize",
        "fit": [*QUIET, "--model", "tests.fixtures.no_validation.NoValidation", "--data",
                "tests.fixtures.kinds.KindData", "--data.as_dict", "true", "--trainer.max_epochs", "1",
                "--trainer.limit_train_batches", "3"],
        "space": {"model.init_args.lr": {"type": "float", "low": 0.01, "high": 0.1, "log": True}},
    }  # fmt: skip
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    env = {**os.environ, "PYTHONPATH": PYTHONPATH, "PYTHONWARNINGS": "ignore"}
    return subprocess.run([sys.executable, "-m", "project", "sweep", "--config", str(path)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip


def test_a_sweep_optimises_a_training_metric_of_a_module_without_validation(tmp_path):
    proc = _sweep(tmp_path, "train_metric", "train_mse")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    study = load(tmp_path, "train_metric")
    assert [t.state for t in study.trials] == [optuna.trial.TrialState.COMPLETE] * 2, proc.stdout[-2000:]
    for trial in study.trials:  # the value reported at the epoch's end is the last train_mse the trial logged
        logged = torch.load(next((tmp_path / "runs" / "train_metric" / f"trial_{trial.number}").glob(
            "version_*/checkpoints/last.ckpt")), weights_only=True)  # fmt: skip
        assert trial.value == pytest.approx(min(trial.intermediate_values.values())) and logged["global_step"] == 3


@pytest.mark.long  # CI and make test-all
def test_a_sweep_whose_every_trial_failed_exits_non_zero(tmp_path):
    proc = _sweep(tmp_path, "all_fail", "not_logged")
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "error: every trial of sweep 'all_fail' failed" in proc.stderr, proc.stderr[-2000:]
    assert [t.state for t in load(tmp_path, "all_fail").trials] == [optuna.trial.TrialState.FAIL] * 2
