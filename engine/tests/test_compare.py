"""``python -m lightkeep compare A.ckpt B.ckpt`` on the real checkpoints of short fits: two runs of one config in two
folders compare equal (exit 0); a run one step longer differs (exit 1), by the values torch's own load of the files
gives, naming what differs. A file holding an object of a project's own class compares whole in the project's folder
(``--trust``) and leaves that object out, named, elsewhere or untrusted; an untrusted file runs none of its code. A
missing or unreadable file is one line and exit 2."""

import pickle
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from lightkeep.compare import SHOWN, compare_main
from lightkeep.testing import run_cli
from tests.helpers import RUN_NAME, cli, cli_in_process, max_abs_diff

SHORT = ("--trainer.limit_val_batches", "1", "--trainer.num_sanity_val_steps", "0", "--seed_everything", "1")

COLUMNS = """
import dataclasses


@dataclasses.dataclass
class Columns:
    names: list
"""

# run in the project's folder with (source, out, names) triples: checkpoints whose hyper-parameters hold a Columns
WITH_COLUMNS = """
import sys, torch, columns
for source, out, names in zip(*[iter(sys.argv[1:])] * 3):
    checkpoint = torch.load(source, weights_only=True)
    checkpoint["hyper_parameters"]["columns"] = columns.Columns(names.split(","))
    torch.save(checkpoint, out)
"""


class Touch:
    """Unpickled, creates the file ``path``: what a file from anywhere could run instead."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return open, (self.path, "w")


class Settings(dict):
    """A dict of a class of one's own: pickle fills it item by item."""


class Names(list):
    """A list of a class of one's own: pickle fills it item by item."""


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    """``last.ckpt`` of two fits of 3 steps, each in its own folder, and of one fit of 4 steps."""
    root = tmp_path_factory.mktemp("runs")
    files = {}
    for name, steps in (("a", 3), ("b", 3), ("longer", 4)):
        cli_in_process("fit", "--trainer.max_steps", str(steps), *SHORT, root=root / name)
        files[name] = root / name / RUN_NAME / "version_0" / "checkpoints" / "last.ckpt"
    return files


def load(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


def row(out: str, entry: str) -> list[str]:
    """The table's row of ``entry``: ``[entry, tensors, max |Δ|, values, differ]``."""
    return next(line.split() for line in out.splitlines() if line.split()[:1] == [entry])


def test_two_runs_of_one_config_compare_equal(checkpoints, capsys):
    a, b = load(checkpoints["a"]), load(checkpoints["b"])
    dirpaths = [next(s["dirpath"] for s in c["callbacks"].values() if "dirpath" in s) for c in (a, b)]
    assert dirpaths[0] != dirpaths[1], "two runs, each in its own folder"
    assert "ExactResume" in a["callbacks"], "the engine's record is in the file"
    assert max_abs_diff(a["state_dict"], b["state_dict"]) == 0  # the oracle: torch's load, compared by hand
    assert compare_main([str(checkpoints["a"]), str(checkpoints["b"])]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[-1] == "equal" and "differ:" not in out and "left out" not in out, out
    assert row(out, "state_dict")[1:3] == [str(len(a["state_dict"])), "0"], out
    assert row(out, "callbacks")[4] == "0", out


def test_one_more_step_differs_as_torch_loads_it(checkpoints, capsys):
    a, longer = load(checkpoints["a"]), load(checkpoints["longer"])
    files = [str(checkpoints["a"]), str(checkpoints["longer"])]
    assert compare_main(files) == 1
    out = capsys.readouterr().out
    for entry in ("state_dict", "optimizer_states"):
        assert row(out, entry)[2] == f"{max_abs_diff(a[entry], longer[entry]):.3g}", out
    assert f"global_step ({a['global_step']} vs {longer['global_step']})" in out
    moved = [k for k in a["state_dict"] if not torch.equal(a["state_dict"][k], longer["state_dict"][k])]
    assert moved, "a step moves the weights"
    for key in moved[:SHOWN]:
        assert f"state_dict.{key} (|Δ| " in out, out
    # --atol forgives floating-point differences, never an integer's: a count, an RNG state (the engine's record)
    assert compare_main([*files, "--atol", "1e30"]) == 1
    out = capsys.readouterr().out
    assert row(out, "state_dict")[4] == "0" and f"global_step ({a['global_step']} vs" in out, out
    assert row(out, "callbacks")[4] != "0", out


@pytest.mark.slow  # the point is the process: its working directory and what imports from there
def test_a_project_class_compares_in_its_folder_and_is_left_out_elsewhere(checkpoints, tmp_path, monkeypatch, capsys):
    project, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    project.mkdir(), elsewhere.mkdir()
    (project / "columns.py").write_text(COLUMNS)
    a, b = str(checkpoints["a"]), str(checkpoints["b"])
    made = [a, "a.ckpt", "x,y", b, "b.ckpt", "x,y", b, "other.ckpt", "x,z"]
    subprocess.run([sys.executable, "-c", WITH_COLUMNS, *made], cwd=project, check=True)
    with pytest.raises(pickle.UnpicklingError, match=r"columns\.Columns"):
        load(project / "a.ckpt")  # what made the template's old script fail
    hyper_parameters = len(load(checkpoints["a"])["hyper_parameters"]) + 1  # all plain values, and the Columns

    def compare(*args: str, cwd: Path) -> subprocess.CompletedProcess:
        result = run_cli("lightkeep", "compare", *args, cwd=cwd, check=False)
        assert "Traceback" not in result.stderr, result.stderr
        return result

    same = compare("--trust", "a.ckpt", "b.ckpt", cwd=project)
    assert same.returncode == 0 and "left out" not in same.stdout, same.stdout + same.stderr
    assert row(same.stdout, "hyper_parameters")[3:] == [str(hyper_parameters), "0"], same.stdout
    other = compare("--trust", "a.ckpt", "other.ckpt", cwd=project)
    assert other.returncode == 1, other.stdout + other.stderr
    assert "hyper_parameters.columns (Columns(names=['x', 'y']) vs Columns(names=['x', 'z']))" in other.stdout

    left_out = "left out (classes not imported: columns.Columns): hyper_parameters.columns"
    away = compare("--trust", str(project / "a.ckpt"), str(project / "other.ckpt"), cwd=elsewhere)
    assert away.returncode == 0 and left_out in away.stdout, away.stdout + away.stderr
    tensors = len(load(checkpoints["a"])["state_dict"])
    assert row(away.stdout, "state_dict")[1:3] == [str(tensors), "0"], away.stdout
    assert row(away.stdout, "hyper_parameters")[3] == str(hyper_parameters - 1), away.stdout
    untrusted = cli("compare", "a.ckpt", "other.ckpt", cwd=project, check=False)  # python -m project compare
    assert untrusted.returncode == 0 and f"{left_out}; --trust" in untrusted.stdout, untrusted.stdout + untrusted.stderr

    # a console script (`project compare`) has its bin folder, not the working directory, first on its path
    monkeypatch.chdir(project)
    path = list(sys.path)
    assert str(project) not in path
    try:
        assert compare_main(["--trust", "a.ckpt", "other.ckpt"]) == 1
    finally:
        sys.modules.pop("columns", None)
    assert "hyper_parameters.columns (Columns(" in capsys.readouterr().out
    assert sys.path == path, "the working directory is on the path for the comparison only"


def test_an_untrusted_file_runs_none_of_its_code(checkpoints, tmp_path, capsys):
    marker, file = tmp_path / "ran", tmp_path / "touch.ckpt"
    checkpoint = load(checkpoints["a"])
    own = dict(touch=Touch(marker), settings=Settings(a=1), names=Names(["x"]))
    # what torch's weights_only builds too: built for real beside the stand-ins, never left out
    tagged = torch.nn.Parameter(torch.ones(2))
    tagged.note = "a parameter with attributes"
    plain = dict(s={1}, f=frozenset([2]), b=b"x", size=torch.Size([2]), at=torch.device("cpu"), dtype=torch.half,
                 counts=Counter(a=1), weight=torch.nn.Parameter(torch.ones(2)), tagged=tagged)  # fmt: skip
    checkpoint["hyper_parameters"].update(own, plain=plain)
    torch.save(checkpoint, file)
    assert compare_main([str(file), str(file)]) == 0
    assert not marker.exists()
    out = capsys.readouterr().out
    left_out = ", ".join(f"hyper_parameters.{key}" for key in own)
    assert f"left out (classes not imported: io.open, {__name__}.Names, {__name__}.Settings): {left_out};" in out, out
    torch.load(file, weights_only=False)  # the oracle: a full load runs it
    assert marker.exists()


@pytest.mark.parametrize("bad", ["missing", "not a zip"])
def test_a_bad_file_is_one_line_and_exit_2(checkpoints, tmp_path, capsys, bad):
    file = tmp_path / "bad.ckpt"
    if bad == "not a zip":
        file.write_text("not a checkpoint")
    assert compare_main([str(file), str(checkpoints["a"])]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1 and str(file) in captured.err, captured.err
