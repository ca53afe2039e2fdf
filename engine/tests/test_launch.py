"""The launch scripts, run for real: background runs, torchrun on 2 CPU ranks and 2 "nodes", the SLURM script."""

import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from lightkeep.run_checkpoints import find_last_checkpoint
from tests.helpers import DDP2, PYTHONPATH, QUIET, REPO, RUN_NAME, STAND_IN, free_port, run_dirs, scalars
from tests.test_summary import SUMMARY

SCRIPTS = REPO / "scripts"
TINY = ["--trainer.max_epochs", "2", "--trainer.limit_train_batches", "4", "--trainer.limit_val_batches", "2"]
# Epochs of a few batches each, for runs that must still be training when the test acts on them.
ENDLESS = ["--trainer.max_epochs", "100000", "--trainer.limit_train_batches", "4", "--trainer.limit_val_batches", "2"]


def launch_env(**extra: str) -> dict[str, str]:
    """This interpreter and checkout; no SLURM variables leaking in from a test run inside a SLURM job.

    PROJECT_VERBOSE=1: these tests read Lightning's own lines on ranks and launchers ("GLOBAL_RANK: 1, MEMBER: 2/2"),
    which the quiet console (lightkeep.console) leaves out."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    base = {"PYTHON": sys.executable, "PYTHONPATH": PYTHONPATH, "PYTHONWARNINGS": "ignore", "PROJECT_VERBOSE": "1"}
    return {**env, **base, **extra}


def wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.2)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


# --- background runs -------------------------------------------------------------------------------------------


def bg(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(SCRIPTS / "train_bg.sh"), *args], cwd=cwd, env=launch_env(), capture_output=True, text=True
    )


@pytest.mark.slow
def test_background_run_is_detached_and_records_its_exit_code(workdir):
    started = bg("start", "tiny", *STAND_IN, *QUIET, *TINY, cwd=workdir)
    assert started.returncode == 0, started.stderr
    pid = int((workdir / "logs" / "tiny.pid").read_text())
    # A session of its own: the hangup a closing terminal sends to its session never reaches the run.
    assert os.getsid(pid) != os.getsid(0)
    wait_for(lambda: "exited" in bg("status", "tiny", cwd=workdir).stdout, 180, "the tiny run to finish")
    assert bg("status", "tiny", cwd=workdir).stdout.strip() == "tiny exited with code 0"
    log = (workdir / "logs" / "tiny.log").read_text()
    assert any(line.startswith("Run summary: ") for line in log.splitlines())  # the run finished
    (run,) = run_dirs(workdir)
    assert (run / "checkpoints" / "last.ckpt").is_file()
    assert bg("stop", "tiny", cwd=workdir).returncode == 1  # nothing left to stop


@pytest.mark.long  # CI and make test-all; the background launcher again, with SIGHUP
@pytest.mark.slow
def test_background_run_ignores_hangup_and_stop_waits_for_its_exit(workdir):
    assert bg("start", "long", *STAND_IN, *QUIET, *ENDLESS, cwd=workdir).returncode == 0
    pid = int((workdir / "logs" / "long.pid").read_text())
    try:
        _hangup_then_stop(workdir, pid)
    finally:
        if alive(pid):  # never leave an endless run behind a failed test
            os.kill(pid, signal.SIGKILL)


def _hangup_then_stop(workdir: Path, pid: int) -> None:
    assert bg("start", "long", *STAND_IN, *QUIET, *ENDLESS, cwd=workdir).returncode == 1  # one run per name
    folder = workdir / "runs" / RUN_NAME / "version_0" / "checkpoints"
    wait_for(lambda: any(folder.glob("*.ckpt")), 120, "the first epoch's checkpoint")  # training, handlers installed
    os.kill(pid, signal.SIGHUP)  # what logging out sends
    time.sleep(1)
    assert alive(pid) and "running" in bg("status", "long", cwd=workdir).stdout

    stopped = bg("stop", "long", cwd=workdir)
    assert stopped.returncode == 0, stopped.stderr
    assert not alive(pid)
    code = (workdir / "logs" / "long.exit").read_text().strip()
    # The code is the run's to choose (what SIGTERM means is the training code's business); stop reports it.
    assert stopped.stdout.splitlines()[-1] == f"long exited with code {int(code)}"


# --- torchrun --------------------------------------------------------------------------------------------------


def torchrun(nnodes: int, node_rank: int, port: int, nproc: int, *fit_args: str) -> list[str]:
    return [
        "bash",
        str(SCRIPTS / "torchrun.sh"),
        "--nnodes",
        str(nnodes),
        "--node_rank",
        str(node_rank),
        "--rdzv",
        f"127.0.0.1:{port}",
        "--nproc_per_node",
        str(nproc),
        *STAND_IN,
        *QUIET,
        *TINY,
        *fit_args,
    ]


@pytest.fixture(scope="module")
def one_node_two_ranks(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    cwd = tmp_path_factory.mktemp("torchrun")
    proc = subprocess.run(
        torchrun(1, 0, free_port(), 2, *DDP2, *SUMMARY),
        cwd=cwd,
        env=launch_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    return cwd, proc


@pytest.mark.slow
def test_torchrun_two_cpu_ranks_train_one_run_summarised_once(one_node_two_ranks):
    cwd, proc = one_node_two_ranks
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    out = proc.stdout + proc.stderr
    assert "GLOBAL_RANK: 0, MEMBER: 1/2" in out and "GLOBAL_RANK: 1, MEMBER: 2/2" in out
    (run,) = run_dirs(cwd)
    ckpt = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)
    assert ckpt["global_step"] == 2 * 4  # 2 epochs of limit_train_batches on each rank, no extra launches
    assert len(scalars(run)["val/acc"]) == 2
    assert out.count("Run summary:") == 1  # by rank 0 alone


@pytest.mark.long  # CI and make test-all; torchrun again, on 2 nodes
@pytest.mark.slow
def test_torchrun_two_nodes_follow_node_rank_and_match_one_node(one_node_two_ranks, tmp_path):
    """2 nodes x 1 rank (two torchrun agents on this machine, separate folders) == 1 node x 2 ranks."""
    port, cpu = free_port(), ["--trainer.accelerator", "cpu", "--trainer.strategy", "ddp"]
    nodes = [tmp_path / "node0", tmp_path / "node1"]
    procs = []
    for rank, cwd in enumerate(nodes):  # node 0 first: it hosts the rendezvous store
        cwd.mkdir()
        procs.append(
            subprocess.Popen(
                torchrun(2, rank, port, 1, *cpu),
                cwd=cwd,
                env=launch_env(),
                stdout=subprocess.PIPE,
                text=True,
                stderr=subprocess.STDOUT,
            )
        )
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs[0][-3000:] + outs[1][-3000:]
    assert "GLOBAL_RANK: 0, MEMBER: 1/2" in outs[0] and "GLOBAL_RANK: 1, MEMBER: 2/2" in outs[1]
    assert not (nodes[1] / "runs").exists()  # rank 0, on node 0, writes everything
    (run,) = run_dirs(nodes[0])
    (reference,) = run_dirs(one_node_two_ranks[0])
    assert scalars(run)["val/acc"] == scalars(reference)["val/acc"]


# --- SLURM -----------------------------------------------------------------------------------------------------

SBATCH = SCRIPTS / "slurm.sbatch"


def sbatch_options() -> dict[str, str]:
    """The #SBATCH lines, as sbatch reads them: only those before the first command count."""
    options = {}
    for line in SBATCH.read_text().splitlines()[1:]:
        if line.startswith("#SBATCH"):
            key, _, value = line.split()[1].partition("=")
            options[key.lstrip("-")] = value
        elif line.strip() and not line.startswith("#"):
            break
    return options


def test_sbatch_script_is_valid_bash():
    subprocess.run(["bash", "-n", str(SBATCH)], check=True)


def test_sbatch_asks_one_task_per_gpu_and_the_signal_lightning_requeues_on():
    from lightning.fabric.plugins.environments import SLURMEnvironment

    options = sbatch_options()
    assert {"nodes", "ntasks-per-node", "gpus-per-node", "signal", "requeue", "time"} <= options.keys()
    assert options["ntasks-per-node"] == options["gpus-per-node"]
    sig, _, seconds = options["signal"].partition("@")
    assert signal.Signals[sig] == SLURMEnvironment().requeue_signal and int(seconds) > 0
    assert len(re.findall(r"^#SBATCH", SBATCH.read_text(), re.M)) == len(options)  # none after the first command


def dry_run(*args: str, **env: str) -> str:
    full_env = {k: v for k, v in launch_env(**env).items() if k != "PYTHON"}
    return subprocess.run(
        ["bash", str(SBATCH), *args], env=full_env, capture_output=True, text=True, check=True
    ).stdout.strip()


def test_dry_run_prints_the_srun_line_without_running_it():
    options = sbatch_options()
    expected = (
        "srun python -m project fit --config configs/ddp.yaml "
        f"--trainer.num_nodes {options['nodes']} --trainer.devices {options['ntasks-per-node']} --ckpt_path last"
    )
    assert dry_run("--config", "configs/ddp.yaml", DRY_RUN="1") == expected
    assert dry_run("--dry-run", "--config", "configs/ddp.yaml") == expected
    # Inside a job, what SLURM granted (sbatch --nodes ... overrides the #SBATCH lines) decides.
    granted = dry_run("--dry-run", "--model.lr", "1e-3", SLURM_NNODES="3", SLURM_NTASKS_PER_NODE="8")
    assert (
        granted
        == "srun python -m project fit --model.lr 1e-3 --trainer.num_nodes 3 --trainer.devices 8 --ckpt_path last"
    )


def test_readme_shows_the_srun_line_the_script_runs():
    readme = (REPO / "README.md").read_text()
    example = re.search(r"^DRY_RUN=1 bash scripts/slurm\.sbatch([^#\n]*).*\n# (srun .*)$", readme, re.M)
    assert example, "README documents scripts/slurm.sbatch but not its dry run and srun line"
    assert dry_run(*shlex.split(example[1]), DRY_RUN="1") == example[2].strip()


FAKE_SRUN = """#!/bin/bash
# srun on one machine: SLURM_NTASKS copies of the command, each with the task variables srun sets. SLURM sends
# --signal and its SIGTERM to every task; this stand-in passes both on.
pids=()
for ((i = 0; i < SLURM_NTASKS; i++)); do
    SLURM_PROCID=$i SLURM_LOCALID=$i SLURM_NODEID=0 "$@" &
    pids+=($!)
done
trap 'kill -USR1 "${pids[@]}"' USR1
trap 'kill -TERM "${pids[@]}"' TERM
rc=0
for pid in "${pids[@]}"; do
    while true; do wait "$pid"; s=$?; kill -0 "$pid" 2>/dev/null || break; done
    ((s)) && rc=$s
done
exit $rc
"""


def slurm_job(tmp_path: Path, ntasks: int) -> dict[str, str]:
    """The environment of a one-node job with ``ntasks`` tasks, with stand-ins for ``srun`` and ``scontrol``."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "srun").write_text(FAKE_SRUN)
    (bin_dir / "scontrol").write_text(f'#!/bin/bash\necho "$@" >> {tmp_path / "scontrol.calls"}\n')
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    return launch_env(
        PATH=f"{bin_dir}:{os.environ['PATH']}",
        SLURM_JOB_ID="4242",
        SLURM_JOB_NAME="project",
        SLURM_NNODES="1",
        SLURM_NTASKS=str(ntasks),
        SLURM_NTASKS_PER_NODE=str(ntasks),
        SLURM_NODELIST="127.0.0.1",
        MASTER_PORT=str(free_port()),
    )


@pytest.mark.long  # CI and make test-all; SLURM: the requeue test is in make test
@pytest.mark.slow
def test_srun_line_trains_two_ranks_under_lightnings_slurm_detection(tmp_path):
    cpu = ["--trainer.accelerator", "cpu", "--trainer.strategy", "ddp"]
    job = subprocess.run(
        ["bash", str(SBATCH), *STAND_IN, *QUIET, *TINY, *cpu],
        cwd=tmp_path,
        env=slurm_job(tmp_path, 2),
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = job.stdout + job.stderr
    assert job.returncode == 0, out[-5000:]
    assert "SLURM auto-requeueing enabled" in out and "Starting with 2 processes" in out
    (run,) = run_dirs(tmp_path)
    assert len(scalars(run)["val/acc"]) == 2


@pytest.mark.slow
def test_sigusr1_makes_lightning_checkpoint_and_requeue_and_the_requeued_job_resumes(tmp_path):
    log = tmp_path / "job.log"
    with log.open("w") as out:
        job = subprocess.Popen(
            ["bash", str(SBATCH), *STAND_IN, *QUIET, *ENDLESS, "--trainer.accelerator", "cpu"],
            cwd=tmp_path,
            env=slurm_job(tmp_path, 1),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        checkpoints = tmp_path / "runs" / RUN_NAME / "version_0" / "checkpoints"
        wait_for(lambda: any(checkpoints.glob("*.ckpt")), 120, "the first epoch's checkpoint")
        job.send_signal(signal.SIGUSR1)  # what --signal=SIGUSR1@90 delivers 90 s before the time limit
        calls = tmp_path / "scontrol.calls"
        wait_for(calls.is_file, 60, "scontrol requeue")
        assert calls.read_text().split() == ["requeue", "4242"]
        assert list((tmp_path / "runs" / RUN_NAME / "version_0").glob("hpc_ckpt_*.ckpt"))  # in the run, not the cwd
        job.send_signal(signal.SIGTERM)  # what the requeue then does to the running job
        job.wait(timeout=120)
        # The requeued job runs the same line, and --ckpt_path last continues the same run folder: from last.ckpt,
        # saved at the SIGTERM, or, when it came during a validation (which saves nothing), from the newest file.
        found = find_last_checkpoint(tmp_path / "runs" / RUN_NAME)
        assert found is not None, "no checkpoint to continue from"
        epochs_done = torch.load(found[0], weights_only=True)["epoch"] + 1
        one_more = ["--trainer.max_epochs", str(epochs_done + 1)]
        requeued = subprocess.run(
            ["bash", str(SBATCH), *STAND_IN, *QUIET, *ENDLESS, "--trainer.accelerator", "cpu", *one_more],
            cwd=tmp_path,
            env=slurm_job(tmp_path / "again", 1),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert requeued.returncode == 0, requeued.stderr[-5000:]
        (run,) = run_dirs(tmp_path)
        assert len(scalars(run)["val/acc"]) >= epochs_done + 1
    except AssertionError as e:
        raise AssertionError(f"{e}\n--- job log ---\n{log.read_text()[-4000:]}") from None
    finally:
        if job.poll() is None:  # the stand-in srun and its task, never left running
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
