"""Sharded training (configs/fsdp.yaml, FSDP2 on 2 gloo ranks through the real CLI): atomic DCP folders, exact
resume after SIGKILL (epoch end and mid-epoch) against an uninterrupted run, resharding to 1 rank, export."""

import pytest
import torch

from lightkeep.export.formats import export
from lightkeep.export.weights import load_net
from lightkeep.judge import best_checkpoint
from lightkeep.run_checkpoints import read_global_step
from lightkeep.sharded.folders import full_state_dict, read_meta
from tests.faults import kill_at
from tests.helpers import PYTHONPATH, QUIET, REPO, cli, newest_checkpoint, run_dirs, scalars

pytestmark = pytest.mark.slow

# 2 epochs of 4 steps on 2 ranks; the best 3 at each epoch end (steps 4, 8), last.ckpt every 3 steps (3, 6: mid-epoch)
# and at the end (8).
FSDP = [*QUIET, "--config", str(REPO / "configs" / "fsdp.yaml"), "--trainer.accelerator", "cpu",
        "--trainer.max_epochs", "2", "--trainer.limit_train_batches", "4", "--trainer.limit_val_batches", "2",
        "--model.warmup", "1", "--trainer.log_every_n_steps", "1",
        "--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
        "--trainer.callbacks.every_n_train_steps=3", "--trainer.callbacks.save_top_k=0",
        "--trainer.callbacks.save_last=true", "--trainer.callbacks.enable_version_counter=false"]  # fmt: skip
TWO = ["--trainer.devices", "2"]
SHARD_FILES = {".metadata", "meta.pt", "__0_0.distcp", "__1_0.distcp"}


def full_weights(path: str, when: str = "end") -> list[str]:
    return ["--trainer.callbacks+=tests.faults.SaveFullWeights", f"--trainer.callbacks.path={path}",
            f"--trainer.callbacks.when={when}"]  # fmt: skip


def mid_epoch(folder) -> bool:
    progress = read_meta(folder)["loops"]["fit_loop"]["epoch_loop.batch_progress"]
    return 0 < progress["current"]["completed"] < 4


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("uninterrupted")
    proc = cli("fit", *FSDP, *TWO, *full_weights(str(cwd / "full.pt")), cwd=cwd)
    (cwd / "stdout.txt").write_text(proc.stdout)
    return cwd


def test_the_start_line_of_a_sharded_run_names_its_padded_evaluation(reference):
    line = next(x for x in (reference / "stdout.txt").read_text().splitlines() if x.startswith("Run "))
    assert (
        "2 x cpu" in line
        and "sharded: each rank evaluates a padded share, so a few validation samples count twice" in line
    ), line


def test_sharded_checkpoints_are_complete_folders_one_shard_per_rank(reference):
    (run,) = run_dirs(reference)
    folders = sorted((run / "checkpoints").iterdir())
    assert [f.name for f in folders if not f.name.endswith(".ckpt")] == []  # no .tmp/.old left behind
    for folder in folders:
        assert {p.name for p in folder.iterdir()} == SHARD_FILES, folder
    assert read_global_step(run / "checkpoints" / "last.ckpt") == 8
    # `--ckpt_path best` reads the score of each folder from its meta.pt; the oracle: the val/acc TensorBoard logged
    # at each folder's step (best-epochNNN-stepS; Lightning logs an epoch's values at the step before: S - 1)
    acc = dict(scalars(run)["val/acc"])
    best = max((f for f in folders if f.name.startswith("best-")), key=lambda f: acc[int(f.stem.split("step")[1]) - 1])
    assert best_checkpoint(run)[0].path == best
    # each rank wrote half of every weight matrix: the shard files are about the same size
    sizes = [(run / "checkpoints" / "last.ckpt" / f"__{r}_0.distcp").stat().st_size for r in (0, 1)]
    assert abs(sizes[0] - sizes[1]) < 0.1 * max(sizes), sizes


@pytest.mark.long  # CI and make test-all; ~65 s: sharded kills and resumes
def test_kill_during_save_and_resumes_at_epoch_end_and_mid_epoch_are_exact(reference, tmp_path):
    proc = cli("fit", *FSDP, *TWO, *kill_at(5), cwd=tmp_path, check=False)
    assert proc.returncode == -9, proc.stderr[-2000:]
    (run,) = run_dirs(tmp_path)
    newest = newest_checkpoint(run)  # what `last` resumes from: epoch 0's end (the best-3 folder), after last.ckpt
    assert read_global_step(newest) == 4 and not mid_epoch(newest)  # of step 3
    last = run / "checkpoints" / "last.ckpt"
    # killed on both ranks after writing the shards of step 8, before the rename: last.ckpt stays step 6
    publish = [
        "--trainer.strategy.class_path",
        "tests.faults.KillBeforePublish",
        "--trainer.strategy.init_args.step",
        "8",
    ]
    proc = cli("fit", *FSDP, *TWO, *publish, "--ckpt_path", "last", cwd=tmp_path, check=False)
    assert proc.returncode == -9, proc.stderr[-2000:]
    assert read_global_step(last) == 6 and mid_epoch(last), "the resume below must start mid-epoch"
    (unpublished,) = (run / "checkpoints").glob("*.tmp")  # the cut-short save, which `last` must not pick
    (unpublished / ".metadata").unlink()
    proc = cli("fit", *FSDP, *TWO, "--ckpt_path", str(unpublished), cwd=tmp_path, check=False)
    assert proc.returncode == 2 and "not a complete sharded checkpoint" in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    proc = cli("fit", *FSDP, *TWO, "--ckpt_path", "last", cwd=tmp_path)
    assert "resuming from" in proc.stdout + proc.stderr and "global step 6" in proc.stdout + proc.stderr

    (ref_run,) = run_dirs(reference)
    ref_last = ref_run / "checkpoints" / "last.ckpt"
    assert read_global_step(last) == read_global_step(ref_last) == 8
    for part in ("state_dict.", "optimizer_0."):  # weights, then AdamW's moments and step counts
        ref, got = full_state_dict(ref_last, part), full_state_dict(last, part)
        assert ref.keys() == got.keys()
        diffs = {k: (got[k].double() - v.double()).abs().max().item() for k, v in ref.items()}
        assert all(torch.equal(got[k], v) for k, v in ref.items()), f"{part} max |d|: {diffs}"
    ref_logged, logged = scalars(ref_run), scalars(run)
    for tag in ("train/loss", "lr", "val/acc", "val/loss"):
        assert logged[tag] == ref_logged[tag], tag


@pytest.mark.long  # CI and make test-all; resharding
def test_resume_on_one_rank_reshards_exactly_and_says_what_is_not(reference, tmp_path):
    (ref_run,) = run_dirs(reference)
    ref_last = ref_run / "checkpoints" / "last.ckpt"
    restored = tmp_path / "restored.pt"
    one_rank = [*FSDP, "--trainer.devices", "1", "--trainer.max_epochs", "3", "--ckpt_path", str(ref_last)]
    warnings_shown = {"PYTHONWARNINGS": ""}  # the console's own filters only
    proc = cli("fit", *one_rank, *full_weights(str(restored), when="start"), cwd=tmp_path, env=warnings_shown)
    out = proc.stdout + proc.stderr
    assert "Resharded last.ckpt from 2 ranks to 1: weights and optimizer state are exact" in out, out[-2000:]
    assert "RNG states of 2 ranks" not in out and out.count("Resharded") == 1, out[-2000:]  # said once
    oracle = torch.load(reference / "full.pt", weights_only=True)  # FSDP's own all-gather at the end of the 2-rank run
    got = torch.load(restored, weights_only=True)
    assert oracle.keys() == got.keys() and all(torch.equal(got[k], v) for k, v in oracle.items())
    (run,) = run_dirs(tmp_path)
    # and it trained on, keeping the global batch (elastic resume): 1 rank accumulates 2 micro-batches a step, so the
    # epoch's 4 batches (limit_train_batches) are 2 optimizer steps
    assert read_global_step(run / "checkpoints" / "last.ckpt") == 10

    # another network: one line naming the weight, nothing loaded
    proc = cli("fit", *one_rank, "--model.net.init_args.hidden_sizes", "[32, 32]", cwd=tmp_path, check=False)
    assert proc.returncode == 2 and "holds a different network" in proc.stderr, proc.stderr[-2000:]
    assert "net.layers.1.weight is [256, 64] in the checkpoint, [32, 64] here" in proc.stderr
    assert "Traceback" not in proc.stderr and run_dirs(tmp_path) == [run]  # refused before a folder was made


def test_export_consolidates_a_sharded_checkpoint(reference, tmp_path):
    (ref_run,) = run_dirs(reference)
    paths = export(ref_run / "checkpoints" / "last.ckpt", tmp_path, ("safetensors", "pth"))
    oracle = torch.load(reference / "full.pt", weights_only=True)
    net = load_net(paths[0]).eval()
    pth = torch.load(paths[1], weights_only=True)
    # export writes the LightningModule itself (its class_path, its state_dict), as the oracle's keys are named
    assert pth.keys() == oracle.keys()
    seed = 1234
    x = torch.rand(5, 1, 8, 8, generator=torch.Generator().manual_seed(seed))
    reference_net = load_net(paths[0]).eval()
    reference_net.load_state_dict(oracle)
    with torch.no_grad():
        assert torch.equal(net(x), reference_net(x)), f"seed {seed}"
    assert all(torch.equal(pth[k], v) for k, v in oracle.items())


def test_a_real_sharded_checkpoint_carrying_code_or_missing_a_shard_is_refused_and_last_passes_over_it(
    reference, tmp_path
):
    """The payload of tests/test_unpicklers.py in front of a real run's index (the resume would otherwise finish
    with exit 0, saying nothing), and a folder that lost a shard after its save: validate, export and
    ``fit --ckpt_path last`` on the real CLI, the earlier files unchanged."""
    import hashlib
    import shutil
    import subprocess
    import sys

    from tests.test_unpicklers import in_front_of, payload

    shutil.copytree(reference / "runs", tmp_path / "runs")
    (run,) = run_dirs(tmp_path)
    checkpoints = run / "checkpoints"
    marker, evil = tmp_path / "payload-ran", checkpoints / "last.ckpt"
    index = evil / ".metadata"
    index.write_bytes(in_front_of(payload("torch.distributed.checkpoint.filesystem", "os.system", f"touch {marker}"),
                                  index.read_bytes()))  # fmt: skip
    best = sorted(checkpoints.glob("best-*"), key=lambda p: p.stat().st_mtime)  # the newest two complete folders
    lost = best[-1] / "__1_0.distcp"
    lost.unlink()  # the newest folder after last.ckpt, now incomplete: `last` must take the one before it
    before = {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(run.rglob("*")) if p.is_file()}
    one_rank = [*FSDP, "--trainer.devices", "1"]

    proc = cli("validate", *one_rank, "--ckpt_path", str(evil), cwd=tmp_path, check=False)
    assert proc.returncode == 2 and "could run code" in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    export = subprocess.run([sys.executable, str(REPO / "scripts" / "export.py"), str(evil), "--format", "pth",
                             "--out", str(tmp_path / "out")], env={"PYTHONPATH": PYTHONPATH}, capture_output=True,
                            text=True)  # fmt: skip
    assert export.returncode != 0 and "could run code" in export.stderr and "Traceback" not in export.stderr
    proc = cli("fit", *one_rank, "--ckpt_path", str(best[-1]), cwd=tmp_path, check=False)
    assert proc.returncode == 2 and "__1_0.distcp is missing" in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    others = [p for p in checkpoints.iterdir() if p not in (evil, best[-1])]
    newest_whole = max(others, key=lambda p: p.stat().st_mtime).relative_to(tmp_path)
    proc = cli("fit", *one_rank, "--trainer.max_epochs", "3", "--ckpt_path", "last", cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert "could run code" in out and "__1_0.distcp is missing" in out, out[-3000:]  # each skip said
    assert f"resuming from {newest_whole} " in out, out[-3000:]
    assert not marker.exists() and not (tmp_path / "out").exists()
    # the resume wrote new files beside them, never over one, but for the run's own last.ckpt, which it refreshes
    kept = {p: h for p, h in before.items() if evil not in p.parents}
    assert {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in kept if p.is_file()} == kept
