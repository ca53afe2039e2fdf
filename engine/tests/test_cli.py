"""The real CLI: configs, every subcommand, the LR curve of a real fit, resume, export (in subprocesses where the exit
code and the one error line are the point, else in this process)."""

import gc
import math
import os
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
import yaml
from lightning.pytorch.callbacks import Callback

from tests.fixtures.stand_in import SAMPLES
from tests.helpers import PYTHONPATH, QUIET, STAND_IN, cli, cli_in_process, run_dirs, scalars

pytestmark = pytest.mark.slow  # subprocesses: the real `python -m project`

TINY = [*QUIET, "--trainer.max_epochs", "2", "--trainer.limit_train_batches", "5", "--trainer.limit_val_batches", "2"]
TRAIN_SIZE = SAMPLES - 2 * int(SAMPLES * 0.15)  # the stand-in's default train split (15 % val, 15 % test)
CNN = "tests.fixtures.stand_in.SmallCNN"  # another net than the default MLP


@pytest.mark.long  # CI and make test-all; each subcommand: tests/test_console.py runs them in make test
def test_each_subcommand_runs_and_reruns_never_clash(workdir):
    cli("fit", *TINY, "--model.net", CNN, "--model.warmup", "1", cwd=workdir)
    cli("fit", *TINY, "--model.warmup", "1", cwd=workdir)  # a second run: a new folder, no "config.yaml exists"
    first, second = run_dirs(workdir)
    ckpt = first / "checkpoints" / "last.ckpt"
    assert yaml.safe_load((first / "config.yaml").read_text())["model"]["init_args"]["net"]["class_path"] == CNN
    assert (second / "config.yaml").is_file()
    for sub in ("validate", "test", "predict"):
        proc = cli(sub, *QUIET, "--model.net", CNN, "--ckpt_path", str(ckpt), cwd=workdir)
        if sub != "predict":
            assert f"{'val' if sub == 'validate' else 'test'}/acc" in proc.stdout
    assert len(run_dirs(workdir)) == 5  # validate/test/predict each keep their own config, in their own folder


def closed_form(t: int, b: float, w: int, m: int, ws: float) -> float:
    if t < w:
        return ws + t * (b - ws) / max(1, w - 1)
    return 0.0 if t >= m else 0.5 * b * (1 + math.cos(math.pi * (t - w) / (m - w)))


def test_lr_set_at_each_step_of_a_real_fit_is_the_formula_and_never_zero(workdir):
    # every step logged (the default logs every 50th: fewer host syncs), as a user wanting the per-step curve asks
    cli_in_process("fit", *QUIET, "--trainer.max_epochs", "3", "--trainer.limit_val_batches", "1", "--model.warmup",
                   "1", "--model.lr", "0.01", "--trainer.log_every_n_steps", "1", root=workdir / "runs")  # fmt: skip
    (run,) = run_dirs(workdir)
    lrs = scalars(run)["lr"]
    per_epoch = math.ceil(TRAIN_SIZE / 64)
    assert [s for s, _ in lrs] == list(range(3 * per_epoch))
    w, m = per_epoch, 3 * per_epoch  # warmup 1 epoch, schedule = max_epochs, both converted to steps
    for step, lr in lrs:
        assert lr == pytest.approx(closed_form(step, 0.01, w, m, 0.01 / w), rel=1e-6), step
    assert min(lr for _, lr in lrs) > 0


@pytest.mark.long  # CI and make test-all; the same folder continued: every resume test asserts it
def test_resume_from_last_continues_the_same_run(workdir):
    common = [
        *QUIET,
        "--trainer.log_every_n_steps",  # every step: the curves are compared step by step (the default: every 50)
        "1",
        "--trainer.limit_val_batches",
        "2",
        "--model.warmup",
        "1",
        "--model.max_schedule",
        "4",
        "--model.lr",
        "0.01",
    ]
    cli("fit", *common, "--trainer.max_epochs", "2", cwd=workdir)
    proc = cli("fit", *common, "--trainer.max_epochs", "4", "--ckpt_path", "last", cwd=workdir)
    assert "resuming from" in proc.stdout + proc.stderr
    (run,) = run_dirs(workdir)  # no second run folder for the same training
    assert sorted(p.name for p in run.glob("config*.yaml")) == ["config.1.yaml", "config.yaml"]
    per_epoch = math.ceil(TRAIN_SIZE / 64)
    ckpt = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)
    # epoch 3: the epoch-end save; 4: ModelCheckpoint's save at the end of fit (the 10-minute last.ckpt writer
    # saves there when its interval never came), after the loop counted the last epoch as done
    assert ckpt["global_step"] == 4 * per_epoch and ckpt["epoch"] in (3, 4)
    logged = scalars(run)
    assert [s for s, _ in logged["train/loss"]] == list(range(4 * per_epoch))  # each step once, no gap
    assert len(logged["val/acc"]) == 4
    for step, lr in logged["lr"]:  # the schedule went on where it stopped
        assert lr == pytest.approx(closed_form(step, 0.01, per_epoch, 4 * per_epoch, 0.01 / per_epoch), rel=1e-6)


def test_resume_last_without_any_run_starts_fresh_with_a_notice(workdir, capsys, caplog):
    with caplog.at_level("INFO"):  # the notice is Lightning's rank_zero_info: a log record in this process
        cli_in_process("fit", *TINY, "--model.warmup", "1", "--ckpt_path", "last", root=workdir / "runs")
    out = caplog.text + "".join(capsys.readouterr())
    assert "no checkpoint under" in out and "starting from scratch" in out, out[-3000:]
    assert len(run_dirs(workdir)) == 1


@pytest.mark.parametrize(
    ("flag", "message"),
    [
        (["--model.lr", "-0.1"], "lr (-0.1) must be a finite number > 0"),
        (["--data.batch_size", "0"], "batch_size (0) must be >= 1"),
    ],
)
def test_out_of_range_values_fail_before_training_with_one_clear_line(workdir, flag, message):
    proc = cli("fit", *QUIET, *flag, cwd=workdir, check=False)
    assert proc.returncode == 2
    assert f"error: {message}" in proc.stderr and "Traceback" not in proc.stderr
    assert not (workdir / "runs").exists()  # nothing written: the run never started


def test_only_the_given_subcommand_is_built_yet_help_and_typos_list_all_four(capsys):
    from lightkeep.cli import CLI, SUBCOMMANDS
    from lightkeep.main import cli_main

    with pytest.raises(SystemExit) as exit_info:
        cli_main(["--help"])
    assert exit_info.value.code == 0
    listed = capsys.readouterr().out
    assert all(sub in listed for sub in SUBCOMMANDS)
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["fitt"])
    assert exit_info.value.code == 2
    assert "fitt" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["validate", "--help"])
    assert exit_info.value.code == 0
    assert "--ckpt_path" in capsys.readouterr().out
    assert list(CLI.subcommands(SimpleNamespace(only="fit"))) == ["fit"]  # type: ignore[arg-type]
    assert list(CLI.subcommands(SimpleNamespace(only=None))) == list(SUBCOMMANDS)  # type: ignore[arg-type]


class FreezeProbe(Callback):
    """Prints how many objects are frozen (out of the garbage collector's full passes) when training starts."""

    def on_train_start(self, trainer, pl_module) -> None:
        print(f"frozen during the run: {gc.get_freeze_count()}")


def test_a_run_keeps_the_imported_heap_out_of_full_collections_and_a_python_caller_gets_it_back(tmp_path):
    """Frozen while a run lasts (0.22 s of start-up, see lightkeep.run_scope); once cli_main returns, with
    arguments or from sys.argv, the heap is collectable again (python -m project freezes it for its exit)."""
    run = [*STAND_IN, *QUIET, "--trainer.max_steps", "1", "--trainer.limit_val_batches", "1",
           "--trainer.callbacks+=tests.test_cli.FreezeProbe"]  # fmt: skip
    program = f"""
import gc, sys
from tests.helpers import cli_main
cli_main(["fit", *{run!r}])
print(f"frozen after cli_main(args): {{gc.get_freeze_count()}}")
sys.argv = ["project", "fit", *{run!r}]
cli_main()
print(f"frozen after cli_main(): {{gc.get_freeze_count()}}")
"""
    env = {**os.environ, "PYTHONPATH": PYTHONPATH, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, "-c", program], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    counts = dict(re.findall(r"frozen (.+): (\d+)", proc.stdout))
    during, after_call, after_program = (
        int(counts[k]) for k in ("during the run", "after cli_main(args)", "after cli_main()")
    )
    assert during > 100_000  # what importing Lightning left (~450k objects)
    assert after_call == 0
    assert after_program == 0
