"""Bad input and untrusted files end in one ``error:`` line naming the problem and the fix, and lose nothing.

Errors found while the command line is parsed are checked in this process (the real ``cli_main``, its
``SystemExit`` code is the exit code; ~0.1 s instead of ~5 s of imports); everything that builds a Trainer or
runs one goes through ``python -m project`` in a subprocess. Each test hashes every file of the earlier run
before and after.
"""

import hashlib
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from tests.helpers import DDP2, PYTHONPATH, QUIET, REPO, RUN_NAME, cli, cli_in_process, run_dirs

pytestmark = pytest.mark.slow  # real runs of the CLI in subprocesses

SMALL = ["--model.net.init_args.hidden_sizes", "[32]", "--model.warmup", "0"]  # not the default net: row 5
TINY = [*QUIET, "--trainer.max_epochs", "1", "--trainer.limit_train_batches", "3", "--trainer.limit_val_batches", "2"]


def together(cwd: Path, *commands: list[str]) -> list[subprocess.CompletedProcess]:
    """Runs independent CLI commands at the same time (each spends ~5 s importing Lightning on one core)."""
    with ThreadPoolExecutor(len(commands)) as pool:
        return list(pool.map(lambda args: cli(*args, cwd=cwd, check=False, timeout=120), commands))


def snapshot(cwd: Path) -> dict[str, str]:
    """sha256 of every file under ``cwd/runs``."""
    return {
        str(p.relative_to(cwd)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(cwd.rglob("runs/**/*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A folder holding one finished run of the small net: runs/<RUN_NAME>/version_0 with best-*.ckpt and last.ckpt."""
    cwd = tmp_path_factory.mktemp("trained")
    cli("fit", *TINY, *SMALL, cwd=cwd)
    return cwd


@pytest.fixture
def earlier(trained, tmp_path) -> Path:
    """A copy of ``trained`` that a test may run into."""
    shutil.copytree(trained / "runs", tmp_path / "runs")
    return tmp_path


@pytest.fixture
def parse(monkeypatch, capsys):
    """Runs ``cli_main(args)`` in ``cwd`` for input that fails before anything is built; returns (exit code, stderr)."""
    from tests.helpers import cli_main

    monkeypatch.setattr(sys, "argv", ["project"])

    def run(*args: str, cwd: Path) -> tuple[int, str]:
        monkeypatch.chdir(cwd)
        with pytest.raises(SystemExit) as exit_info:  # any other exception: the user would see a traceback
            cli_main(list(args))
        return exit_info.value.code, capsys.readouterr().err

    return run


def assert_one_clear_error(code: int, stderr: str, *words: str, exit_code: int = 2) -> None:
    assert code == exit_code, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    error = stderr[stderr.rindex("error: ") :]  # the last thing printed
    for word in words:
        assert word in error, f"{word!r} not in {error!r}"


def test_unknown_flag_or_misspelt_yaml_key_names_the_key_and_starts_nothing(trained, parse, tmp_path):
    before = snapshot(trained)
    code, err = parse("fit", "--model.lrr", "0.1", cwd=trained)
    assert_one_clear_error(code, err, "--model.lrr: ", "takes no argument 'lrr'")
    assert "fit --model.help " in err  # the fix: where the accepted keys are listed
    assert len(err.splitlines()) == 1  # the error alone: no usage line, not the 60 options
    config = tmp_path / "typo.yaml"
    config.write_text("trainer:\n  max_epochz: 3\n")
    code, err = parse("fit", "--config", str(config), cwd=trained)
    assert_one_clear_error(code, err, f"trainer.max_epochz in {config}: no such option", "fit --help")
    assert snapshot(trained) == before


def test_config_file_missing_or_not_yaml_names_the_file(trained, parse, tmp_path):
    before = snapshot(trained)
    code, err = parse("fit", "--config", "missing.yaml", cwd=trained)
    assert_one_clear_error(code, err, "does not exist", "missing.yaml")
    broken = tmp_path / "broken.yaml"
    broken.write_text("trainer:\n  max_epochs: [1, 2\n  devices: 1\n")
    code, err = parse("fit", "--config", str(broken), cwd=trained)
    assert_one_clear_error(code, err, f"--config {broken} is not valid YAML", "line 3", "Fix the file")
    assert snapshot(trained) == before


def one_error_line(proc: subprocess.CompletedProcess, *words: str) -> str:
    """Exit code 2 and nothing on stderr but one ``error:`` line, holding ``words``; returns the line."""
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-3000:]
    for word in words:
        assert word in lines[0], f"{word!r} not in {lines[0]!r}"
    return lines[0]


RAISES_ON_IMPORT = {  # a class_path whose module raises when imported (a missing driver, say)
    "needs_cuda.py": "import math\nraise RuntimeError('needs CUDA 13')\n",
    "broken.yaml": "model:\n  class_path: needs_cuda.Net\n",
}
STAND_IN_HELP = "python -m project fit --model.help tests.fixtures.stand_in.StandIn"
BAD_INPUT = [  # files written into the working folder, the arguments after `fit`, what the error line must say
    pytest.param(
        {"ten.yaml": 'trainer:\n  max_epochs: "ten"\n'},
        ["--config", "ten.yaml"],
        ["trainer.max_epochs in ten.yaml: expected int, got 'ten' (python -m project fit --help lists the types)"],
        id="type-in-yaml",
    ),
    pytest.param({}, ["--model.lr", "nan"], ["--model.lr: expected float, got 'nan'"], id="lr-nan"),
    pytest.param({}, ["--model.lr", "inf"], ["--model.lr: expected float, got 'inf'"], id="lr-inf"),
    pytest.param(
        {},
        ["--model.lrr", "0.1"],
        [f"--model.lrr: tests.fixtures.stand_in.StandIn takes no argument 'lrr' ({STAND_IN_HELP} lists them)"],
        id="misspelt-model-key",
    ),
    pytest.param(
        {"typo.yaml": "model:\n  init_args:\n    lrr: 0.1\n"},
        ["--config", "typo.yaml"],
        ["model.lrr in typo.yaml: tests.fixtures.stand_in.StandIn takes no argument 'lrr'"],
        id="misspelt-model-key-in-yaml",
    ),
    pytest.param(
        {"missing.yaml": "model:\n  class_path: no_such_module.Net\n"},
        ["--config", "missing.yaml"],
        ["model in missing.yaml: class_path no_such_module.Net cannot be imported: No module named 'no_such_module'"],
        id="class-path-to-no-module",
    ),
    pytest.param(
        RAISES_ON_IMPORT,
        ["--config", "broken.yaml"],
        [
            "model in broken.yaml: class_path needs_cuda.Net: importing it raised RuntimeError: needs CUDA 13 "
            "(at needs_cuda.py:2; JSONARGPARSE_DEBUG=true shows the traceback)"
        ],
        id="class-path-whose-import-raises",
    ),
    pytest.param(
        {"needs_dep.py": "import no_such_dependency\n", "dep.yaml": "model:\n  class_path: needs_dep.Net\n"},
        ["--config", "dep.yaml"],
        [
            "model in dep.yaml: class_path needs_dep.Net: importing it raised ModuleNotFoundError: No module named "
            "'no_such_dependency' (at needs_dep.py:1;"
        ],
        id="class-path-whose-import-fails",
    ),
    pytest.param(
        {"empty.yaml": "# nothing yet\n"}, ["--config", "empty.yaml"], ["--config empty.yaml is empty"], id="empty-yaml"
    ),
    pytest.param(
        {"list.yaml": "- trainer\n- model\n"},
        ["--config", "list.yaml"],
        ["--config list.yaml holds a list, not keys"],
        id="yaml-list",
    ),
    pytest.param(
        {"latin1.yaml": "trainer:\n  max_epochs: 3  # café\n".encode("latin-1")},
        ["--config", "latin1.yaml"],
        ["--config latin1.yaml is not UTF-8 text (byte 0xe9 on line 2). Save it as UTF-8."],
        id="not-utf8",
    ),
    pytest.param(
        {"twice.yaml": "trainer:\n  max_epochs: 3\n  devices: 1\n  max_epochs: 30\n"},
        ["--config", "twice.yaml"],
        ["--config twice.yaml sets trainer.max_epochs twice (lines 2 and 4)", "Keep one"],
        id="duplicate-key",
    ),
]


# Two in make test, the rest in CI and make test-all (a CLI start each, ~4 s). lr-inf: the same rejection of a float
# as [lr-nan], which make test keeps; misspelt-model-key: make test names --model.lrr in one line in
# test_unknown_flag_or_misspelt_yaml_key_names_the_key_and_starts_nothing (in this process).
IN_MAKE_TEST = ("type-in-yaml", "lr-nan")
BAD_INPUT = [p if p.id in IN_MAKE_TEST else pytest.param(*p.values, marks=pytest.mark.long, id=p.id) for p in BAD_INPUT]


@pytest.mark.parametrize(("files", "args", "words"), BAD_INPUT)
def test_bad_values_and_config_files_are_one_line_naming_where_and_make_no_run_folder(tmp_path, files, args, words):
    for name, content in files.items():
        (tmp_path / name).write_bytes(content if isinstance(content, bytes) else content.encode())
    # TINY sets trainer.max_epochs before ten.yaml does: the line names the file that set the bad value
    proc = cli("fit", *TINY, *args, cwd=tmp_path, check=False, timeout=120)
    one_error_line(proc, *words)
    assert not (tmp_path / "runs").exists()


def test_the_suggested_debug_switch_brings_the_traceback_back(tmp_path, monkeypatch):
    """jsonargparse 4.52 and 4.53 read JSONARGPARSE_DEBUG as true/false and raise on 1: the switch that every line
    suggests must be one the installed jsonargparse reads, and so must the engine's own handler."""
    from lightkeep.errors import one_line_errors

    for name, content in RAISES_ON_IMPORT.items():
        (tmp_path / name).write_text(content)
    line = one_error_line(cli("fit", "--config", "broken.yaml", cwd=tmp_path, check=False, timeout=120))
    variable, value = re.search(r"(\w+)=(\S+) shows the traceback", line).groups()
    proc = cli("fit", "--config", "broken.yaml", cwd=tmp_path, check=False, timeout=120, env={variable: value})
    assert "Traceback (most recent call last)" in proc.stderr, proc.stderr[-3000:]
    assert 'needs_cuda.py", line 2' in proc.stderr and "RuntimeError: needs CUDA 13" in proc.stderr
    assert "Invalid boolean value" not in proc.stderr
    monkeypatch.delenv(variable, raising=False)
    with pytest.raises(SystemExit) as said, one_line_errors():
        raise ValueError("lr (-0.1) must be > 0")  # what a run reports
    assert f"{variable}={value} shows the traceback" in str(said.value.code)
    monkeypatch.setenv(variable, value)
    with pytest.raises(ValueError, match=r"lr \(-0.1\)"), one_line_errors():
        raise ValueError("lr (-0.1) must be > 0")
    assert not (tmp_path / "runs").exists()


def test_ckpt_path_to_a_missing_file_names_it(trained, parse):
    before = snapshot(trained)
    lost = f"runs/{RUN_NAME}/version_0/checkpoints/lost.ckpt"
    code, err = parse("fit", "--ckpt_path", lost, cwd=trained)
    assert_one_clear_error(code, err, f"--ckpt_path {lost}: no such file", "'last'")
    assert snapshot(trained) == before  # ("--ckpt_path last" with no run: test_cli's ..._starts_fresh_with_a_notice)


@pytest.mark.parametrize(
    ("content", "problem"),
    [(b"", "it is an empty file"), (b"step: 40\n", "not a zip archive"), ([1, 2, 3], "not a Lightning checkpoint")],
    ids=["empty", "text", "torch-saved-list"],
)
def test_a_file_that_is_not_a_checkpoint_is_named_and_the_run_beside_it_untouched(trained, parse, content, problem):
    target = trained / "runs" / RUN_NAME / "version_0" / "checkpoints" / "not-a.ckpt"
    before = snapshot(trained)
    if isinstance(content, bytes):
        target.write_bytes(content)
    else:
        torch.save(content, target)
    try:
        for subcommand in ("fit", "validate"):
            code, err = parse(subcommand, "--ckpt_path", str(target), cwd=trained)
            assert_one_clear_error(code, err, f"{target} ", problem)
            assert "The newest other checkpoint beside it is" in err  # a good one: the fix
    finally:
        target.unlink()
    assert snapshot(trained) == before


def test_checkpoint_of_another_network_lists_the_shapes_and_the_config_to_use(trained):
    before = snapshot(trained)
    last = f"runs/{RUN_NAME}/version_0/checkpoints/last.ckpt"
    # validate with the default net (hidden [256, 256]); fit from last.ckpt, which would continue version_0, on
    # 2 DDP ranks: refused before any rank starts, so no rank waits for another.
    validate, fit = together(
        trained, ["validate", *QUIET, "--ckpt_path", last], ["fit", *QUIET, *DDP2, "--ckpt_path", last]
    )
    assert_one_clear_error(
        validate.returncode,
        validate.stderr,
        "net.layers.1.weight is [32, 64] in the checkpoint, [256, 64] here",
        "net.layers.4.bias is [10] in the checkpoint, [256] here",
        "net.layers.7.weight is missing from the checkpoint",
        f"--config runs/{RUN_NAME}/version_0/config.yaml",
    )
    assert_one_clear_error(fit.returncode, fit.stderr, "net.layers.1.weight is [32, 64] in the checkpoint")
    assert snapshot(trained) == before  # not even a config.1.yaml in version_0


class Payload:
    """Unpickling this object creates ``marker``: what a malicious checkpoint could do with any other call."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_checkpoint_carrying_code_is_refused_unrun_by_fit_validate_and_export(trained, parse, tmp_path):
    marker = tmp_path / "payload-ran"
    ckpt = torch.load(trained / "runs" / RUN_NAME / "version_0/checkpoints/last.ckpt", weights_only=True)
    evil = tmp_path / "evil.ckpt"
    torch.save({**ckpt, "extra": Payload(marker)}, evil)
    torch.load(evil, weights_only=False)  # the oracle: a plain load does run it
    assert marker.exists()
    marker.unlink()
    before = snapshot(trained)
    for subcommand in ("fit", "validate"):
        code, err = parse(subcommand, *SMALL, "--ckpt_path", str(evil), "--weights_only", "false", cwd=trained)
        assert_one_clear_error(code, err, f"{evil} holds a Python object", "could run code", "trust")
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "export.py"), str(evil), "--format", "pth", "--out",
         str(tmp_path / "out")],
        env={"PYTHONPATH": PYTHONPATH}, capture_output=True, text=True,
    )  # fmt: skip
    assert_one_clear_error(proc.returncode, proc.stderr, f"{evil} holds a Python object", "could run code")
    assert not marker.exists() and not (tmp_path / "out").exists()
    assert snapshot(trained) == before


def test_a_sharded_checkpoints_index_carrying_code_is_refused_unrun(tmp_path):
    import pickle

    import torch.distributed.checkpoint as dcp

    from lightkeep.checkpoint_files import CheckpointLoadError
    from lightkeep.sharded.folders import full_state_dict

    good = tmp_path / "good"  # a real DCP folder: its index's classes are let through
    dcp.save({"state_dict.w": torch.arange(4.0)}, checkpoint_id=good, no_dist=True)
    torch.save({}, good / "meta.pt")
    assert torch.equal(full_state_dict(good)["w"], torch.arange(4.0))
    marker, evil = tmp_path / "payload-ran", tmp_path / "evil"
    shutil.copytree(good, evil)
    (evil / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    pickle.loads((evil / ".metadata").read_bytes())  # the oracle: DCP's own reader (pickle) runs it
    assert marker.exists()
    marker.unlink()
    with pytest.raises(CheckpointLoadError, match="could run code"):
        full_state_dict(evil)
    assert not marker.exists()


def test_batch_larger_than_the_training_set_stops_before_training(earlier):
    before = snapshot(earlier)
    big_batch = cli("fit", *TINY, *SMALL, "--data.batch_size", "2000", cwd=earlier, check=False, timeout=120)
    # the training split: 1797 samples less int(1797 * 0.15) = 269 for validation and 269 for test
    assert_one_clear_error(big_batch.returncode, big_batch.stderr, "batch_size (2000)", "training set (1259 samples)",
                           "--data.batch_size to 1259 or less", exit_code=1)  # fmt: skip
    for run in run_dirs(earlier)[1:]:  # the failed run's folder holds no checkpoint: no training step ran
        assert not (run / "checkpoints").exists()
    assert {k: v for k, v in snapshot(earlier).items() if "version_0" in k} == before


def test_more_devices_than_the_machine_has_is_one_error_line_and_no_run_folder(tmp_path):
    n = torch.cuda.device_count()
    proc = cli("fit", *QUIET, "--trainer.accelerator", "cuda", "--trainer.devices", str(n + 1), cwd=tmp_path,
               check=False, timeout=120)  # fmt: skip
    assert_one_clear_error(proc.returncode, proc.stderr, f"this machine has {n} CUDA GPU(s)", "--trainer")
    assert not (tmp_path / "runs").exists()


def test_rerun_and_fit_from_a_best_checkpoint_write_new_versions_and_leave_the_first_byte_for_byte(earlier):
    before = snapshot(earlier)
    # both fits succeed and are checked by their files: the real CLI in this process (no interpreter start)
    cli_in_process("fit", *TINY, *SMALL, root=earlier / "runs")
    (best,) = (earlier / "runs" / RUN_NAME / "version_0/checkpoints").glob("best-*.ckpt")
    cli_in_process("fit", *TINY, *SMALL, "--trainer.max_epochs", "2", "--ckpt_path", str(best), root=earlier / "runs")
    assert [r.name for r in run_dirs(earlier)] == ["version_0", "version_1", "version_2"]
    assert torch.load(run_dirs(earlier)[2] / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 6
    assert {k: v for k, v in snapshot(earlier).items() if "version_0" in k} == before


def test_unusable_save_dir_is_named_before_anything_runs(trained, parse, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    before = snapshot(trained)
    code, err = parse("fit", "--run.root", str(blocker / "runs"), cwd=trained)
    assert_one_clear_error(code, err, f"{blocker} is a file, not a folder", "Choose another")
    assert snapshot(trained) == before


@pytest.mark.long  # CI and make test-all; a full disk's one line and resume: tests/test_disk_full.py, make test
def test_disk_full_while_saving_keeps_the_previous_checkpoints_and_resume_works(earlier):
    last = earlier / "runs" / RUN_NAME / "version_0/checkpoints/last.ckpt"
    before = snapshot(earlier)
    # Resume the finished run for a second epoch; its one write (best-epoch001, epoch001 and the end of fit's
    # last.ckpt: one file under their names) hits a full disk.
    fault = ["--trainer.plugins", "tests.faults.DiskFullOnSave", "--trainer.plugins.save", "1"]
    common = [*TINY, *SMALL, "--trainer.max_epochs", "2"]
    proc = cli("fit", *common, *fault, "--ckpt_path", "last", cwd=earlier, check=False)
    folder = f"runs/{RUN_NAME}/version_0/checkpoints"
    named = f"could not save the checkpoint best-epoch001-step6.ckpt in {folder}"
    assert_one_clear_error(proc.returncode, proc.stderr, named, "No space left on device", "Free space",
                           "--ckpt_path last", exit_code=1)  # fmt: skip
    assert not list(earlier.rglob("*.tmp"))
    assert hashlib.sha256(last.read_bytes()).hexdigest() == before[str(last.relative_to(earlier))]
    assert torch.load(last, weights_only=True)["global_step"] == 3
    proc = cli("fit", *common, "--trainer.max_epochs", "3", "--ckpt_path", "last", cwd=earlier)
    assert "resuming from" in proc.stdout + proc.stderr
    assert torch.load(last, weights_only=True)["global_step"] == 9


def test_clipping_a_fused_optimizer_under_mixed_precision_is_one_line_naming_the_fix(earlier):
    """The stand-in's AdamW is fused (as the example's): Lightning's mixed precision refuses to clip its gradients,
    bf16 too, which ended in a 37-frame traceback after the start line. Now one line naming both ways out, and the
    earlier run untouched."""
    before = snapshot(earlier)
    flags = ["--trainer.gradient_clip_val", "0.5", "--trainer.precision", "bf16-mixed"]
    proc = cli("fit", *TINY, *SMALL, *flags, cwd=earlier, check=False, timeout=120)
    assert_one_clear_error(proc.returncode, proc.stderr, "fused=True", "pass fused=False to the optimizer",
                           "leave trainer.gradient_clip_val unset", exit_code=1)  # fmt: skip
    assert {k: v for k, v in snapshot(earlier).items() if "version_0" in k} == before
