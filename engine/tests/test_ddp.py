"""Two CPU ranks (gloo) through the real CLI: one run folder, one event stream, checkpoints, metrics."""

import math
import os

import pytest
import torch

from tests.fixtures.stand_in import SAMPLES
from tests.helpers import DDP2, PYTHONPATH, QUIET, cli, run_dirs, scalars

pytestmark = pytest.mark.slow


def test_two_rank_fit_writes_exactly_one_run(workdir):
    # every step logged (the default logs every 50th: fewer host syncs), so that each step's train/loss is counted
    cli("fit", *QUIET, *DDP2, "--trainer.max_epochs", "2", "--model.warmup", "1", "--trainer.log_every_n_steps", "1",
        cwd=workdir, timeout=240)  # fmt: skip
    (run,) = run_dirs(workdir)
    assert len(list(run.glob("events.out.tfevents.*"))) == 1
    assert sorted(p.name for p in run.glob("*.yaml")) == ["config.yaml", "hparams.yaml"]
    ckpt = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)
    train = SAMPLES - 2 * int(SAMPLES * 0.15)  # the stand-in's train split (15 % val, 15 % test)
    per_rank_batches = math.ceil(math.ceil(train / 2) / 64)  # each rank's half, padded to equal, in batches of 64
    assert ckpt["global_step"] == 2 * per_rank_batches
    logged = scalars(run)
    assert len(logged["val/acc"]) == 2 and 0.5 < logged["val/acc"][-1][1] <= 1
    assert len(logged["train/loss"]) == 2 * per_rank_batches


@pytest.mark.long  # CI and make test-all
def test_parameters_unused_in_a_steps_loss_under_ddp_are_one_line_naming_the_strategy_that_allows_them(tmp_path):
    """A GAN's two optimizers (each step's loss leaves the other network's parameters without a gradient), under DDP
    without find_unused_parameters: Lightning's RuntimeError on both ranks, a traceback wall of ~185 lines before."""
    gan = ["--model", "tests.fixtures.kinds.TwoOptimizers", "--data", "tests.fixtures.kinds.KindData",
           "--run.monitor", "null", "--trainer.max_epochs", "1"]  # fmt: skip
    proc = cli("fit", *QUIET, *DDP2, *gan, cwd=tmp_path, check=False)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "--trainer.strategy ddp_find_unused_parameters_true" in errors[0], errors
    assert not (tmp_path / "runs").exists()  # it trained no batch: no run folder left
    fixed = cli("fit", *QUIET, *DDP2, *gan, "--trainer.strategy", "ddp_find_unused_parameters_true", cwd=tmp_path)
    assert fixed.returncode == 0


DESTROYED_AT_EXIT = """
import atexit, os, torch, torch.distributed as dist
from lightkeep.distributed import DestroyProcessGroup
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str({port}))
dist.init_process_group("gloo", rank=0, world_size=1)
work = dist.all_reduce(torch.ones(2), async_op=True)  # work of the group's threads, left as an agreement leaves it
atexit.register(lambda: print("group alive at exit:", dist.is_initialized()))  # runs after the ones registered later
{fail}
raise SystemExit(143)
"""


@pytest.mark.parametrize("failed", [True, False])
def test_a_preempted_stage_destroys_its_process_group_at_exit_while_the_interpreter_is_whole(failed):
    """Lightning skips teardown after a failure (a preemption's SIGTERMException too): the group would be left to
    the interpreter's end, where gloo can abort the process (-6 for 143)."""
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    stopped = "from lightning.pytorch.utilities.exceptions import SIGTERMException as Stop"
    fail = f"{stopped}\nDestroyProcessGroup().on_exception(None, None, Stop())" if failed else ""
    code = DESTROYED_AT_EXIT.format(port=port, fail=fail)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": PYTHONPATH})  # fmt: skip
    assert proc.returncode == 143, proc.stderr[-2000:]
    assert f"group alive at exit: {not failed}" in proc.stdout, proc.stdout + proc.stderr[-2000:]
