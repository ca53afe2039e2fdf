"""Runs across machines: two torchrun "nodes" on this machine (``scripts/torchrun.sh`` once per node, each with a
temporary folder of its own, sharing the run folder as machines share a file system) and a SLURM stand-in (the
variables ``srun`` sets, one process per task). A lost node or a hung one ends the run on every other node in one
line naming the rank, the newest checkpoint and the command that resumes the job, without a traceback, and the job
resumed from that checkpoint ends bit-equal to the same fit on 2 ranks of one machine, uninterrupted."""

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import lightning as L
import pytest
import torch

from lightkeep.checkpoint_io import wait_for_writes
from lightkeep.liveness import TICK_S
from tests.helpers import DDP2, PYTHONPATH, QUIET, REPO, RUN_NAME, STAND_IN, cli, free_port, run_dirs

CPU = ["--trainer.accelerator", "cpu", "--trainer.strategy", "ddp"]
# 3 epochs of 4 steps, a checkpoint at each epoch's end (the best by val/acc; every 2 epochs): step 4 is saved when a
# fault acts at step 6
FIT = [*QUIET, "--trainer.max_epochs", "3", "--trainer.limit_train_batches", "4", "--trainer.limit_val_batches", "1"]
ENDLESS = [*QUIET, "--trainer.max_epochs", "100000", "--trainer.limit_train_batches", "4",
           "--trainer.limit_val_batches", "1"]  # fmt: skip
NEWEST = rf"runs/{RUN_NAME}/version_0/checkpoints/\S+\.ckpt"
FAR_STOPPED = (
    "its process stopped running or its machine does not answer: SIGSTOP, a debugger, a call that holds Python's "
    "lock, a lost machine or network"
)


class LoseNodeAt(L.Callback):
    """Global rank ``rank`` SIGKILLs its launcher (``launcher``: torchrun's agent, its whole node) and itself when
    optimizer step ``step`` is about to run, once (``marker``, which it writes first: the time of the loss). Rank 0
    first waits for its background checkpoint writes (``settled``), so that the newest checkpoint is the one the test
    expects whatever the machine's load, and the rank lives on a moment (twice ``liveness.TICK_S``), so that its
    last progress is in the store."""

    def __init__(self, step: int, rank: int, marker: str, settled: str, launcher: bool = True) -> None:
        self.step, self.rank, self.marker, self.settled = step, rank, Path(marker), Path(settled)
        self.launcher = launcher

    def on_train_batch_start(self, trainer: L.Trainer, *_: object) -> None:
        if trainer.global_step != self.step or self.marker.exists():
            return
        if trainer.global_rank == 0:
            wait_for_writes(trainer)
            self.settled.touch()
        elif trainer.global_rank == self.rank:
            while not self.settled.exists():
                time.sleep(0.05)
            time.sleep(2 * TICK_S)
            self.marker.touch()
            if self.launcher:
                os.kill(os.getppid(), signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)


class StopAt(L.Callback):
    """Global rank ``rank`` SIGSTOPs itself when optimizer step ``step`` is about to run, and is never continued: a
    stopped process, as a hung call would leave it. Its pid goes to ``pid_file`` first, and it lives on a moment
    (twice ``liveness.TICK_S``), so that its last progress is in the store."""

    def __init__(self, step: int, rank: int, pid_file: str) -> None:
        self.step, self.rank, self.pid_file = step, rank, Path(pid_file)

    def on_train_batch_start(self, trainer: L.Trainer, *_: object) -> None:
        if trainer.global_step == self.step and trainer.global_rank == self.rank:
            time.sleep(2 * TICK_S)
            self.pid_file.write_text(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGSTOP)


def fault(name: str, **args: object) -> list[str]:
    return [f"--trainer.callbacks+=tests.test_nodes.{name}", *(f"--trainer.callbacks.{k}={v}" for k, v in args.items())]


def node_env(tmp: Path, **more: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC_", "PROJECT_"))}
    tmp.mkdir(parents=True, exist_ok=True)
    return {**env, "PYTHON": sys.executable, "PYTHONPATH": PYTHONPATH, "PYTHONWARNINGS": "ignore",
            "TMPDIR": str(tmp), **more}  # fmt: skip


def start_nodes(cwd: Path, tmp_path: Path, port: int, *args: str, tag: str = "") -> list[subprocess.Popen]:
    """``scripts/torchrun.sh`` for node 0 and node 1 (one rank each) in ``cwd``, each node's output in its log."""
    procs = []
    for node in (0, 1):
        log = (tmp_path / f"node{node}{tag}.log").open("w")
        command = ["bash", str(REPO / "scripts" / "torchrun.sh"), "--nnodes", "2", "--node_rank", str(node), "--rdzv",
                   f"127.0.0.1:{port}", "--nproc_per_node", "1", *STAND_IN, *CPU, *args]  # fmt: skip
        env = node_env(tmp_path / f"tmp{node}{tag}")
        procs.append(subprocess.Popen(command, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT))
    return procs


def descendants(pid: int) -> list[int]:
    """The processes under ``pid`` (torchrun's workers run in sessions of their own)."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        found += (children := parents.get(todo.pop(), []))
        todo += children
    return found


def end_all(procs: list[subprocess.Popen]) -> None:
    """Never leave a node behind a failed test (a stopped worker is killed too)."""
    for proc in procs:
        for pid in [*descendants(proc.pid), proc.pid]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.wait()


def error_lines(log: str) -> list[str]:
    return [line for line in log.splitlines() if line.startswith("error:")]


def final_weights(cwd: Path) -> dict[str, torch.Tensor]:
    (run,) = run_dirs(cwd)
    checkpoint = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)
    assert checkpoint["global_step"] == 12, checkpoint["global_step"]
    return checkpoint["state_dict"]


def torchrun_resume(port: int, node: int, *args: str) -> str:
    """The resume command node ``node``'s line names: torchrun.sh as started, with ``--ckpt_path last``."""
    script = str(REPO / "scripts" / "torchrun.sh")
    return " ".join([script, "--nnodes", "2", "--node_rank", str(node), "--rdzv", f"127.0.0.1:{port}",
                     "--nproc_per_node", "1", *STAND_IN, *CPU, *args, "--ckpt_path", "last",
                     "(on every node, each with its own --node_rank)"])  # fmt: skip


# --- what a line says, and torchrun's exit barrier (no processes) -----------------------------------------------


def test_the_resume_command_is_the_launch_scripts_else_names_the_launcher(monkeypatch):
    from lightkeep.config import entered
    from lightkeep.rank_failures import RESUME_ENV, resume_command

    for key in [k for k in os.environ if k.startswith(("SLURM_", "TORCHELASTIC_", "PROJECT_"))]:
        monkeypatch.delenv(key)
    argv = ["prog", "fit", "--trainer.num_nodes", "2", "--ckpt_path", "best"]
    with entered("project", None):
        assert resume_command(argv) == "python -m project fit --trainer.num_nodes 2 --ckpt_path last"
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")  # what torchrun sets for its workers
        assert resume_command(argv) == "torchrun ... -m project fit --trainer.num_nodes 2 --ckpt_path last"
        monkeypatch.setenv(RESUME_ENV, "scripts/torchrun.sh --nnodes 2 ... --ckpt_path last")  # the script's own
        assert resume_command(argv) == "scripts/torchrun.sh --nnodes 2 ... --ckpt_path last"


def test_a_finished_node_says_why_it_waits_at_torchruns_exit_barrier_and_stops_waiting(monkeypatch, capsys):
    import threading

    from lightkeep import torchrun

    monkeypatch.setattr(torchrun, "NOTE_S", 0.2)
    monkeypatch.setattr(torchrun, "EXIT_WAIT_S", 0.6)
    monkeypatch.setattr(torchrun, "_left", [])
    gone = threading.Event()  # an agent that never arrives
    barrier = threading.Thread(target=gone.wait, daemon=True)
    barrier.start()
    started = time.monotonic()
    torchrun._wait_at_exit_barrier(barrier)
    took = time.monotonic() - started
    gone.set()
    lines = capsys.readouterr().err.splitlines()
    assert 0.6 <= took < 2 and torchrun._left == [barrier]
    assert [line.split(";")[0] for line in lines] == [
        "torchrun: this node's ranks finished",
        "torchrun: not every node's agent reached the exit barrier in 0.6 s (gone?)",
    ]
    arrived = threading.Thread(target=lambda: None)  # every agent there: no word
    arrived.start()
    torchrun._wait_at_exit_barrier(arrived)
    assert capsys.readouterr().err == ""


# --- processes on two "nodes" -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def one_machine(tmp_path_factory) -> dict[str, torch.Tensor]:
    """The final weights of the same fit on 2 ranks of one machine, uninterrupted."""
    reference = tmp_path_factory.mktemp("one-machine")
    cli("fit", *DDP2, *FIT, cwd=reference, timeout=300)
    return final_weights(reference)


def assert_bit_equal(reference: dict[str, torch.Tensor], cwd: Path) -> None:
    got = final_weights(cwd)
    diffs = {k: (got[k] - v).abs().max().item() for k, v in reference.items()}
    assert all(torch.equal(got[k], v) for k, v in reference.items()), f"max |dw|: {diffs}"


@pytest.mark.slow
@pytest.mark.long  # two 2-node jobs and a 2-rank reference: ~60 s
def test_a_lost_node_ends_the_other_in_one_line_and_the_job_resumes_bit_equal(one_machine, tmp_path: Path) -> None:
    cwd, port = tmp_path / "job", free_port()
    cwd.mkdir()
    marker, settled = tmp_path / "lost", tmp_path / "settled"
    args = [*FIT, *fault("LoseNodeAt", step=6, rank=1, marker=marker, settled=settled)]
    procs = start_nodes(cwd, tmp_path, port, *args)
    try:
        procs[0].wait(timeout=300)
        ended = time.time()
    finally:
        end_all(procs)
    log = (tmp_path / "node0.log").read_text()
    assert marker.exists(), f"node 1 was never lost:\n{log[-4000:]}"
    took = ended - marker.stat().st_mtime
    assert procs[0].returncode == 1, log[-4000:]
    assert took < 15, f"node 0 ended {took:.0f} s after node 1 was lost"
    (line,) = error_lines(log) or [f"no error line in:\n{log[-4000:]}"]
    pattern = (
        rf"error: rank 1 \(node 1, host \S+\) died while training at global step 6 \(its (?:connection closed|"
        rf"process ended)[^)]*\); the other ranks stopped\. Newest complete checkpoint, intact: ({NEWEST}) \(step 4\)\."
        rf" Resume: (.*)"
    )
    match = re.fullmatch(pattern, line)
    assert match, line
    command = match[2]
    assert command == torchrun_resume(port, 0, *args), command
    assert "Traceback" not in log and "ChildFailedError" not in log, log[-4000:]
    # every process of the job ended: node 0's worker and agent, and node 1's
    assert all(proc.poll() is not None for proc in procs)
    # both nodes started again as the line says (each with its own --node_rank): on from step 4, to the end
    port = free_port()
    again = start_nodes(cwd, tmp_path, port, *args, "--ckpt_path", "last", tag="-resumed")
    try:
        codes = [proc.wait(timeout=300) for proc in again]
    finally:
        end_all(again)
    resumed = (tmp_path / "node0-resumed.log").read_text()
    assert codes == [0, 0], resumed[-4000:] + (tmp_path / "node1-resumed.log").read_text()[-3000:]
    assert f"continues from step 4 of {match[1]}" in resumed, resumed[-4000:]
    assert_bit_equal(one_machine, cwd)


@pytest.mark.slow
@pytest.mark.long  # ~40 s: the hang timeout is 20 s
def test_a_stopped_worker_on_another_node_ends_the_run_in_one_line_after_the_hang_timeout(tmp_path: Path) -> None:
    """Under c10d rendezvous (the store in the first agent, ranks in order of arrival): whichever node holds rank 1,
    the other one reports its stopped worker."""
    pid_file, port = tmp_path / "rank1.pid", free_port()
    args = [*STAND_IN, *CPU, *ENDLESS, "--run.hang_timeout", "20", *fault("StopAt", step=6, rank=1, pid_file=pid_file),
            "--trainer.num_nodes", "2"]  # fmt: skip
    procs = []
    for node in (0, 1):
        torchrun = ["-m", "lightkeep.torchrun", "--nnodes", "2", "--nproc_per_node", "1", "--rdzv_backend", "c10d",
                    "--rdzv_endpoint", f"127.0.0.1:{port}", "-m", "project", "fit", *args]  # fmt: skip
        log = (tmp_path / f"node{node}.log").open("w")
        env = node_env(tmp_path / f"tmp{node}")
        procs.append(subprocess.Popen([sys.executable, *torchrun], cwd=tmp_path, env=env, stdout=log,
                                      stderr=subprocess.STDOUT))  # fmt: skip
    try:
        deadline = time.monotonic() + 240
        while not any(proc.poll() is not None for proc in procs) and time.monotonic() < deadline:
            time.sleep(0.5)
        ended = time.time()
        logs = [(tmp_path / f"node{node}.log").read_text() for node in (0, 1)]
        assert pid_file.is_file(), f"rank 1 never stopped:\n{logs[0][-3000:]}\n{logs[1][-3000:]}"
        stopped = int(pid_file.read_text())
        survivor = next(i for i, proc in enumerate(procs) if stopped not in descendants(proc.pid))
        took = ended - pid_file.stat().st_mtime
        log = logs[survivor]
        assert procs[survivor].poll() == 1, log[-4000:]
        assert 20 <= took < 60, f"the run ended {took:.0f} s after rank 1 stopped"
        (line,) = error_lines(log) or [f"no error line in:\n{log[-4000:]}"]
        pattern = (
            rf"error: rank 1 \(node 1, host \S+\) made no progress for 2\d s while training at global step 6 "
            rf"\({re.escape(FAR_STOPPED)}; run\.hang_timeout 20 s\); the other ranks stopped\. Newest complete "
            rf"checkpoint, intact: {NEWEST} \(step 4\)\. Resume: torchrun \.\.\. -m project fit .* --ckpt_path last"
        )
        assert re.fullmatch(pattern, line), line
        assert "Traceback" not in log, log[-4000:]
        assert not descendants(procs[survivor].pid), "a process of the reporting node was left behind"
    finally:
        end_all(procs)


# A stand-in for srun on one machine: SLURM_NTASKS copies of the command, each with the variables srun sets for its
# task, spread over SLURM_NNODES "nodes", each node with a temporary folder of its own; each task's output in a file.
FAKE_SRUN = """#!/bin/bash
per_node=$((SLURM_NTASKS / SLURM_NNODES))
pids=()
for ((i = 0; i < SLURM_NTASKS; i++)); do
    node=$((i / per_node))
    mkdir -p "$NODES/tmp$node"
    SLURM_PROCID=$i SLURM_LOCALID=$((i % per_node)) SLURM_NODEID=$node TMPDIR=$NODES/tmp$node "$@" \\
        >"$NODES/task$i.log" 2>&1 &
    pids+=($!)
done
rc=0
for pid in "${pids[@]}"; do wait "$pid" || rc=$?; done
exit $rc
"""


def slurm_job(tmp_path: Path, nodes: Path, restarts: int = 0) -> dict[str, str]:
    """A job of 2 nodes x 1 task, its ``srun`` the stand-in above."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "srun").write_text(FAKE_SRUN)
    (bin_dir / "srun").chmod(0o755)
    nodes.mkdir(parents=True)
    job = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "project", "SLURM_NNODES": "2", "SLURM_NTASKS": "2",
           "SLURM_NTASKS_PER_NODE": "1", "SLURM_NODELIST": "127.0.0.1"}  # fmt: skip
    job["SLURM_RESTART_COUNT"] = str(restarts)
    path = f"{bin_dir}:{os.environ['PATH']}"
    return node_env(tmp_path / "tmp", **job, PATH=path, NODES=str(nodes), MASTER_PORT=str(free_port()))


@pytest.mark.slow
@pytest.mark.long  # ~40 s
def test_a_lost_slurm_node_ends_the_other_in_one_line_and_the_requeue_resumes_bit_equal(one_machine, tmp_path):
    marker, settled = tmp_path / "lost", tmp_path / "settled"
    args = [*STAND_IN, *CPU, *FIT, *fault("LoseNodeAt", step=6, rank=1, marker=marker, settled=settled, launcher=False)]
    sbatch = ["bash", str(REPO / "scripts" / "slurm.sbatch"), *args]
    job = subprocess.run(sbatch, cwd=tmp_path, env=slurm_job(tmp_path, tmp_path / "job"), capture_output=True,
                         text=True, timeout=300)  # fmt: skip
    ended = time.time()
    log = (tmp_path / "job" / "task0.log").read_text()
    assert marker.exists(), f"task 1 was never lost:\n{log[-4000:]}"
    assert job.returncode != 0 and ended - marker.stat().st_mtime < 15, log[-4000:]
    (line,) = error_lines(log) or [f"no error line in:\n{log[-4000:]}"]
    resume = f"sbatch --nodes 2 --ntasks-per-node 1 scripts/slurm.sbatch {' '.join(args)}"
    pattern = (
        rf"error: rank 1 \(node 1, host \S+\) died while training at global step 6 \(its process ended[^)]*\); the "
        rf"other ranks stopped\. Newest complete checkpoint, intact: ({NEWEST}) \(step 4\)\. Resume: "
        + re.escape(resume)
    )
    match = re.fullmatch(pattern, line)
    assert match, line
    assert "Traceback" not in log, log[-4000:]
    # SLURM requeues the job (the same command, SLURM_RESTART_COUNT 1): it continues the run from that checkpoint
    requeued = subprocess.run(sbatch, cwd=tmp_path, env=slurm_job(tmp_path, tmp_path / "requeued", restarts=1),
                              capture_output=True, text=True, timeout=300)  # fmt: skip
    log = (tmp_path / "requeued" / "task0.log").read_text()
    assert requeued.returncode == 0, log[-4000:] + (tmp_path / "requeued" / "task1.log").read_text()[-3000:]
    assert f"continues from step 4 of {match[1]}" in log, log[-4000:]
    assert_bit_equal(one_machine, tmp_path)


@pytest.mark.slow
@pytest.mark.long  # ~60 s
def test_torchrun_restarts_a_job_whose_node_was_lost_once_the_node_is_back_and_it_ends_bit_equal(one_machine,
                                                                                                 tmp_path):  # fmt: skip
    """``scripts/train_resilient.sh --torchrun`` on both nodes (c10d rendezvous, ``--max-restarts 1``): node 1 lost,
    node 0 says so in one line and its torchrun restarts its rank, which waits for node 1; node 1 started again (as a
    cluster's scheduler would), the job goes on from the newest checkpoint by itself."""
    marker, settled, port = tmp_path / "lost", tmp_path / "settled", free_port()
    args = [*STAND_IN, *CPU, *FIT, *fault("LoseNodeAt", step=6, rank=1, marker=marker, settled=settled)]
    resilient = ["bash", str(REPO / "scripts" / "train_resilient.sh"), "--max-restarts", "1", "--torchrun",
                 "--nproc_per_node", "1", "--nnodes", "2", "--rdzv", f"127.0.0.1:{port}", *args]  # fmt: skip
    cwd = tmp_path / "job"
    cwd.mkdir()

    def node(number: int, tag: str = "") -> subprocess.Popen:
        log = (tmp_path / f"node{number}{tag}.log").open("w")
        env = node_env(tmp_path / f"tmp{number}{tag}")
        return subprocess.Popen(resilient, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT)

    procs = [node(0)]
    time.sleep(1)  # node 0's agent first: it holds the rendezvous store
    procs.append(node(1))
    try:
        deadline = time.monotonic() + 240
        while not (procs[1].poll() is not None and "error:" in (tmp_path / "node0.log").read_text()):
            assert time.monotonic() < deadline, (tmp_path / "node0.log").read_text()[-4000:]
            time.sleep(0.5)
        assert procs[0].poll() is None, "node 0's torchrun did not wait to restart"
        procs.append(node(1, "-back"))
        codes = [procs[0].wait(timeout=300), procs[2].wait(timeout=300)]
    finally:
        end_all(procs)
    log = (tmp_path / "node0.log").read_text()
    assert codes == [0, 0], log[-4000:] + (tmp_path / "node1-back.log").read_text()[-3000:]
    (line,) = error_lines(log)
    pattern = (
        rf"error: rank 1 \(node 1, host \S+\) died while training at global step 6 \([^)]*\); the other ranks "
        rf"stopped\. Newest complete checkpoint, intact: ({NEWEST}) \(step 4\)\. Resume: torchrun restarts it "
        rf"\(restart 1 of 1\) once every node is back; else torchrun \.\.\. -m project fit .* --ckpt_path last"
    )
    match = re.fullmatch(pattern, line)
    assert match, line
    assert f"--ckpt_path last: resuming from {match[1]} (global step 4)" in log, log[-4000:]
    assert "Traceback" not in log, log[-4000:]
    assert_bit_equal(one_machine, cwd)
