"""Lightning's own Trainer flags work with the engine and behave as Lightning documents them (single process, in this
process through the real CLI)."""

import math

import pytest

from tests.faults import Probe
from tests.fixtures.stand_in import SAMPLES
from tests.helpers import QUIET, RUN_NAME, cli_in_process

pytestmark = pytest.mark.slow

BASE = [*QUIET, "--trainer.max_epochs", "2", "--trainer.limit_val_batches", "2", "--model.warmup", "1"]
TRAIN = SAMPLES - 2 * int(SAMPLES * 0.15)  # the stand-in's train split, 15 % val and 15 % test held out: 1259 samples
BATCHES = math.ceil(TRAIN / 64)  # in batches of 64: 20


def run(tmp_path, *args):
    cli = cli_in_process("fit", *BASE, "--trainer.callbacks+=tests.faults.Probe", *args, root=tmp_path / "runs")
    probe = next(c for c in cli.trainer.callbacks if isinstance(c, Probe))
    return cli.trainer, probe, tmp_path / "runs" / RUN_NAME / "version_0"


def per_epoch(probe):
    return [len(v) for _, v in sorted(probe.batches.items())]


CASES = {
    "fast_dev_run true": (
        ["--trainer.fast_dev_run", "true"],
        lambda t, p, d: t.global_step == 1 and p.val_runs == 1,
    ),
    "fast_dev_run 3": (["--trainer.fast_dev_run", "3"], lambda t, p, d: t.global_step == 3),
    "overfit_batches 4": (  # the same 4 batches, in the same order, every epoch
        ["--trainer.overfit_batches", "4", "--trainer.max_epochs", "3"],
        lambda t, p, d: per_epoch(p) == [4, 4, 4] and p.batches[0] == p.batches[1] == p.batches[2],
    ),
    "limit_train_batches 5": (["--trainer.limit_train_batches", "5"], lambda t, p, d: per_epoch(p) == [5, 5]),
    "limit_train_batches 0.25": (["--trainer.limit_train_batches", "0.25"], lambda t, p, d: per_epoch(p) == [5, 5]),
    "limit_val_batches 0.5": (  # 5 val batches of 64 (269 samples): half is 2
        ["--trainer.limit_val_batches", "0.5"],
        lambda t, p, d: t.num_val_batches == [2],
    ),
    "max_epochs 1": (["--trainer.max_epochs", "1"], lambda t, p, d: t.global_step == BATCHES),
    "max_steps 7, max_epochs -1": (
        ["--trainer.max_epochs", "-1", "--trainer.max_steps", "7"],
        lambda t, p, d: t.global_step == 7,
    ),
    "max_time 2 s": (
        ["--trainer.max_epochs", "-1", "--trainer.max_time", "00:00:00:02"],
        lambda t, p, d: t.global_step > 0 and (d / "checkpoints" / "last.ckpt").is_file(),
    ),
    # 20 batches padded to 21 (the global batch, 3 batches, is the padding's unit): 7 whole optimizer steps an epoch
    "accumulate_grad_batches 3": (
        ["--trainer.accumulate_grad_batches", "3"],
        lambda t, p, d: t.global_step == 14 and per_epoch(p) == [21, 21],
    ),
    "val_check_interval 0.5": (["--trainer.val_check_interval", "0.5"], lambda t, p, d: p.val_runs == 4),
    "val_check_interval 10": (["--trainer.val_check_interval", "10"], lambda t, p, d: p.val_runs == 4),
    "check_val_every_n_epoch 2": (
        ["--trainer.check_val_every_n_epoch", "2", "--trainer.max_epochs", "4"],
        lambda t, p, d: p.val_runs == 2,
    ),
    "num_sanity_val_steps 0": (["--trainer.num_sanity_val_steps", "0"], lambda t, p, d: p.sanity_batches == 0),
    "gradient_clip_val 0.05": (
        ["--trainer.gradient_clip_val", "0.05"],
        lambda t, p, d: max(p.grad_norms) <= 0.05 * (1 + 1e-5),
    ),
    "precision bf16-mixed": (["--trainer.precision", "bf16-mixed"], lambda t, p, d: t.global_step == 2 * BATCHES),
    "deterministic false": (["--trainer.deterministic", "false"], lambda t, p, d: t.global_step == 2 * BATCHES),
    "profiler simple": (["--trainer.profiler", "simple"], lambda t, p, d: t.global_step == 2 * BATCHES),
    "profiler advanced": (["--trainer.profiler", "advanced", "--trainer.max_epochs", "1"], lambda t, p, d: True),
    "detect_anomaly": (["--trainer.detect_anomaly", "true", "--trainer.max_epochs", "1"], lambda t, p, d: True),
    "enable_checkpointing false": (
        ["--trainer.enable_checkpointing", "false"],
        lambda t, p, d: t.global_step == 2 * BATCHES and not list(d.rglob("*.ckpt")),
    ),
    "enable_progress_bar true": (["--trainer.enable_progress_bar", "true"], lambda t, p, d: t.progress_bar_callback),
    "EarlyStopping": (
        ["--trainer.callbacks+=EarlyStopping", "--trainer.callbacks.monitor=val/acc", "--trainer.callbacks.mode=max"],
        lambda t, p, d: t.early_stopping_callback is not None,
    ),
    "RichProgressBar": (
        ["--trainer.enable_progress_bar", "true", "--trainer.callbacks+=RichProgressBar"],
        lambda t, p, d: type(t.progress_bar_callback).__name__ == "RichProgressBar",
    ),
    "ModelSummary": (["--trainer.callbacks+=ModelSummary", "--trainer.callbacks.max_depth=2"], lambda t, p, d: True),
    "StochasticWeightAveraging": (
        ["--trainer.callbacks+=StochasticWeightAveraging", "--trainer.callbacks.swa_lrs=0.001"],
        lambda t, p, d: t.global_step == 2 * BATCHES,
    ),
    "num_workers 2": (["--data.num_workers", "2"], lambda t, p, d: per_epoch(p) == [BATCHES, BATCHES]),
}


@pytest.mark.parametrize("flags", list(CASES), ids=list(CASES))
def test_flag_works_with_the_engine(flags, tmp_path):
    args, behaves = CASES[flags]
    trainer, probe, run_dir = run(tmp_path, *args)
    assert behaves(trainer, probe, run_dir), flags
    # fast_dev_run writes nothing (Lightning: "Logging and checkpointing is suppressed"); every other run its folder
    assert (run_dir / "config.yaml").is_file() != flags.startswith("fast_dev_run")
    assert [p.name for p in run_dir.parent.glob("*")] == ([] if flags.startswith("fast_dev_run") else ["version_0"])
