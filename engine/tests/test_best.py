"""Checkpoints by name: ``--ckpt_path best`` (the newest run's best), a run folder (that run's best), the fallback to
its last, and the one-line errors. The oracle for "best" is the run's own TensorBoard ``val/acc`` curve: validating
the picked file must give its maximum."""

import logging
import sys

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightkeep.judge import best_checkpoint
from tests.helpers import QUIET, RUN_NAME, cli_in_process, scalars, with_stand_in

SMALL = [*QUIET, "--trainer.limit_train_batches", "4", "--model.net.init_args.hidden_sizes", "[32]",
         "--model.warmup", "0", "--model.lr", "0.01"]  # fmt: skip


def picked(caplog: pytest.LogCaptureFixture) -> str:
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("--ckpt_path")]
    assert len(lines) == 1, lines  # one line saying which file and why
    caplog.clear()
    return lines[0]


@pytest.mark.slow  # four real fits (~14 s): make test, not test-fast
def test_best_is_the_top_val_acc_file_across_a_resume_a_run_folder_gives_its_best_else_its_last(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    cli_in_process("fit", *SMALL, "--trainer.max_epochs", "3", root=tmp_path)
    cli_in_process("fit", *SMALL, "--trainer.max_epochs", "6", "--ckpt_path", "last", root=tmp_path)
    run = tmp_path / RUN_NAME / "version_0"
    curve = [value for _, value in scalars(run)["val/acc"]]
    # preconditions: one run of 6 validated epochs, and save_top_k 3 has deleted the 3 files that fell out
    assert len(curve) == 6 and len(list((run / "checkpoints").glob("best-*.ckpt"))) == 3, curve
    caplog.clear()

    best = cli_in_process("validate", *SMALL, "--ckpt_path", "best", root=tmp_path)
    chosen = best.config["validate"]["ckpt_path"]
    assert chosen.startswith(str(run / "checkpoints" / "best-")) and chosen in picked(caplog)
    assert best.trainer.callback_metrics["val/acc"].item() == pytest.approx(max(curve), abs=1e-6), curve

    # a newer run whose ModelCheckpoint never scored a file (no validation): best is its last, and says so
    cli_in_process("fit", *SMALL, "--trainer.max_epochs", "1", "--trainer.limit_val_batches", "0", root=tmp_path)
    newer = tmp_path / RUN_NAME / "version_2"
    fallback = cli_in_process("validate", *SMALL, "--ckpt_path", "best", root=tmp_path)
    assert fallback.config["validate"]["ckpt_path"] == str(newer / "checkpoints" / "last.ckpt")
    assert "its last" in picked(caplog)

    folder = cli_in_process("validate", *SMALL, "--ckpt_path", str(run), root=tmp_path)  # the older run, by folder
    assert folder.config["validate"]["ckpt_path"] == chosen and chosen in picked(caplog)
    # fit from a best branches into a new version and leaves the run as it was
    before = {p.name: p.stat().st_mtime_ns for p in (run / "checkpoints").iterdir()}
    short = ["--trainer.max_epochs", "7", "--trainer.limit_train_batches", "1", "--trainer.limit_val_batches", "1"]
    branch = cli_in_process("fit", *SMALL, *short, "--ckpt_path", str(run), root=tmp_path)
    assert branch.trainer.default_root_dir == str(tmp_path / RUN_NAME / "version_5")
    assert {p.name: p.stat().st_mtime_ns for p in (run / "checkpoints").iterdir()} == before


def save(path, records: dict[str, float], own: bool, mtime: float) -> None:
    """A checkpoint carrying a ModelCheckpoint(monitor="val/acc", mode="max") state whose ``best_k_models`` holds
    ``records`` (file name -> score), with ``path`` itself among them when ``own``."""
    import os

    key = ModelCheckpoint(monitor="val/acc", mode="max").state_key
    folder = path.parent
    best_k = {str(folder / name): torch.tensor(score) for name, score in records.items()}
    state = {"monitor": "val/acc", "best_k_models": best_k, "best_model_path": "", "current_score": None}
    assert (path.name in records) == own
    torch.save({"state_dict": {}, "global_step": 1, "callbacks": {key: state}}, path)
    os.utime(path, (mtime, mtime))


def test_a_rotated_out_file_is_never_picked_and_a_resume_with_a_fresh_record_still_finds_the_older_best(tmp_path):
    folder = tmp_path / "version_0" / "checkpoints"
    folder.mkdir(parents=True)
    # first segment: a (0.90) kept; "gone" (0.99) was deleted by rotation but its record still names it
    save(folder / "a.ckpt", {"gone.ckpt": 0.99, "a.ckpt": 0.90}, own=True, mtime=1000)
    save(folder / "last.ckpt", {"gone.ckpt": 0.99, "a.ckpt": 0.90}, own=False, mtime=1001)
    # the resumed segment's callback started afresh (its folder path changed): its record knows b only
    save(folder / "b.ckpt", {"b.ckpt": 0.80}, own=True, mtime=2000)
    scored, ranked = best_checkpoint(tmp_path / "version_0")
    assert (scored.path.name, scored.score, scored.mode, ranked) == ("a.ckpt", pytest.approx(0.90), "max", 2)
    (folder / "a.ckpt").unlink()
    assert best_checkpoint(tmp_path / "version_0")[0].path.name == "b.ckpt"
    (folder / "b.ckpt").unlink()
    assert best_checkpoint(tmp_path / "version_0") is None  # last.ckpt scores nothing itself: the caller falls back


@pytest.fixture
def parse(monkeypatch, capsys):
    """``cli_main(args)`` for input that fails before anything is built: (exit code, stderr)."""
    from tests.helpers import cli_main

    monkeypatch.setattr(sys, "argv", ["project"])

    def run(*args: str, root) -> tuple[int, str]:
        args = with_stand_in(args)
        with pytest.raises(SystemExit) as exit_info:
            cli_main([args[0], "--run.root", str(root), *args[1:]])
        return exit_info.value.code, capsys.readouterr().err

    return run


@pytest.mark.parametrize(
    ("subcommand", "name", "words"),
    [("validate", "best", ["--ckpt_path best: no checkpoint under", "python -m project fit"]),
     ("test", "last", ["--ckpt_path last: no checkpoint under", "to test"]),
     ("predict", "{root}/{run}/version_0", ["holds no loadable checkpoint", "'best' or 'last'"]),
     ("validate", "{root}/{run}/version_9", ["no such file or run folder", "a run folder"])],
)  # fmt: skip
def test_a_bad_checkpoint_name_is_one_error_line_exit_2_and_writes_nothing(parse, tmp_path, subcommand, name, words):
    run = tmp_path / RUN_NAME / "version_0"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text("{}\n")  # a run folder with no checkpoint (a validate run's, say)
    code, err = parse(subcommand, "--ckpt_path", name.format(root=tmp_path, run=RUN_NAME), root=tmp_path)
    assert code == 2 and "Traceback" not in err, err
    error = err[err.rindex("error: ") :]
    assert len(error.strip().splitlines()) == 1 and all(w in error for w in words), error
    assert sorted(p.name for p in tmp_path.rglob("*")) == sorted(["config.yaml", RUN_NAME, "version_0"])
