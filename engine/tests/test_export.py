"""Export: each format gives the Lightning model's own outputs; a net that cannot be exported says why in one line."""

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch
import yaml
from lightning.pytorch import LightningModule
from safetensors import safe_open
from torch import nn

from lightkeep.export.formats import export
from lightkeep.export.weights import build
from lightkeep.testing import lightning_model, load_exported
from tests.helpers import PYTHONPATH, REPO, RUN_NAME, with_stand_in

# the stand-in with each of its nets (tests/fixtures/stand_in.py), by class name
NETS = {
    "MLP": ["--model.net.hidden_sizes", "[32, 16]"],
    "SmallCNN": ["--model.net", "tests.fixtures.stand_in.SmallCNN"],
}


def make_run(root: Path, model_args: list[str], family: str = RUN_NAME, example: bool = False) -> Path:
    """A run folder as ``fit`` leaves it: the CLI's own config.yaml and a checkpoint of that config's module (the
    stand-in's unless ``model_args`` name another, or ``example=True``).

    The weights are the seeded initial ones, perturbed so that no layer is left at an identity-like default.
    """
    from tests.helpers import cli_main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), mock.patch.object(sys, "argv", ["project"]), pytest.raises(SystemExit):
        cli_main(with_stand_in(["fit", *model_args, "--print_config"], example))
    config = yaml.safe_load(out.getvalue())
    torch.manual_seed(0)
    module = build(config["model"], LightningModule)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.1 * torch.randn_like(p))
    run = root / "runs" / family / "version_0"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    torch.save({"state_dict": module.state_dict(), "global_step": 0, "epoch": 0}, run / "checkpoints" / "last.ckpt")
    return run / "checkpoints" / "last.ckpt"


@pytest.fixture(scope="module", params=list(NETS))
def exported(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    ckpt = make_run(root, NETS[request.param])
    paths = export(ckpt, root / "export", ("safetensors", "onnx", "pt2", "pth"))
    return request.param, lightning_model(ckpt), {p.suffix[1:]: p for p in paths}


RUNNERS = dict.fromkeys(("safetensors", "onnx", "pt2", "pth"), load_exported)  # each a function of one input


@pytest.mark.parametrize("fmt", list(RUNNERS))
def test_each_format_gives_the_lightning_models_outputs_for_batches_of_1_and_7(exported, fmt):
    name, module, paths = exported
    run = RUNNERS[fmt](paths[fmt])
    for batch in (1, 7):
        seed = 100 + batch
        x = torch.rand(batch, 1, 8, 8, generator=torch.Generator().manual_seed(seed))
        with torch.no_grad():
            expected, got = module(x), run(x)
        assert got.shape == expected.shape == (batch, 10)
        delta = (got - expected).abs().max().item()
        print(f"{name} {fmt} batch {batch}: max |delta| {delta:.3g}")
        assert delta <= 1e-5, f"{name} {fmt} batch {batch} (input seed {seed}): max |delta| {delta}"


@pytest.mark.slow  # a subprocess: a fresh interpreter, where unpickling fails, is the point
def test_safetensors_carry_the_module_recipe_and_load_with_no_pickle_as_an_ordinary_file(exported):
    name, _, paths = exported
    with safe_open(str(paths["safetensors"]), framework="pt") as f:
        metadata = f.metadata()
    assert metadata["class_path"] == "tests.fixtures.stand_in.StandIn"
    assert json.loads(metadata["init_args"])["net"]["class_path"] == f"tests.fixtures.stand_in.{name}"
    mask = os.umask(0)
    os.umask(mask)
    assert paths["safetensors"].stat().st_mode & 0o777 == 0o666 & ~mask  # not safetensors' 0600
    # A fresh interpreter where unpickling anything fails once the classes are imported
    code = (
        "import pickle\n"  # the module's class imported first: Lightning's own imports subclass pickle's classes
        "import torch, tests.fixtures.stand_in; from lightkeep import load_net\n"
        "pickle.loads = pickle.load = pickle.Unpickler = torch.load = None\n"
        f"net = load_net({str(paths['safetensors'])!r}); print(net(torch.zeros(3, 1, 8, 8)).shape)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], env={"PYTHONPATH": PYTHONPATH}, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "torch.Size([3, 10])" in proc.stdout


class BranchyNet(nn.Module):
    """Data-dependent Python control flow: which branch runs depends on the values, which a trace cannot keep."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x.flatten(1))
        return y if y.sum() > 0 else -y


class LenNet(BranchyNet):
    """Reshapes by ``len(x)``: a Python int, so the traced batch size is fixed to the example's."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x.reshape(len(x), -1))


class NamedOutputNet(BranchyNet):
    """Returns a dict with a string in it: no tensor graph to export."""

    def forward(self, x: torch.Tensor) -> dict:  # type: ignore[override]
        return {"logits": self.linear(x.flatten(1)), "labels": "classes"}


@pytest.mark.parametrize(
    ("net", "reason"),
    [("BranchyNet", "branches on a tensor's value"), ("NamedOutputNet", "returns a dict")],
)
@pytest.mark.parametrize("fmt", ["onnx", "pt2"])
def test_a_net_that_cannot_be_exported_gets_one_line_naming_the_format_and_the_reason(tmp_path, net, reason, fmt):
    ckpt = make_run(tmp_path, ["--model.net", f"tests.test_export.{net}"])
    with pytest.raises(ValueError) as error:
        export(ckpt, tmp_path / "export", (fmt,))
    message = str(error.value)
    assert message.startswith(f"{fmt} export of tests.fixtures.stand_in.StandIn failed") and reason in message, message
    assert "\n" not in message
    assert not (tmp_path / "export" / f"model.{fmt}").exists()


def test_a_forward_that_fixes_the_batch_size_gets_one_line_saying_what_keeps_it_free(tmp_path):
    # pt2 only: the ONNX exporter falls back to other ways of capturing the graph
    ckpt = make_run(tmp_path, ["--model.net", "tests.test_export.LenNet"])
    with pytest.raises(ValueError) as error:
        export(ckpt, tmp_path / "export", ("pt2",))
    assert str(error.value) == (
        "pt2 export of tests.fixtures.stand_in.StandIn failed: forward fixes the batch size to the example's "
        "(len() of a tensor does; x.size(0) or x.shape[0] keeps it free)"
    )


@pytest.mark.slow  # a subprocess: the script's exit code and last line are the point
def test_script_refuses_to_overwrite_and_reports_it_in_one_line(tmp_path):
    ckpt = make_run(tmp_path, NETS["MLP"])
    out = tmp_path / "export"
    (existing,) = export(ckpt, out, ("safetensors",))
    before = existing.read_bytes()
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "export.py"), str(ckpt), "--out", str(out), "--format", "all"],
        env={"PYTHONPATH": PYTHONPATH, "PYTHONWARNINGS": "ignore"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        f"export.py: error: {existing} exists; choose another --out (exports never overwrite)"
    )
    assert existing.read_bytes() == before and sorted(p.name for p in out.iterdir()) == ["model.safetensors"]


SHAPES = ["--model", "tests.fixtures.shapes.DictRegression", "--data", "tests.fixtures.shapes.DictData"]


@pytest.mark.parametrize(
    ("model", "traced_on"),
    [
        ("DictRegression", "what predict_step gives it on a batch of predict_dataloader: forward(Tensor[2, 4])"),
        ("ExampleArrayRegression", "the module's example_input_array"),
    ],
)
def test_any_lightning_module_exports_itself_equal_to_its_forward(tmp_path, model, traced_on):
    """A module with no ``net`` that takes dict batches: the module itself is exported, traced on its
    example_input_array, else on what its predict_step calls forward with."""
    ckpt = make_run(tmp_path, [*SHAPES, "--model", f"tests.fixtures.shapes.{model}"], family="dict")
    said: list[str] = []
    paths = export(ckpt, tmp_path / "export", ("onnx", "pt2", "safetensors"), say=said.append)
    assert said == [f"Tracing forward for onnx/pt2 on {traced_on}"]
    assert {p.name for p in paths} >= {"model.onnx", "model.pt2", "model.safetensors"}
    assert all(p.exists() for p in paths)  # model.onnx.data among them when the exporter writes it
    module = lightning_model(ckpt)
    by_name = {p.name: p for p in paths}
    runs = {fmt: RUNNERS[fmt](by_name[f"model.{fmt}"]) for fmt in ("onnx", "pt2", "safetensors")}
    for batch in (1, 5):
        seed = 200 + batch
        x = torch.randn(batch, 4, generator=torch.Generator().manual_seed(seed))
        with torch.no_grad():
            expected = module(x)
            for fmt, run in runs.items():
                delta = (run(x) - expected).abs().max().item()
                assert delta <= 1e-5, f"{model} {fmt} batch {batch} (input seed {seed}): max |delta| {delta}"


@pytest.mark.parametrize(
    ("given", "says"),
    [
        ("missing.ckpt", "missing.ckpt: no such checkpoint file or folder"),
        ("junk.ckpt", "junk.ckpt is not a readable checkpoint: it is not a zip archive"),
        ("alone.ckpt", "alone.ckpt is not in a run folder's checkpoints/ (no config.yaml at"),
    ],
)
def test_a_file_that_cannot_be_exported_says_what_is_wrong_with_it(tmp_path, given, says):
    (tmp_path / "junk.ckpt").write_text("not a checkpoint")
    torch.save({"state_dict": {}, "global_step": 0}, tmp_path / "alone.ckpt")
    with pytest.raises(ValueError) as error:
        export(tmp_path / given, tmp_path / "export", ("safetensors",))
    assert says in str(error.value), str(error.value)
