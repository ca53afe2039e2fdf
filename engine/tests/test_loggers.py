"""Loggers: the throttled TensorBoard writer keeps every value, and a resumed run continues the same run in every
logger the engine knows, with each step logged exactly once."""

import csv
import glob
import json
import struct
from pathlib import Path

import pytest
import torch

from lightkeep.loggers import ThrottledTensorBoardLogger
from tests.helpers import QUIET, REPO, RUN_NAME, cli, cli_in_process, scalars


def test_values_wait_until_a_flush_then_all_are_written_in_order(tmp_path):
    logger = ThrottledTensorBoardLogger(save_dir=str(tmp_path), name="t", flush_seconds=3600, default_hp_metric=False)
    logger.save()  # the first save flushes (nothing held yet) and starts the interval
    for step in range(50):  # more than SummaryWriter's queue holds by default (10), handed over at once
        logger.log_metrics({"train/loss": 1.0 / (step + 1)}, step=step)
        logger.save()  # what Lightning calls after each log_metrics: within the interval, nothing is handed over
    assert "train/loss" not in scalars(tmp_path / "t" / "version_0")
    logger.flush()  # what ExactResume calls at each checkpoint and epoch start
    logger.log_metrics({"train/loss": 0.1}, step=50)
    logger.finalize("success")  # the end of the run writes the rest
    expected = [(step, 1.0 / (step + 1)) for step in range(50)] + [(50, 0.1)]
    got = scalars(tmp_path / "t" / "version_0")["train/loss"]
    assert [s for s, _ in got] == [s for s, _ in expected]
    assert all(abs(v - e) < 1e-7 for (_, v), (_, e) in zip(got, expected, strict=True))


def test_from_a_checkpoint_to_the_next_batch_each_value_is_written_as_it_comes(tmp_path):
    """A kill -9 after a checkpoint, before the next batch's hooks, must not lose the values Lightning logs after
    saving (the checkpoint step's own): the resume drops them as already logged."""
    logger = ThrottledTensorBoardLogger(save_dir=str(tmp_path), name="t", flush_seconds=3600, default_hp_metric=False)
    logger.save()  # starts the interval
    logger.flush_each_save = True  # what ExactResume sets at a checkpoint
    logger.log_metrics({"train/loss": 0.5}, step=7)
    logger.save()  # what Lightning calls after log_metrics: the value is on disk now, with no flush or finalize
    assert scalars(tmp_path / "t" / "version_0")["train/loss"] == [(7, 0.5)]
    logger.flush_each_save = False  # ExactResume at the next batch start: throttled again
    logger.log_metrics({"train/loss": 0.25}, step=8)
    logger.save()
    assert scalars(tmp_path / "t" / "version_0")["train/loss"] == [(7, 0.5)]


def test_the_throttled_logger_takes_every_argument_of_lightnings_logger_and_the_writer_typed():
    """Its signature lists them rather than taking **kwargs (start-up): an argument a Lightning or torch upgrade
    adds, or a default it changes, must show here, not be silently missing from the CLI."""
    import inspect

    from lightning.pytorch.loggers import TensorBoardLogger
    from torch.utils.tensorboard import SummaryWriter

    mine = inspect.signature(ThrottledTensorBoardLogger).parameters
    lightnings = inspect.signature(TensorBoardLogger).parameters
    writers = inspect.signature(SummaryWriter).parameters
    theirs = {**{n: p for n, p in writers.items() if n != "log_dir"}, **lightnings}  # log_dir: Lightning sets it
    for name, param in theirs.items():
        if param.kind is param.VAR_KEYWORD:
            continue
        assert name in mine, f"ThrottledTensorBoardLogger lacks {name}, an argument of {param}"
        if name != "max_queue":  # unbounded here, on purpose
            assert mine[name].default == param.default, f"{name}: default {mine[name].default} != {param.default}"
    assert all(p.annotation is not p.empty and p.kind is p.POSITIONAL_OR_KEYWORD for p in mine.values())
    assert mine["max_queue"].default == 0


# 3 epochs of 5 steps; last.ckpt at each epoch end: a crash at step 12 resumes from step 10
# every step logged (the default logs every 50): the oracle is each step once in every logger
ARGS = [*QUIET, "--trainer.max_epochs", "3", "--trainer.limit_train_batches", "5", "--trainer.limit_val_batches", "1",
        "--model.warmup", "1", "--trainer.log_every_n_steps", "1"]  # fmt: skip
STEPS = list(range(15))


# Each reader returns what its logger holds as {key: [(step, value), ...]} for KEYS, read from its own files.
KEYS = ("train/loss", "val/acc", "best/val/acc")


def tensorboard_points(run_dir, tmp_path):
    return {key: points for key, points in scalars(run_dir).items() if key in KEYS}


def csv_points(run_dir, tmp_path):
    with open(run_dir / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    return {key: [(int(row["step"]), float(row[key])) for row in rows if row.get(key)] for key in KEYS}


def mlflow_points(run_dir, tmp_path):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    (run,) = client.search_runs([client.get_experiment_by_name(RUN_NAME).experiment_id])  # one run, not two
    assert run.info.run_id == json.loads((run_dir / "run.json").read_text())["mlflow_run_id"]
    assert run.info.run_name == f"{RUN_NAME}/version_0"
    history = {key: client.get_metric_history(run.info.run_id, key) for key in KEYS}
    return {key: sorted((m.step, m.value) for m in metrics) for key, metrics in history.items()}


def wandb_records(path):
    """The records of an offline W&B run file (a LevelDB-style log of protobuf records; wandb reads it in Go)."""
    from wandb.proto import wandb_internal_pb2

    data, pos, chunk = Path(path).read_bytes(), 7, b""  # a 7-byte header, then 32 KiB blocks of chunks
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a chunk header is padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:
            break
        chunk += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last chunk of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunk)
            chunk = b""
            yield record


def wandb_points(run_dir, tmp_path):
    files = sorted(glob.glob(str(run_dir / "wandb" / "offline-run-*" / "run-*.wandb")))
    assert len(files) == 2  # the interrupted process and the resumed one
    ids, points = set(), {key: [] for key in KEYS}
    for path in files:
        for record in wandb_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                ids.add(record.run.run_id)
            elif kind == "history":
                row = {
                    item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item
                }
                for key in KEYS:
                    if key in row:
                        points[key].append((row["trainer/global_step"], row[key]))
    assert ids == {json.loads((run_dir / "run.json").read_text())["wandb_id"]}  # the same W&B run id
    return points


LOGGERS = {
    "tensorboard": ([], [tensorboard_points]),
    "csv": (["--config", str(REPO / "configs" / "csv.yaml")], [csv_points]),
    "mlflow": (["--config", str(REPO / "configs" / "mlflow.yaml")], [mlflow_points]),
    "wandb": (["--config", str(REPO / "configs" / "wandb.yaml")], [wandb_points]),
    "tensorboard+csv": (["--config", str(REPO / "configs" / "tensorboard_csv.yaml")], [tensorboard_points, csv_points]),
    "tensorboard+=csv": (["--trainer.logger+=CSVLogger"], [tensorboard_points, csv_points]),  # appended, no save_dir
    "none": (["--trainer.logger", "false"], []),
}


@pytest.mark.slow
@pytest.mark.parametrize(  # W&B resumes in a new process (~30 s), TensorBoard and CSV alone (make test runs them
    # together): CI and make test-all
    "name",
    [pytest.param(n, marks=pytest.mark.long) if n in ("wandb", "tensorboard", "csv") else n for n in LOGGERS],
)
def test_resume_continues_the_same_run_with_each_step_logged_once(name, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")  # belt and braces: the overlay is offline already
    monkeypatch.setenv("WANDB_SILENT", "true")
    args, readers = LOGGERS[name]
    if name == "mlflow":
        args = [*args, "--trainer.logger.init_args.tracking_uri", f"sqlite:///{tmp_path}/mlflow.db"]
    root = tmp_path / "runs"
    crash = ["--trainer.callbacks+=tests.faults.CrashAt", "--trainer.callbacks.step=12"]
    if name == "wandb":  # W&B keeps process-wide state: a user resumes in a new process, so does this test
        proc = cli("fit", *ARGS, *args, *crash, cwd=tmp_path, check=False)
        assert proc.returncode == 1 and "injected crash" in proc.stderr, proc.stderr[-2000:]
        cli("fit", *ARGS, *args, "--ckpt_path", "last", cwd=tmp_path)
    else:
        with pytest.raises(RuntimeError, match="injected crash"):
            cli_in_process("fit", *ARGS, *args, *crash, root=root)
        assert cli_in_process("fit", *ARGS, *args, "--ckpt_path", "last", root=root).trainer.global_step == 15
    run_dir = root / RUN_NAME / "version_0"
    assert [p.name for p in (root / RUN_NAME).iterdir()] == ["version_0"]  # the same folder, no second run
    assert torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 15
    assert (run_dir / "config.yaml").is_file() and (run_dir / "config.1.yaml").is_file()
    best = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)["callbacks"]
    (best,) = [state["best_model_score"].item() for key, state in best.items() if "'monitor': 'val/acc'" in key]
    for read in readers:
        points = read(run_dir, tmp_path)
        assert [s for s, _ in points["train/loss"]] == STEPS, read.__name__  # none twice, none missing, in order
        # RunSummary's record: the best of the curve this logger holds, also the score ModelCheckpoint kept
        assert [s for s, _ in points["val/acc"]] == [4, 9, 14], read.__name__
        ((step, value),) = points["best/val/acc"]
        assert step == 15 and value == pytest.approx(max(v for _, v in points["val/acc"]), abs=1e-6), read.__name__
        assert value == pytest.approx(best, abs=1e-6), read.__name__


def test_an_appended_tensorboard_or_csv_logger_gets_a_placeholder_save_dir_once_and_others_nothing():
    from lightkeep.loggers import let_appended_loggers_parse

    args = ["fit", "--trainer.logger+=CSVLogger", "--trainer.max_epochs", "1", "--trainer.logger+", "TensorBoardLogger",
            "--trainer.logger+=lightning.pytorch.loggers.WandbLogger", "--trainer.logger+=NoSuchLogger"]  # fmt: skip
    filled = let_appended_loggers_parse(args)
    placeholder = "--trainer.logger.init_args.save_dir=runs"
    assert filled == [*args[:2], placeholder, *args[2:6], placeholder, *args[6:]]
    assert let_appended_loggers_parse(filled) == filled  # a DDP rank re-runs the filled arguments


def test_without_tensorboard_the_default_logger_is_lightnings_csv_and_the_run_trains(tmp_path, monkeypatch, capsys):
    """tensorboard is an optional extra: with it missing (as in a project that logs elsewhere), a run whose config
    names no logger logs to a CSV file in its run folder, as Lightning's own default falls back."""
    import sys

    from lightning.pytorch.loggers import CSVLogger

    monkeypatch.setitem(sys.modules, "tensorboard", None)  # `import tensorboard` fails, find_spec finds nothing
    with pytest.raises(ImportError):
        import tensorboard  # noqa: F401  (the precondition)
    fit = cli_in_process("fit", *QUIET, "--trainer.max_epochs", "1", "--trainer.limit_train_batches", "3",
                         "--trainer.limit_val_batches", "1", root=tmp_path)  # fmt: skip
    assert type(fit.trainer.logger) is CSVLogger
    (run,) = (tmp_path / RUN_NAME).glob("version_*")
    rows = list(csv.DictReader((run / "metrics.csv").open()))
    assert [r["epoch"] for r in rows if r.get("val/acc")] == ["0"] and fit.trainer.global_step == 3, rows
    assert "logs: CSVLogger" in capsys.readouterr().out
