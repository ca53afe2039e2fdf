"""What the console says: every line of each subcommand, and a dead DDP rank reported in one line.

Both run the real CLI in a subprocess without the helpers' ``PYTHONWARNINGS=ignore``: they see what a user sees.
"""

import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from lightkeep.checkpoint_files import check_fits
from tests.fixtures.stand_in import StandIn
from tests.helpers import DDP2, PYTHONPATH, RUN_NAME, STAND_IN, cli, with_stand_in

pytestmark = pytest.mark.slow

# A tqdm frame ("Epoch 0: 100%|███| 2/2 [00:01<00:00, 1.86it/s, v_num=0]"), possibly with a line printed right
# after it before the next "\r", and tqdm's cursor-up escape.
FRAME = re.compile(
    r"^(?:Sanity Checking|Training|Validation|Testing|Predicting|Epoch \d+)[^|]*\|[^|]*\|[^\[]*\[[^\]]*\]"
)
TABLE = r"[┏┃┡│└].*"  # a row of Lightning's model summary or results table (rich)


def console_lines(output: str) -> list[str]:
    """The lines a reader sees once the progress bar has gone: frames and blank lines dropped."""
    lines = []
    for piece in re.split(r"[\r\n]", output.replace("\x1b[A", "")):
        while FRAME.match(piece):
            piece = FRAME.sub("", piece, count=1)
        if piece.strip():
            lines.append(piece.rstrip())
    return lines


DRIVER = """
import os, sys
from unittest import mock
from tests.helpers import cli_main

for verbose, args in {runs!r}:
    if verbose:
        os.environ["PROJECT_VERBOSE"] = "1"
    else:
        os.environ.pop("PROJECT_VERBOSE", None)
    print("=== " + ("verbose " if verbose else "") + args[0], flush=True)
    with mock.patch.object(sys, "argv", ["project"]):
        cli_main(args)
"""
LIMITS = ["--trainer.limit_train_batches", "2", "--trainer.limit_val_batches", "2", "--trainer.limit_test_batches",
          "2", "--trainer.limit_predict_batches", "2"]  # fmt: skip
# The stand-in's: its MLP 64-256-256-10 has 85,002 parameters (0.340 MB in float32), and its 17 submodules are the
# net's 10 (MLP, Sequential, Flatten and 3 Linear, 2 ReLU, 2 Dropout) and the metrics' 7 (a ModuleDict of 6).
SUMMARY = [TABLE] * 6 + [
    r"Trainable params: 85\.0 K",
    r"Non-trainable params: 0",
    r"Total params: 85\.0 K",
    r"Total estimated model params size \(MB\): 0\.340",
    r"Modules in train mode: 17",
    r"Modules in eval mode: 0",
    r"Total FLOPs: 0",
]
RESULTS = [TABLE] * 6
LOGGER = "ThrottledTensorBoardLogger"


def evaluation(stage: str, version: int) -> list[str]:
    ckpt = rf"runs/{RUN_NAME}/version_0/checkpoints/last\.ckpt"
    start = rf"Run runs/{RUN_NAME}/version_{version} \({stage} of {ckpt}, step 2\) \| 1 x cpu \| logs: {LOGGER}"
    return [rf"=== {stage}", start]


# Every line of a quiet run, in order: a new warning or message (a dependency upgrade) fails the test and is then
# acted on or silenced on purpose in engine/lightkeep/console.py.
# the default config's speed switches on a CPU, as the start line names them
SPEED = (
    " | speed: malloc keeps freed memory, heap frozen (gc), self.log skips moves, saves in the background, "
    "no CRC-32 in checkpoints"
)
EXPECTED = [
    "=== fit",
    *SUMMARY,
    rf"Run runs/{RUN_NAME}/version_0 \(fresh\) \| 1 x cpu \| exact resume: yes, also mid-epoch \(each resume checks "
    rf"its first batch\) \| logs: {LOGGER}" + re.escape(SPEED),
    r"LR schedule: warmup \(2 epochs = 4 steps\) is longer than this run \(2 steps\): warmup shortened to 2 steps,"
    r" no cosine decay",
    rf"Run summary: best val/acc 0\.\d{{4}} \| best checkpoint runs/{RUN_NAME}/version_0/checkpoints/best-epoch000-step"
    rf"\d+\.ckpt \| run folder runs/{RUN_NAME}/version_0",
    *evaluation("validate", 1),
    *RESULTS,
    *evaluation("test", 2),
    *RESULTS,
    *evaluation("predict", 3),
    rf"Predictions of 128 samples: runs/{RUN_NAME}/version_3/predictions\.csv and \.pt",
]  # fmt: skip
# What PROJECT_VERBOSE=1 brings back: proof that each silenced message still exists (else its filter is stale).
VERBOSE_ONLY = [
    "💡 Tip: For seamless cloud logging",
    "GPU available: False, used: False",
    "TPU available: False",
    "Seed set to 42",
    "Restoring states from the checkpoint path at",
    "Loaded model weights from the checkpoint at",
    "`Trainer.fit` stopped: `max_epochs=1` reached.",
    "`isinstance(treespec, LeafSpec)` is deprecated",  # Lightning's warning format names no category
    "The dirpath has changed from",
    "The number of training batches (2) is smaller than the logging interval Trainer(log_every_n_steps=50)",
]


def test_console_of_each_subcommand_is_every_line_worth_reading(tmp_path: Path) -> None:
    quiet = [(False, with_stand_in(["fit", *LIMITS, "--trainer.max_epochs", "1"]))]
    quiet += [(False, with_stand_in([sub, *LIMITS, "--ckpt_path", "last"])) for sub in ("validate", "test", "predict")]
    verbose = [(True, with_stand_in(["fit", *LIMITS, "--trainer.max_epochs", "1", "--run.name", "loud"]))]
    verbose += [(True, with_stand_in(["validate", *LIMITS, "--run.name", "loud", "--ckpt_path", "last"]))]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONWARNINGS", "PROJECT_VERBOSE")}
    proc = subprocess.run(
        # the verbose runs first (each run removes its filters when it ends: the order should not matter)
        [sys.executable, "-c", DRIVER.format(runs=verbose + quiet)],
        cwd=tmp_path,
        env={**env, "PYTHONPATH": PYTHONPATH},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,  # one stream, in the order a terminal shows it
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-5000:]
    loud, _, quiet_output = proc.stdout.partition("=== fit\n")
    for message in VERBOSE_ONLY:
        assert message in loud, f"PROJECT_VERBOSE=1 did not bring back {message!r}:\n{loud[-5000:]}"
    lines = console_lines("=== fit\n" + quiet_output)
    report = "\n".join(lines)
    assert len(lines) == len(EXPECTED), f"expected {len(EXPECTED)} lines, got {len(lines)}:\n{report}"
    for line, pattern in zip(lines, EXPECTED, strict=True):
        assert re.fullmatch(pattern, line), f"line {line!r} does not match {pattern!r} in:\n{report}"


@pytest.mark.long  # CI and make test-all; ~65 s: three DDP failures and resumes
def test_a_dead_rank_is_reported_in_one_line_and_the_run_resumes(tmp_path: Path) -> None:
    # 4 epochs of 4 steps per rank; checkpoints at each epoch end (steps 4, 8, 12). Three failures in a row, each
    # resumed from the checkpoint the previous report named: rank 1 killed at step 6, rank 1 raising at step 10,
    # rank 0 killed at step 14.
    args = [*DDP2, "--trainer.max_epochs", "4", "--trainer.limit_train_batches", "4", "--trainer.limit_val_batches",
            "1", "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false"]  # fmt: skip
    faults = [
        ("KillAt", 6, 1, r"rank 1 was killed by SIGKILL \(kill -9, or out of memory\)", 4),
        ("CrashAt", 10, 1, r"rank 1 raised RuntimeError: injected crash", 8),
        ("KillAt", 14, 0, r"rank 0 was killed by a signal \(kill -9, or out of memory\)", 12),
    ]
    # limit_val_batches 1 on 2 ranks: 2 batches where one process evaluates 1 (named; lightkeep.guarantees)
    per_rank_limit = (
        "limit_val_batches 1 applies per rank: 2 ranks evaluate 2 batches (128 samples) a validation where one "
        "process evaluates 1 (64), so its values are not one process's"
    )
    # what --ckpt_path last picks: the newest file, the best-3 file of that epoch's end or (every 2 epochs) the
    # epoch00N.ckpt of the same step
    newest = rf"runs/{RUN_NAME}/version_0/checkpoints/(?:best-epoch\d{{3}}-step\d+|epoch\d{{3}})\.ckpt"
    resumed_from = last = None
    for kind, step, rank, how, saved_step in faults:
        marker = tmp_path / f"{kind}-{step}"  # touched by KillAt right before the kill: the time of death
        fault = [f"--trainer.callbacks+=tests.faults.{kind}", f"--trainer.callbacks.step={step}",
                 f"--trainer.callbacks.rank={rank}"]  # fmt: skip
        # settle: rank 0 killed right after an epoch's end must not die with that end's background write in flight
        # (under load it did: the report then named the step before, correctly, and the test expected the newer one)
        fault += (
            [f"--trainer.callbacks.once_marker={marker}", "--trainer.callbacks.settle=true"] if kind == "KillAt" else []
        )
        resume = ["--ckpt_path", "last"] if resumed_from is not None else []
        proc = cli("fit", *args, *fault, *resume, cwd=tmp_path, check=False, timeout=240, env={"PYTHONWARNINGS": ""})
        ended = time.time()
        out = proc.stdout + proc.stderr
        assert proc.returncode != 0, out[-3000:]
        if kind == "KillAt":
            assert ended - marker.stat().st_mtime < 30, f"the survivor took {ended - marker.stat().st_mtime:.0f} s"
        command = shlex.join(["python", "-m", "project", "fit", *STAND_IN, *args, *fault, "--ckpt_path", "last"])
        report = (
            rf"error: {how}; the other ranks stopped\. Newest complete checkpoint, intact: ({newest})"
            rf" \(step {saved_step}\)\. Resume: {re.escape(command)}"
        )
        match = re.fullmatch(report, proc.stderr.splitlines()[-1])
        assert match, out[-3000:]
        assert "pair.cc" not in out and "Connection reset" not in out, out[-3000:]  # no gloo traceback wall
        start = "(fresh)" if resumed_from is None else f"(continues from step {resumed_from} of {last})"
        # a resume from an epoch's end (4 steps of 2 x 64 samples): the next epoch's first batch, as recorded
        exact = "see opts out" if resumed_from is None else (
            f"resume verified (epoch {resumed_from // 4}, batch 0: 128 samples on 2 rank(s), those the checkpoint's "
            "run would have trained next); see opts out")  # fmt: skip
        lines = console_lines(proc.stdout) + console_lines(proc.stderr)
        expected = [
            "`Trainer(limit_val_batches=1)` was configured so 1 batch will be used.",
            f"Run runs/{RUN_NAME}/version_0 {start} | 2 x cpu | exact resume: {exact}"
            f" | logs: ThrottledTensorBoardLogger | opts out: {per_rank_limit}{SPEED}",
        ]
        if resumed_from is not None:
            expected.insert(0, f"--ckpt_path last: resuming from {last} (global step {resumed_from})")
        if kind == "CrashAt":  # the failing rank's own traceback stays: it is the cause
            assert "RuntimeError: injected crash" in proc.stderr and "Traceback" in proc.stderr
            lines = [line for line in lines if line in expected or line == lines[-1]]
        # stdout's and stderr's lines, each stream in order; the report ends stderr
        assert sorted(lines[:-1]) == sorted(expected), "\n".join(lines)
        # the checkpoint the report names loads and holds the step it says
        named = tmp_path / match[1]
        assert torch.load(named, weights_only=True, map_location="cpu")["global_step"] == saved_step
        check_fits(named, StandIn())  # the default net: hidden [256, 256]
        resumed_from, last = saved_step, match[1]  # the next run must resume from exactly this one


def test_the_resume_command_is_the_users_without_the_class_switches_null_and_the_old_ckpt_path():
    from lightkeep.config import entered, start_from_class_defaults
    from lightkeep.rank_failures import resume_command

    typed = ["validate", "--model", "my.Model", "--data=my.Data", "--ckpt_path", "best", "--trainer.devices", "2"]
    rewritten = ["prog", *start_from_class_defaults(typed)]  # what sys.argv holds once the CLI has parsed it
    assert rewritten.count("null") == 2
    rest = "fit --model my.Model --data=my.Data --trainer.devices 2 --ckpt_path last"
    for program in ("lightkeep", "project"):  # the engine's own entry, and a project's thin one
        with entered(program, None):
            assert resume_command(rewritten) == f"python -m {program} {rest}"


@pytest.mark.parametrize(
    ("child_code", "stops_too", "killed"),
    [
        pytest.param(143, True, False, id="every-rank-stops-on-purpose"),  # a preemption: rank 0 exits by itself
        pytest.param(143, False, True, id="a-rank-stops-alone"),  # rank 0 trains on: Lightning's kill, later
        pytest.param(1, True, True, id="a-rank-failed"),
    ],
)
def test_lightnings_observer_spares_rank_0_finishing_a_stop_every_rank_makes(tmp_path, monkeypatch, child_code,
                                                                            stops_too, killed):  # fmt: skip
    """Rank 1 ends a preemption (exit 143) before rank 0 has: Lightning's observer of the ranks, which SIGKILLs every
    rank and rank 0 once one exits non-zero, leaves rank 0 to finish and exit 143 itself (it exited -9 under load)."""
    from types import SimpleNamespace

    from lightning.fabric.strategies.launchers.subprocess_script import _ChildProcessObserver
    from lightning.pytorch.plugins.environments import LightningEnvironment
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    from lightkeep import rank_failures

    monkeypatch.setattr(rank_failures, "HOLD_S", 1.0)
    monkeypatch.setattr(rank_failures, "STOP_HOLD_S", 4.0)
    sleep = [sys.executable, "-c", "import time; time.sleep(60)"]
    main = subprocess.Popen(sleep)  # stands in for rank 0, which the observer SIGKILLs (not this test's process)
    procs = [subprocess.Popen([sys.executable, "-c", f"raise SystemExit({child_code})"])]
    launcher = SimpleNamespace(procs=procs)
    strategy = SimpleNamespace(launcher=launcher, cluster_environment=LightningEnvironment())
    trainer = SimpleNamespace(strategy=strategy, default_root_dir=str(tmp_path / "run"), global_rank=0, world_size=2)
    observer = _ChildProcessObserver(main_pid=main.pid, child_processes=procs, sleep_period=0.05)
    failures = rank_failures.RankFailures()
    try:
        observer.start()
        failures.setup(trainer, None, "fit")  # type: ignore[arg-type]
        if stops_too:  # rank 0 stops on purpose too (the run's stop reaches on_exception), a moment after rank 1
            time.sleep(0.3)
            failures.on_exception(trainer, None, SIGTERMException())  # type: ignore[arg-type]
        time.sleep(2.5)  # over twice HOLD_S: the observer has seen the exit and decided
        assert (main.poll() == -9) is killed, main.poll()
        observer.join(timeout=10)  # its kill after STOP_HOLD_S (rank 0 would be gone by then), before main's pid goes
    finally:
        failures.teardown(trainer, None, "fit")  # type: ignore[arg-type]
        for proc in (main, *procs):
            proc.kill()
            proc.wait()
