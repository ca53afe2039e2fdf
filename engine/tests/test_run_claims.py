"""A run's folder is its own: runs started together never share one, and a resume that fails at its start leaves
the run it continued byte for byte as it was (the real CLI, real files: in processes where processes race or a start's
exit code is checked, else in this process)."""

import hashlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from tests.helpers import QUIET, RUN_NAME, cli, cli_in_process, run_dirs

pytestmark = pytest.mark.slow

TINY = [*QUIET, "--trainer.max_epochs", "1", "--trainer.limit_train_batches", "3", "--trainer.limit_val_batches", "2",
        "--model.warmup", "0"]  # fmt: skip


def files(folder: Path) -> dict[str, str]:
    """sha256 of every file under ``folder``, and every folder (as '')."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else ""
        for p in sorted(folder.rglob("*"))
    }


def test_fits_started_together_with_one_run_name_get_folders_of_their_own(tmp_path):
    stamps = tmp_path / "stamps.txt"
    slow = ["--model.net", "tests.fixtures.slow_net.SlowToBuild", "--model.net.init_args.seconds", "8",
            "--model.net.init_args.stamps", str(stamps)]  # fmt: skip
    with ThreadPoolExecutor(2) as pool:
        procs = list(pool.map(lambda lr: cli("fit", *TINY, *slow, "--model.lr", lr, cwd=tmp_path, check=False,
                                             timeout=180), ["0.001", "0.01"]))  # fmt: skip
    for proc in procs:
        assert proc.returncode == 0, proc.stderr[-3000:]
    # the precondition: both nets were being built at once, so each run planned its folder before the other wrote
    # into its own (the window two runs shared one folder through)
    (_, start_a, end_a), (_, start_b, end_b) = (map(float, line.split()) for line in stamps.read_text().splitlines())
    assert start_a < end_b and start_b < end_a, stamps.read_text()
    runs = run_dirs(tmp_path)
    assert [r.name for r in runs] == ["version_0", "version_1"]
    lrs = set()
    for run in runs:
        assert sorted(p.name for p in run.glob("config*.yaml")) == ["config.yaml"], run
        assert len(list(run.glob("events.out.tfevents.*"))) == 1, run
        assert sorted(p.name for p in (run / "checkpoints").iterdir() if "-v" in p.name) == [], run
        ckpt = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)
        assert ckpt["global_step"] == 3
        lr = ckpt["hyper_parameters"]["lr"]
        assert f"lr: {lr}" in (run / "config.yaml").read_text()  # the checkpoint is its own config's run
        lrs.add(lr)
    assert lrs == {0.001, 0.01}


def test_a_resume_that_fails_at_its_start_leaves_the_earlier_run_as_it_was(tmp_path):
    csv = ["--trainer.logger+=CSVLogger"]  # a logger that rewrites its file when a run continues
    cli_in_process("fit", *TINY, *csv, "--trainer.max_epochs", "2", root=tmp_path / "runs")
    (run,) = run_dirs(tmp_path)
    before = files(tmp_path / "runs")
    proc = cli("fit", *TINY, *csv, "--trainer.max_epochs", "1", "--ckpt_path", "last", cwd=tmp_path, check=False)
    assert proc.returncode == 1 and "max_epochs=1" in proc.stderr, proc.stderr[-3000:]  # fails after the loggers start
    assert files(tmp_path / "runs") == before  # no config.1.yaml, no event file with a purge_step, metrics.csv whole
    cli_in_process("fit", *TINY, *csv, "--trainer.max_epochs", "3", "--ckpt_path", "last", root=tmp_path / "runs")
    assert run_dirs(tmp_path) == [run] and (run / "config.1.yaml").is_file()  # the real resume continues the run
    assert torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 9
    assert RUN_NAME in str(run)
