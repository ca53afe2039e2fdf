"""Values a ``validation_step`` logs with ``on_step=True`` reach the loggers once each across a kill and a resume.

Lightning hands those to the loggers at its count of evaluation batches (``val/batch_loss_step`` at 0, 1, 2, ...),
not at the training step, from 0 in every process: a resumed fit continues the checkpoint's count, and the engine's
``StepGate`` must neither take them for steps the interrupted run logged
(dropped) nor hand them to a logger that cannot drop points before the checkpoint after their validation.
"""

import csv
from pathlib import Path
from types import SimpleNamespace

import pytest

from lightkeep.loggers import StepGate
from tests.faults import kill_at
from tests.fixtures.eval_steps import PER_BATCH, PER_VALIDATION
from tests.helpers import QUIET, REPO, RUN_NAME, cli, cli_in_process, run_dirs, scalars

# 3 epochs of 5 steps, 3 validation batches after each: 9 per-batch validation values, 3 per-validation ones.
# A checkpoint of the user's every 3 steps besides the engine's at each validation's end (the best, steps 5 and 10).
EPOCHS, BATCHES, VAL_BATCHES = 3, 5, 3
FIT = [*QUIET, "--model", "tests.fixtures.eval_steps.EvalSteps", "--trainer.max_epochs", str(EPOCHS),
       "--trainer.limit_train_batches", str(BATCHES), "--trainer.limit_val_batches", str(VAL_BATCHES),
       "--trainer.log_every_n_steps", "1", "--trainer.callbacks+=ModelCheckpoint",
       "--trainer.callbacks.every_n_train_steps=3", "--trainer.callbacks.save_top_k=-1"]  # fmt: skip
ARGS = [*FIT, "--trainer.logger+=CSVLogger"]  # TensorBoard (the default) and CSV
STEPS = list(range(EPOCHS * BATCHES))
EPOCH_ENDS = [(e + 1) * BATCHES - 1 for e in range(EPOCHS)]  # 4, 9, 14: a validation's epoch-end values


class Recorder:
    """A logger as ``StepGate`` sees one: what reaches it, in order."""

    def __init__(self) -> None:
        self.got: list[tuple[str, int | None]] = []

    def log_metrics(self, metrics: dict, step: int | None = None) -> None:
        self.got += [(key, step) for key in metrics]

    def save(self) -> None:
        pass


def fake_trainer(step: int = 0, validating: bool = False) -> SimpleNamespace:
    """What ``StepGate`` reads of a trainer: whether it validates, and Lightning's logging step."""
    loop = SimpleNamespace(epoch_loop=SimpleNamespace(_batches_that_stepped=step))
    return SimpleNamespace(validating=validating, sanity_checking=False, fit_loop=loop)


def log_batch(gate: StepGate, trainer: SimpleNamespace, step: int, val_from: int | None = None) -> None:
    """One training batch at logging ``step`` as Lightning logs it; ``val_from``: a validation after it, of 2 batches
    that Lightning logs at ``val_from`` and ``val_from + 1``, then its epoch-end value at ``step``."""
    trainer.fit_loop.epoch_loop._batches_that_stepped, trainer.validating = step, False
    gate.gate({f"train{step}": 1.0}, step)
    if val_from is not None:
        trainer.validating = True
        for i in (val_from, val_from + 1):
            gate.gate({f"val_batch{i}": 1.0}, i)
        gate.gate({f"val{step}": 1.0}, step)
        trainer.validating = False


def test_a_held_validation_batch_value_goes_out_with_the_training_step_its_validation_ran_at():
    """``hold`` (MLflow, W&B): a validation at step 6, after a checkpoint saved after step 5, is held with step 6
    although Lightning logs its batch values at 2 and 3; released with step 6's values, in the order they came."""
    logger, trainer = Recorder(), fake_trainer()
    gate = StepGate(logger, resumed_at=0, hold=True, trainer=trainer)
    for step in range(5):
        log_batch(gate, trainer, step, val_from=0 if step == 4 else None)
    gate.release(before=5)  # the checkpoint after step 4's validation
    assert logger.got == [*((f"train{s}", s) for s in range(5)), ("val_batch0", 0), ("val_batch1", 1), ("val4", 4)]
    logger.got.clear()
    log_batch(gate, trainer, 5)
    log_batch(gate, trainer, 6, val_from=2)  # a validation mid-epoch (val_check_interval)
    gate.release(before=6)  # a checkpoint saved after step 5 (resumes at 6): step 6's validation stays held
    assert logger.got == [("train5", 5)]
    log_batch(gate, trainer, 7)
    gate.release(before=7)
    assert logger.got == [("train5", 5), ("train6", 6), ("val_batch2", 2), ("val_batch3", 3), ("val6", 6)]
    gate.release()  # the end of fit
    assert logger.got[-1] == ("train7", 7) and not gate.pending


@pytest.mark.parametrize("hold", [False, True])
def test_a_resumed_run_keeps_its_validation_batch_values_and_drops_the_steps_logged_before(hold):
    """Resumed at step 10: the re-logged epoch-end value of step 9 is dropped; a validation at step 14 that
    Lightning logs at batches 0 and 1 (its count starts afresh in the resumed process) is kept."""
    logger, trainer = Recorder(), fake_trainer(step=9)
    gate = StepGate(logger, resumed_at=10, hold=hold, trainer=trainer)
    gate.gate({"train_epoch9": 1.0}, 9)  # what Lightning logs again of the checkpoint's epoch end
    for step in range(10, 15):
        log_batch(gate, trainer, step, val_from=0 if step == 14 else None)
    gate.release()
    assert logger.got == [
        *((f"train{s}", s) for s in range(10, 15)),
        ("val_batch0", 0),
        ("val_batch1", 1),
        ("val14", 14),
    ]


def csv_points(run_dir):
    with open(run_dir / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    keys = {key for row in rows for key in row} - {"step"}
    return {key: [(int(row["step"]), float(row[key])) for row in rows if row.get(key)] for key in keys}


def kill_and_resume(args: list[str], kill: int, resumed_at: int, cwd: Path) -> Path:
    """Fits, killed with SIGKILL as step ``kill`` begins, then ``--ckpt_path last``; returns the run folder. The resume
    is a process too: TensorBoard reads a run's event files in name order (second, then pid), and one written in this
    process in the killed run's second would be read first, its points hidden by the killed run's."""
    proc = cli("fit", *args, *kill_at(kill, settle=True), cwd=cwd, check=False)
    assert proc.returncode == -9, proc.stderr[-3000:]
    proc = cli("fit", *args, "--ckpt_path", "last", cwd=cwd)
    assert f"continues from step {resumed_at} " in proc.stdout + proc.stderr, (proc.stdout + proc.stderr)[-3000:]
    (run_dir,) = run_dirs(cwd)
    return run_dir


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The oracle: the same fit, never stopped (TensorBoard's and the CSV's points)."""
    cwd = tmp_path_factory.mktemp("uninterrupted")
    cli_in_process("fit", *ARGS, root=cwd / "runs")  # the real CLI in this process: no interpreter start
    (run_dir,) = run_dirs(cwd)
    return {"tensorboard": scalars(run_dir), "csv": csv_points(run_dir)}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("kill", "resumed_at"),
    [
        # the newest checkpoint is step 10's, from the validation at step 9 (the epoch's end); CI and make test-all
        pytest.param(11, 10, marks=pytest.mark.long),
        (13, 12),  # the newest is step 12's, the user's, mid-epoch (the engine's exact mid-epoch resume)
    ],
)
def test_a_resumed_run_logs_every_validation_batch_value_once(kill, resumed_at, uninterrupted, tmp_path):
    """Killed (kill -9) at step ``kill`` and resumed with ``--ckpt_path last``: the third validation (step 14) runs
    in the resumed process, and each logger holds its 3 batch values, as the uninterrupted run's has: 9 values,
    the same in the same order; the training values still once per step, the epoch-end ones once per epoch."""
    run_dir = kill_and_resume(ARGS, kill, resumed_at, tmp_path)
    for name, read in (("tensorboard", scalars), ("csv", csv_points)):
        got, want = read(run_dir), uninterrupted[name]
        batch, wanted = got.get(PER_BATCH, []), want[PER_BATCH]
        assert len(wanted) == EPOCHS * VAL_BATCHES, name
        assert len(batch) == len(wanted), f"{name}: {len(batch)} of {len(wanted)} validation batch values: {batch}"
        assert [v for _, v in batch] == pytest.approx([v for _, v in wanted], abs=1e-6), name
        # at the same steps: the resumed process continues Lightning's count of validation batches (0 in every
        # process, the checkpoint's count here), not at the steps of the first validation again
        assert [s for s, _ in batch] == [s for s, _ in wanted] == list(range(EPOCHS * VAL_BATCHES)), name
        for key in ("train/loss", "lr"):
            assert [s for s, _ in got[key]] == STEPS, f"{name}: {key}"  # none twice, none missing, in order
            assert [v for _, v in got[key]] == pytest.approx([v for _, v in want[key]], abs=1e-6), f"{name}: {key}"
        for key in (PER_VALIDATION, "val/acc", "val/loss"):
            assert [s for s, _ in got[key]] == EPOCH_ENDS, f"{name}: {key}"
            assert [v for _, v in got[key]] == pytest.approx([v for _, v in want[key]], abs=1e-6), f"{name}: {key}"


@pytest.mark.long  # CI and make test-all: the held path, once more end to end
def test_a_logger_that_cannot_drop_points_gets_every_validation_batch_value_once(uninterrupted, tmp_path):
    """MLflow (held until each checkpoint): killed at step 11, resumed from step 10's checkpoint, the run holds the 9
    validation batch values and each training step once; the values are the uninterrupted run's."""
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    mlflow = ["--config", str(REPO / "configs" / "mlflow.yaml"), "--trainer.logger.init_args.tracking_uri", uri]
    kill_and_resume([*FIT, *mlflow], 11, 10, tmp_path)
    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name(RUN_NAME).experiment_id])  # one run, continued
    want = uninterrupted["tensorboard"]

    def history(key: str) -> list[tuple[int, float]]:
        return sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, key))

    batch = history(PER_BATCH)
    assert len(batch) == len(want[PER_BATCH]) == EPOCHS * VAL_BATCHES, batch
    assert [s for s, _ in batch] == [s for s, _ in want[PER_BATCH]]  # continued from the checkpoint's count
    assert [v for _, v in batch] == pytest.approx([v for _, v in want[PER_BATCH]], abs=1e-6)
    assert [s for s, _ in history("train/loss")] == STEPS
    assert [s for s, _ in history(PER_VALIDATION)] == EPOCH_ENDS
