"""Run folders: where a run goes, what `--ckpt_path last` picks, and which run a resume continues."""

import os
from pathlib import Path

import pytest
import torch
from jsonargparse import Namespace

from steadfast.runs import default_name, family_dir, plan_run
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


def test_last_with_no_checkpoint_starts_a_new_version(tmp_path):
    (tmp_path / RUN_NAME / "version_4").mkdir(parents=True)
    cfg = config(tmp_path, "last")
    assert plan_run(cfg, "fit").dir == tmp_path / RUN_NAME / "version_5"
    assert cfg.ckpt_path is None
