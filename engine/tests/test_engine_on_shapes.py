"""The engine's guarantees on user modules of four shapes (tests/fixtures/kinds.py), not on the example: tuple-batch
classification with a torchmetrics Metric, dict-batch regression logging Python floats, manual optimization with two
optimizers, and BatchNorm buffers. Each through the real CLI (``--model tests.fixtures.kinds.X``), nothing of the
template's example imported."""

import os
from pathlib import Path

import pytest
import torch

from tests import faults
from tests.helpers import DDP2, PYTHONPATH, QUIET, cli, cli_in_process, max_abs_diff

# shape: (module class, dict batches, monitored key, mode, optimizer steps per batch)
SHAPES = {
    "classify": ("Classify", False, "val/acc", "max", 1),
    "dict_floats": ("DictRegress", True, "val_mse", "min", 1),
    "two_optimizers": ("TwoOptimizers", False, "val/d_loss", "min", 2),
    "batchnorm": ("Normed", False, "val/mse", "min", 1),
}
BATCHES = 6  # per epoch on one process: 48 training samples, batches of 8
N_VAL = 23  # validation samples: indices 0..22, whose sum is 253


def own(shape: str) -> list[str]:
    """The shape's model and data, and ``run.monitor`` set to what it logs."""
    model, as_dict, monitor, mode, _ = SHAPES[shape]
    return [*QUIET, "--model", f"tests.fixtures.kinds.{model}", "--data", "tests.fixtures.kinds.KindData",
            "--data.as_dict", str(as_dict).lower(), "--run.monitor", monitor, "--run.mode", mode]  # fmt: skip


def resumable(tmp_path: Path, shape: str, every_batches: int) -> list[str]:
    """The shape with one ModelCheckpoint that writes last.ckpt every ``every_batches`` batches, and no other."""
    steps = every_batches * SHAPES[shape][4]
    path = tmp_path / "last_only.yaml"
    path.write_text(
        "trainer:\n  callbacks:\n    - class_path: lightning.pytorch.callbacks.ModelCheckpoint\n      init_args:\n"
        f"        save_top_k: 0\n        save_last: true\n        every_n_train_steps: {steps}\n"
    )
    return [*own(shape), "--config", str(path), "--run.monitor", "null"]


def last(runs: Path) -> dict:
    (run,) = (runs / "kind").glob("version_*")
    return torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)


def position(runs: Path) -> tuple[int, int, int]:
    """(epoch, batches of it done, global step) of the run's last.ckpt; done counts a batch after its save."""
    saved = last(runs)
    done = saved["loops"]["fit_loop"]["epoch_loop.batch_progress"]["current"]["completed"]
    return saved["epoch"], done, saved["global_step"]


class LoggedCurvesDiffer(AssertionError):
    """A resumed run's logged curves are not the uninterrupted run's: a step lost, or logged twice."""


def final_difference(reference: Path, resumed: Path) -> float:
    """The largest difference between two runs' final weights, buffers and optimizer states."""
    ref, got = last(reference), last(resumed)
    assert got["global_step"] == ref["global_step"] and got["epoch"] == ref["epoch"]
    assert len(ref["optimizer_states"]) == len(got["optimizer_states"])
    return max(max_abs_diff(ref["state_dict"], got["state_dict"]),
               max_abs_diff(ref["optimizer_states"], got["optimizer_states"]))  # fmt: skip


def same_curves(reference: Path, resumed: Path) -> None:
    """The runs' TensorBoard curves are equal: each step once, with the uninterrupted run's values (under DDP that
    takes every rank's BatchNorm buffers as they would have been, through the validation metrics)."""
    from tests.helpers import scalars

    (ref_run,), (got_run,) = (runs.glob("kind/version_*") for runs in (reference, resumed))
    ref_curves, got_curves = scalars(ref_run), scalars(got_run)
    if got_curves != ref_curves:
        differ = sorted(t for t in ref_curves.keys() | got_curves.keys() if ref_curves.get(t) != got_curves.get(t))
        raise LoggedCurvesDiffer(
            f"{differ}: steps {[s for s, _ in ref_curves.get(differ[0], [])]} uninterrupted, "
            f"{[s for s, _ in got_curves.get(differ[0], [])]} resumed"
        )


def continued(out: str, step: int) -> bool:
    """Whether the start line in ``out`` says the run continues from ``step`` (not a fresh start, which would end
    equal to the uninterrupted run too)."""
    return any(line.startswith("Run ") and f"(continues from step {step} of " in line for line in out.splitlines())


@pytest.mark.parametrize("shape", SHAPES)
def test_a_crashed_fit_resumes_from_mid_epoch_and_from_an_epoch_end_bitwise_equal(shape, tmp_path, capsys):
    """One process: crashed where last.ckpt is mid-epoch, resumed; crashed again where it is at an epoch's end,
    resumed to the end. The oracle: the uninterrupted run."""
    per_batch = SHAPES[shape][4]
    args = [*resumable(tmp_path, shape, 3), "--trainer.max_epochs", "2"]  # last.ckpt after batches 3, 6, 9, 12
    reference, resumed = tmp_path / "reference", tmp_path / "resumed"
    cli_in_process("fit", *args, root=reference)

    def crash_at(batch: int, *more: str) -> None:
        crash = ["--trainer.callbacks+=tests.faults.CrashAt", f"--trainer.callbacks.step={batch * per_batch}"]
        with pytest.raises(RuntimeError, match="injected crash"):
            cli_in_process("fit", *args, *crash, *more, root=resumed)

    crash_at(5)
    assert position(resumed) == (0, 2, 3 * per_batch)  # mid-epoch: saved after 3 of epoch 0's 6 batches
    crash_at(8, "--ckpt_path", "last")
    assert continued(capsys.readouterr().out, 3 * per_batch)
    assert position(resumed) == (0, BATCHES - 1, BATCHES * per_batch)  # saved after epoch 0's last batch
    fit = cli_in_process("fit", *args, "--ckpt_path", "last", root=resumed)
    assert continued(capsys.readouterr().out, BATCHES * per_batch) and fit.trainer.ckpt_path.endswith("last.ckpt")
    diff = final_difference(reference, resumed)
    print(f"{shape}: max |delta| of weights, buffers and optimizer states: {diff}")
    assert diff == 0
    same_curves(reference, resumed)


def ddp(shape: str, ranks: int = 2) -> list[str]:
    """CPU DDP on ``ranks`` ranks; the GAN's two backward passes each leave the other net unused, which DDP must be
    told (Lightning's docs for GANs: ``ddp_find_unused_parameters_true``)."""
    strategy = "ddp_find_unused_parameters_true" if shape == "two_optimizers" else "ddp"
    return [*DDP2[:2], "--trainer.devices", str(ranks), "--trainer.strategy", strategy]


def in_folder(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.mark.slow
@pytest.mark.long  # ~40 s a shape; make test kills and resumes 2 ranks in tests/test_resume.py
# batchnorm: DDP broadcasts rank 0's buffers, the ones its checkpoint holds
@pytest.mark.parametrize("shape", ["classify", "dict_floats", "two_optimizers", "batchnorm"])
def test_a_killed_two_rank_ddp_fit_resumes_from_mid_epoch_and_from_an_epoch_end_bitwise_equal(shape, tmp_path):
    """Two DDP ranks, every rank kill -9'd where last.ckpt is mid-epoch, resumed; killed again where it is at an
    epoch's end, resumed to the end. The oracle: the uninterrupted 2-rank run."""
    per_batch = SHAPES[shape][4]
    args = [*resumable(tmp_path, shape, 1), *ddp(shape), "--trainer.max_epochs", "3"]  # 3 batches an epoch per rank
    reference, resumed = in_folder(tmp_path / "reference"), in_folder(tmp_path / "resumed")
    cli("fit", *args, cwd=reference)

    def kill_at(batch: int, *more: str) -> str:
        proc = cli("fit", *args, *faults.kill_at(batch * per_batch, settle=True), *more, cwd=resumed, check=False)
        assert proc.returncode != 0, proc.stderr[-2000:]
        return proc.stdout

    kill_at(2)  # as batch 2 is about to run, with the last.ckpt saved after batches 0 and 1 on disk (settle)
    assert position(resumed / "runs") == (0, 1, 2 * per_batch)  # mid-epoch: saved after 2 of epoch 0's 3 batches
    assert continued(kill_at(6, "--ckpt_path", "last"), 2 * per_batch)
    # at epoch 1's end: last.ckpt of step 6 and the engine's epoch-end files of that step are one file, holding the
    # state after the epoch ended (engine 1.5.0; before, last.ckpt held the state after its last batch: done 2)
    assert position(resumed / "runs") == (1, 3, 6 * per_batch)
    assert continued(cli("fit", *args, "--ckpt_path", "last", cwd=resumed).stdout, 6 * per_batch)
    diff = final_difference(reference / "runs", resumed / "runs")
    print(f"{shape}, 2 ranks: max |delta| of weights, buffers and optimizer states: {diff}")
    assert diff == 0
    same_curves(reference / "runs", resumed / "runs")


@pytest.mark.slow
@pytest.mark.long  # CI and make test-all: a killed 2-rank fit and its resume on 1 rank (~35 s)
def test_a_batchnorm_run_resumed_on_another_number_of_ranks_names_its_statistics_in_the_start_line(tmp_path):
    """BatchNorm normalises each micro-batch over the samples of one rank: on 1 rank accumulating 2 micro-batches of 8
    where 2 ranks ran 16 at once, its statistics differ, and the start line says so rather than claim the run
    continues exactly."""
    args = [*resumable(tmp_path, "batchnorm", 1), "--trainer.max_epochs", "2"]
    proc = cli("fit", *args, *ddp("batchnorm"), *faults.kill_at(2, settle=True), cwd=tmp_path, check=False)
    assert proc.returncode != 0 and position(tmp_path / "runs") == (0, 1, 2), proc.stderr[-2000:]
    out = cli("fit", *args, *DDP2[:2], "--trainer.devices", "1", "--ckpt_path", "last", cwd=tmp_path).stdout
    line = next(x for x in out.splitlines() if x.startswith("Run "))
    assert "elastic: 2 -> 1 rank(s): accumulate_grad_batches 1 -> 2 keeps the global batch of 16 samples" in line, line
    assert (
        "BatchNorm: its statistics now come from micro-batches of 8 samples over all ranks (16 before), so the run "
        "continues close to, not equal to, the original"
    ) in line, line


def fixture_module(shape: str, ckpt: Path) -> torch.nn.Module:
    """The oracle's model: the fixture class (default arguments, as the runs use) with the checkpoint's weights."""
    from tests.fixtures import kinds

    module = getattr(kinds, SHAPES[shape][0])()
    module.load_state_dict(torch.load(ckpt, weights_only=True)["state_dict"])
    return module.eval()


def validation_inputs() -> torch.Tensor:
    """The validation features, (N_VAL, 4), as KindData makes them."""
    from tests.fixtures.kinds import KindData

    data = KindData()
    data.setup("validate")
    return data.val.x


@pytest.fixture(scope="module")
def fitted(request, tmp_path_factory) -> tuple[str, Path]:
    """A finished 4-epoch fit of the shape, its best-k by run.monitor, tested after fit: (shape, runs root)."""
    shape = request.param
    root = tmp_path_factory.mktemp(shape)
    cli_in_process("fit", *own(shape), "--trainer.max_epochs", "4", "--run.test_after_fit", "true", root=root)
    return shape, root


@pytest.mark.parametrize("fitted", list(SHAPES), indirect=True)
def test_best_and_last_pick_the_run_monitors_best_and_the_final_file_and_test_after_fit_tests_the_best(fitted):
    from tests.helpers import scalars

    shape, root = fitted
    _, _, monitor, mode, _ = SHAPES[shape]
    run = root / "kind" / "version_0"
    curve = [value for _, value in scalars(run)[monitor]]
    best_value = max(curve) if mode == "max" else min(curve)
    files = sorted(p.name for p in (run / "checkpoints").glob("best-*.ckpt"))
    assert len(curve) == 4 and len(files) == 3, (curve, files)  # save_top_k 3 dropped one of 4: a real choice
    ranked = sorted(range(4), key=lambda epoch: curve[epoch], reverse=mode == "max")
    assert sorted(int(name[10:13]) for name in files) == sorted(ranked[:3]), (curve, files)  # best-epochNNN-...
    best = cli_in_process("validate", *own(shape), "--ckpt_path", "best", root=root)
    chosen = Path(best.config["validate"]["ckpt_path"])
    assert chosen.parent == run / "checkpoints" and chosen.name in files
    got = best.trainer.callback_metrics[monitor].item()
    print(f"{shape}: {monitor} curve {curve}; best picked {chosen.name}: {got}")
    assert got == pytest.approx(best_value, abs=1e-6), (curve, chosen)

    latest = cli_in_process("validate", *own(shape), "--ckpt_path", "last", root=root)
    assert latest.config["validate"]["ckpt_path"] == str(run / "checkpoints" / "last.ckpt")
    assert latest.trainer.callback_metrics[monitor].item() == pytest.approx(curve[-1], abs=1e-6)

    test_key = monitor.replace("val", "test")
    after = scalars(run)[test_key]
    alone = cli_in_process("test", *own(shape), "--ckpt_path", str(chosen), root=root)
    print(f"{shape}: {test_key} after fit {after}, of {chosen.name} alone {alone.trainer.callback_metrics[test_key]}")
    assert len(after) == 1 and after[0][1] == pytest.approx(alone.trainer.callback_metrics[test_key].item(), abs=1e-6)


def predictions(shape: str, ckpt: Path, root: Path, ranks: int = 1) -> dict[str, torch.Tensor]:
    """``predict`` of the checkpoint on ``ranks`` CPU ranks: what predictions.pt holds, checked against its csv."""
    import csv

    before = set(root.glob("kind/version_*"))
    if ranks == 1:
        cli_in_process("predict", *own(shape), "--ckpt_path", str(ckpt), root=root)
    else:
        cli("predict", *own(shape), *ddp(shape, ranks), "--ckpt_path", str(ckpt), "--run.root", str(root), cwd=root)
    (run,) = set(root.glob("kind/version_*")) - before
    saved = torch.load(run / "predictions.pt", weights_only=True)
    with open(run / "predictions.csv", newline="") as f:
        header, *rows = list(csv.reader(f))
    assert header[0] == "index" and [int(r[0]) for r in rows] == saved["index"].tolist() == list(range(N_VAL))
    assert not list(run.glob("*.rank*.pt"))
    return saved


def expected_predictions(shape: str, ckpt: Path) -> dict[str, torch.Tensor]:
    """The oracle: the fixture module with the checkpoint's weights, on all validation samples in one batch."""
    module, x = fixture_module(shape, ckpt), validation_inputs()
    with torch.no_grad():
        if shape == "classify":
            logits = module(x)
            return {"pred": logits.argmax(-1), "prob": logits.softmax(-1)}
        return {"output": module(x)}


@pytest.mark.parametrize("fitted", list(SHAPES), indirect=True)
def test_predict_writes_one_row_per_sample_in_dataset_order_as_the_module_computes_them(fitted):
    shape, root = fitted
    ckpt = root / "kind" / "version_0" / "checkpoints" / "last.ckpt"
    saved, expected = predictions(shape, ckpt, root), expected_predictions(shape, ckpt)
    assert sorted(saved) == sorted(["index", *expected])
    delta = max((saved[k].double() - expected[k].double()).abs().max().item() for k in expected)
    print(f"{shape}: 1 process, {N_VAL} rows, max |delta| vs the module {delta}")
    assert delta <= 1e-6


@pytest.mark.slow
@pytest.mark.long  # CI and make test-all; 2 ranks' predictions merged: tests/test_predictions.py, make test
@pytest.mark.parametrize("fitted", ["classify", "dict_floats"], indirect=True)
def test_ddp_predictions_on_2_ranks_merge_into_the_single_process_file(fitted):
    shape, root = fitted
    ckpt = root / "kind" / "version_0" / "checkpoints" / "last.ckpt"
    one, two = predictions(shape, ckpt, root), predictions(shape, ckpt, root, ranks=2)
    assert sorted(one) == sorted(two)
    delta = max((one[k].double() - two[k].double()).abs().max().item() for k in one)
    print(f"{shape}: 2 ranks, max |delta| vs 1 process {delta}")
    assert delta <= 1e-6


@pytest.mark.slow  # scripts/export.py in a subprocess, onnx tracing; a second shape in CI and make test-all
@pytest.mark.parametrize("fitted", ["classify", pytest.param("dict_floats", marks=pytest.mark.long)], indirect=True)
def test_export_of_a_runs_checkpoint_gives_the_modules_forward(fitted, tmp_path):
    import subprocess
    import sys

    from tests.helpers import REPO, run_onnx

    shape, root = fitted
    ckpt = root / "kind" / "version_0" / "checkpoints" / "last.ckpt"
    command = [
        sys.executable,
        str(REPO / "scripts" / "export.py"),
        str(ckpt),
        "--format",
        "onnx",
        "--out",
        str(tmp_path),
    ]
    proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": PYTHONPATH, "PYTHONWARNINGS": "ignore"})  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    onnx, module = run_onnx(tmp_path / "model.onnx"), fixture_module(shape, ckpt)
    for batch in (1, 5, N_VAL):
        x = validation_inputs()[:batch]
        with torch.no_grad():
            delta = (onnx(x) - module(x)).abs().max().item()
        print(f"{shape}: onnx batch {batch}: max |delta| vs forward {delta}")
        assert delta <= 1e-5, (shape, batch, delta)


def validated(shape: str, cwd: Path, ranks: int) -> dict[str, float]:
    """``validate`` of the shape's seeded initial weights on ``ranks`` CPU ranks: the logged metrics."""
    from tests.helpers import run_dirs, scalars

    cwd.mkdir()
    cli("validate", *own(shape), *ddp(shape, ranks), cwd=cwd)
    (run,) = run_dirs(cwd, "kind")
    return {tag: values[-1][1] for tag, values in scalars(run).items()}


@pytest.mark.slow
@pytest.mark.long
def test_validate_on_1_2_and_3_ranks_sees_each_sample_once_and_equals_one_process(tmp_path):
    shape = "classify"  # 23 samples: no rank count divides them, so a padding sampler would count some twice
    results = {ranks: validated(shape, tmp_path / str(ranks), ranks) for ranks in (1, 2, 3)}
    print({ranks: (r["seen/index_sum"], r["seen/count"], r["val/acc"]) for ranks, r in results.items()})
    for ranks, result in results.items():
        assert result["seen/count"] == N_VAL and result["seen/index_sum"] == N_VAL * (N_VAL - 1) / 2, ranks
        assert result["val/acc"] == pytest.approx(results[1]["val/acc"], abs=1e-6), ranks


@pytest.mark.slow
@pytest.mark.long  # make test runs a sweep in tests/test_sweep.py
def test_a_2_trial_sweep_minimizes_the_modules_own_metric(tmp_path):
    import optuna
    import yaml

    from tests.helpers import scalars

    shape = "dict_floats"
    config = {
        "name": "shapes",
        "root": str(tmp_path / "runs"),
        "trials": 2,
        "seed": 0,
        "fit": [*own(shape), "--trainer.max_epochs", "2"],
        "space": {"model.init_args.lr": {"type": "float", "low": 1e-3, "high": 0.1, "log": True}},
    }
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(config))
    out = cli("sweep", "--config", str(path), cwd=tmp_path, timeout=600).stdout
    study = optuna.load_study(study_name="shapes", storage=f"sqlite:///{tmp_path / 'runs' / 'shapes' / 'study.db'}")
    assert study.direction == optuna.study.StudyDirection.MINIMIZE
    assert [t.state for t in study.trials] == [optuna.trial.TrialState.COMPLETE] * 2, out
    for trial in study.trials:
        (run,) = (tmp_path / "runs" / "shapes").glob(f"trial_{trial.number}/version_*")
        curve = [value for _, value in scalars(run)["val_mse"]]
        assert len(curve) == 2 and trial.value == pytest.approx(min(curve), abs=1e-6), (trial.number, curve)
        lr = yaml.safe_load((run / "config.yaml").read_text())["model"]["init_args"]["lr"]
        assert lr == pytest.approx(trial.params["model.init_args.lr"]), (lr, trial.params)
    print(f"trials: {[(t.params, t.value) for t in study.trials]}")
    assert study.best_trial.value == min(t.value for t in study.trials)
