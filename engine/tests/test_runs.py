"""Run folders: where a run goes, what `--ckpt_path last` picks, and which run a resume continues."""

import json
import os
from pathlib import Path

import pytest
import torch
from jsonargparse import Namespace

from lightkeep.run_checkpoints import ResumeError
from lightkeep.runs import default_name, family_dir, plan_run
from tests.helpers import RUN_NAME, cli


@pytest.mark.parametrize(
    ("class_path", "name"),
    [("tests.fixtures.stand_in.BlobsDataModule", "blobs"), ("x.MNIST1DDataModule", "mnist1d"),
     ("x.ImageNetData", "image_net"), ("x.CIFAR10", "cifar10"), (None, "runs")],
)  # fmt: skip
def test_runs_are_named_after_the_data_module(class_path, name):
    assert default_name(class_path) == name


def test_a_model_that_brings_its_own_data_names_its_runs():
    own = Namespace(run=Namespace(root="runs", name=None), model=Namespace(class_path="x.LightningTransformer"))
    assert family_dir(own) == Path("runs") / "lightning_transformer"
    own.data = Namespace(class_path="x.WikiTextDataModule")  # a data module names them, as above
    assert family_dir(own) == Path("runs") / "wiki_text"


def test_runs_filed_under_runs_by_an_older_engine_stay_one_family(tmp_path):
    own = Namespace(run=Namespace(root=str(tmp_path), name=None), model=Namespace(class_path="x.LightningTransformer"))
    (tmp_path / "runs" / "version_0").mkdir(parents=True)  # engine 1.1.0 put a model without a data module there
    assert family_dir(own) == tmp_path / "runs"
    (tmp_path / "lightning_transformer").mkdir()  # once the new family exists, it is the one
    assert family_dir(own) == tmp_path / "lightning_transformer"


def test_lightnings_default_root_dir_is_where_runs_go_unless_it_is_a_run_folder_read_back_from_its_config():
    def family(root: str = "runs", given: str | None = None) -> Path:
        return family_dir(Namespace(run=Namespace(root=root, name=None), data=Namespace(class_path="p.BlobsData"),
                                    trainer=Namespace(default_root_dir=given)))  # fmt: skip

    assert family() == Path("runs") / "blobs"
    assert family(given="/scratch/exp") == Path("/scratch/exp") / "blobs"  # as Lightning's Trainer would place it
    assert family(given="out/blobs/version_3") == Path("runs") / "blobs"  # a run's config.yaml: the engine wrote it
    assert family(root="/scratch/exp", given="/scratch/exp") == Path("/scratch/exp") / "blobs"
    with pytest.raises(ValueError, match=r"^run.root elsewhere and trainer.default_root_dir /scratch/exp both say"):
        family(root="elsewhere", given="/scratch/exp")


@pytest.mark.slow
def test_a_fit_with_default_root_dir_runs_there_and_its_saved_config_starts_the_next_version_beside_it(tmp_path):
    short = ["--trainer.max_epochs", "1", "--trainer.limit_train_batches", "2", "--trainer.limit_val_batches", "1"]
    proc = cli("fit", *short, "--trainer.default_root_dir", "my_outputs", cwd=tmp_path)
    run = tmp_path / "my_outputs" / RUN_NAME / "version_0"
    assert (run / "checkpoints" / "last.ckpt").is_file() and not (tmp_path / "runs").exists(), proc.stdout[-2000:]
    assert f"Run my_outputs/{RUN_NAME}/version_0 (fresh)" in proc.stdout
    cli("fit", "--config", str(run / "config.yaml"), cwd=tmp_path)  # its default_root_dir: the run folder
    assert (tmp_path / "my_outputs" / RUN_NAME / "version_1" / "checkpoints" / "last.ckpt").is_file()


def config(root, ckpt_path=None):
    return Namespace(run=Namespace(root=str(root), name=None), data=Namespace(class_path="p.BlobsDataModule"),
                     ckpt_path=ckpt_path, trainer=Namespace(logger=None))  # fmt: skip


def save(path, step, mtime):
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"state_dict": {}, "global_step": step}, path)
    os.utime(path, (mtime, mtime))


def test_last_is_the_newest_checkpoint_of_any_run_slurms_included_and_fit_continues_its_run(tmp_path):
    family = tmp_path / RUN_NAME
    save(family / "version_0" / "checkpoints" / "last.ckpt", 10, 1000)
    save(family / "version_1" / "checkpoints" / "last.ckpt", 20, 2000)
    save(family / "version_1" / "hpc_ckpt_1.ckpt", 25, 3000)  # SIGUSR1 under SLURM: written into the run folder
    cfg = config(tmp_path, "last")
    plan = plan_run(cfg, "fit")
    assert cfg.ckpt_path == str(family / "version_1" / "hpc_ckpt_1.ckpt")
    assert (plan.dir, plan.continues, plan.global_step) == (family / "version_1", True, 25)
    # validate/test/predict of it, and fit from a best checkpoint, get a new version: the run is never written into
    assert plan_run(config(tmp_path, "last"), "validate").dir == family / "version_2"
    save(family / "version_1" / "checkpoints" / "best.ckpt", 15, 4000)
    plan = plan_run(config(tmp_path, str(family / "version_1" / "checkpoints" / "best.ckpt")), "fit")
    assert (plan.dir, plan.continues) == (family / "version_3", False)  # version_2 is the validate's: claimed


def test_hpc_is_the_newest_slurm_checkpoint_of_any_run_and_fit_continues_its_run(tmp_path):
    """Lightning's ``ckpt_path="hpc"`` looks in ``default_root_dir``, which is a new run folder here: it always
    failed. It is the newest ``hpc_ckpt_N.ckpt`` of the runs (not a newer ``last.ckpt``), or a one-line error."""
    family = tmp_path / RUN_NAME
    with pytest.raises(ResumeError, match=r"^--ckpt_path hpc: no hpc_ckpt_N.ckpt \(SIGUSR1's under SLURM\) under "):
        plan_run(config(tmp_path, "hpc"), "fit")
    save(family / "version_0" / "hpc_ckpt_2.ckpt", 12, 1000)
    save(family / "version_1" / "checkpoints" / "last.ckpt", 30, 2000)
    cfg = config(tmp_path, "hpc")
    plan = plan_run(cfg, "fit")
    assert cfg.ckpt_path == str(family / "version_0" / "hpc_ckpt_2.ckpt")
    assert (plan.dir, plan.continues, plan.global_step) == (family / "version_0", True, 12)


def test_last_with_no_checkpoint_starts_a_new_version(tmp_path):
    (tmp_path / RUN_NAME / "version_4").mkdir(parents=True)
    cfg = config(tmp_path, "last")
    assert plan_run(cfg, "fit").dir == tmp_path / RUN_NAME / "version_5"
    assert cfg.ckpt_path is None


def slurm_job(monkeypatch, job: str, restarts: int | None) -> None:
    """A one-task SLURM job's environment in this process (``SLURM_RESTART_COUNT`` set once SLURM requeued it)."""
    for name, value in {"SLURM_JOB_ID": job, "SLURM_JOB_NAME": "train", "SLURM_NTASKS": "1", "SLURM_NNODES": "1",
                        "SLURM_NODELIST": "127.0.0.1", "SLURM_PROCID": "0", "SLURM_LOCALID": "0",
                        "SLURM_NODEID": "0"}.items():  # fmt: skip
        monkeypatch.setenv(name, value)
    if restarts is None:
        monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    else:
        monkeypatch.setenv("SLURM_RESTART_COUNT", str(restarts))


def test_a_requeued_slurm_job_without_ckpt_path_continues_its_own_run_as_lightnings_auto_requeue_does(
    tmp_path, monkeypatch, caplog
):
    """Lightning's auto-requeue reruns the job's command as it was, without ``--ckpt_path``: the job's run of that
    command (the newest whose run.json names both) continues from its newest checkpoint; not a newer run of another
    job, nor of another command of the same job (a loop over seeds), nor one whose run.json does not read; and not on
    the job's first start. ``--ckpt_path hpc`` takes the job's own run's ``hpc_ckpt`` too."""
    family = tmp_path / RUN_NAME
    command = ["fit", "--seed_everything", "1"]
    save(family / "version_0" / "checkpoints" / "last.ckpt", 10, 1000)
    save(family / "version_0" / "hpc_ckpt_1.ckpt", 12, 2000)
    (family / "version_0" / "run.json").write_text(json.dumps({"slurm_job_id": "4242", "command": command}))
    for version, record in [(1, {"slurm_job_id": "777", "command": command}),  # another job's
                            (2, {"slurm_job_id": "4242", "command": ["fit", "--seed_everything", "2"]})]:  # fmt: skip
        save(family / f"version_{version}" / "hpc_ckpt_1.ckpt", 30, 3000 + version)
        (family / f"version_{version}" / "run.json").write_text(json.dumps(record))
    save(family / "version_3" / "checkpoints" / "last.ckpt", 40, 4000)
    (family / "version_3" / "run.json").write_text("")  # a node failed as it was written
    slurm_job(monkeypatch, "4242", 1)
    cfg = config(tmp_path)
    plan = plan_run(cfg, "fit", command=command)
    assert cfg.ckpt_path == str(family / "version_0" / "hpc_ckpt_1.ckpt")
    assert (plan.dir, plan.continues, plan.global_step) == (family / "version_0", True, 12)
    assert plan.job == {"slurm_job_id": "4242", "command": command}  # what its run.json records again
    assert f"Skipping {family / 'version_3' / 'run.json'}, which does not read" in caplog.text
    cfg = config(tmp_path, "hpc")
    assert plan_run(cfg, "fit", command=command).dir == family / "version_0"  # not version_2's newer hpc_ckpt
    assert plan_run(config(tmp_path), "validate", command=command).dir == family / "version_4"  # fit only
    for job, restarts, version in [("4242", None, 5), ("5000", 1, 6)]:  # the job's first start; a requeued job with
        slurm_job(monkeypatch, job, restarts)  # no run here yet: each a fresh run
        cfg = config(tmp_path)
        assert plan_run(cfg, "fit", command=command).dir == family / f"version_{version}" and cfg.ckpt_path is None


@pytest.mark.slow
def test_a_slurm_job_lightning_requeues_trains_on_bit_equal_in_the_same_run_with_its_command_unchanged(
    tmp_path, monkeypatch, capsys
):
    """The job crashes at step 16 (a checkpoint every 13 steps) and SLURM requeues it: the same command, without
    ``--ckpt_path``, continues version_0 and ends bit-equal to the uninterrupted run. Before, the requeued job started
    a fresh version_1 from scratch, saying nothing."""
    from tests.helpers import QUIET, cli_in_process, max_abs_diff

    flags = [*QUIET, "--trainer.max_epochs", "3", "--trainer.limit_train_batches", "6", "--trainer.limit_val_batches",
             "1", "--trainer.callbacks+=ModelCheckpoint", "--trainer.callbacks.every_n_train_steps=13",
             "--trainer.callbacks.save_top_k=0", "--trainer.callbacks.save_last=true"]  # fmt: skip
    cli_in_process("fit", *flags, root=tmp_path / "reference")
    job = [*flags, "--trainer.callbacks+=tests.faults.CrashUnlessRequeued", "--trainer.callbacks.step=16"]
    slurm_job(monkeypatch, "4242", None)
    with pytest.raises(RuntimeError, match="injected crash"):
        cli_in_process("fit", *job, root=tmp_path / "job")
    slurm_job(monkeypatch, "4242", 1)
    capsys.readouterr()
    cli_in_process("fit", *job, root=tmp_path / "job")
    out = capsys.readouterr().out
    run = tmp_path / "job" / RUN_NAME / "version_0"
    assert sorted(p.name for p in run.parent.iterdir()) == ["version_0"], out[-3000:]
    assert f"(continues from step 13 of {run}/checkpoints/last.ckpt)" in out, out[-3000:]
    ref = torch.load(tmp_path / "reference" / RUN_NAME / "version_0" / "checkpoints" / "last.ckpt", weights_only=True)
    got = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)
    assert (got["global_step"], ref["global_step"]) == (18, 18)
    assert max_abs_diff(got["state_dict"], ref["state_dict"]) == 0.0


def _set_up_run_folders(rank: int, init: str, cases: list[list[str | None]], said) -> None:
    """One rank of ``test_ranks_that_found_different_checkpoints_stop_in_one_line``: RunFolder's setup for each case
    (what each rank's plan resumes from), and what it raised."""
    from types import SimpleNamespace

    from lightkeep.run_folder import RunFolder
    from lightkeep.runs import RunPlan

    torch.distributed.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    trainer = SimpleNamespace(strategy=SimpleNamespace(broadcast=lambda x: x), world_size=2, checkpoint_callbacks=[],
                              is_global_zero=rank == 0, loggers=[])  # fmt: skip
    try:
        for case, found in enumerate(cases):
            path = None if found[rank] is None else Path(found[rank])
            try:
                RunFolder(RunPlan(Path("runs/blobs/version_0"), path is not None, path)).setup(trainer, None, "fit")
                said.put((case, rank, None))
            except Exception as error:  # what each rank raised is the result
                said.put((case, rank, f"{type(error).__name__}: {error}"))
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_ranks_that_found_different_checkpoints_stop_in_one_line(tmp_path):
    """Each rank resolves ``last`` (or a SLURM requeue's run) from what its file system shows it: a network file system
    that has not caught up on one node made that rank load another checkpoint, or none. Every rank now stops with the
    same one-line error (two real gloo processes)."""
    cases = [["a/last.ckpt", "a/last.ckpt"], ["a/last.ckpt", "b/last.ckpt"], ["a/last.ckpt", None], [None, None]]
    context = torch.multiprocessing.get_context("spawn")
    said = context.Queue()
    torch.multiprocessing.start_processes(_set_up_run_folders, args=(f"file://{tmp_path / 'rendezvous'}", cases, said),
                                          nprocs=2, start_method="spawn")  # fmt: skip
    got = {(case, rank): error for case, rank, error in (said.get(timeout=60) for _ in range(2 * len(cases)))}
    for case, found in enumerate(cases):
        if found[0] == found[1]:
            assert got[case, 0] is None and got[case, 1] is None, got
        else:
            assert got[case, 0] == got[case, 1], got
            assert got[case, 0].startswith("ResumeError: The ranks found different checkpoints to start from ("), got


def test_workers_torchrun_restarted_continue_the_run_their_agent_started_not_an_earlier_torchruns(
    tmp_path, monkeypatch
):
    """torchrun's run id is "none" unless given: the run of a restarted worker is the one whose run.json lists this
    worker's agent (its parent process, which outlives the workers it restarts), not a run an earlier torchrun of the
    same command left (another agent); the first attempt (restart 0) starts fresh."""
    from lightkeep.runs import torchrun_agent

    family = tmp_path / RUN_NAME
    command = ["fit", "--trainer.devices", "2"]
    for version, agent in [(0, torchrun_agent()), (1, "elsewhere:1")]:  # version_1: yesterday's torchrun, newer
        save(family / f"version_{version}" / "checkpoints" / "last.ckpt", 4 + version, 1000 + version)
        record = {"torchrun_run_id": "none", "command": command, "torchrun_agents": [agent, "node1:77"]}
        (family / f"version_{version}" / "run.json").write_text(json.dumps(record))
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    cfg = config(tmp_path)
    plan = plan_run(cfg, "fit", command=command)
    assert (plan.dir, plan.continues, cfg.ckpt_path) == (
        family / "version_0",
        True,
        str(family / "version_0" / "checkpoints" / "last.ckpt"),
    )
    assert plan.job == {"torchrun_run_id": "none", "command": command}
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    assert plan_run(config(tmp_path), "fit", command=command).dir == family / "version_2"
