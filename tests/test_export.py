"""The example's own nets (project/nets.py) export to every format equal to the Classifier's forward: the engine's
export is tested on the stand-in (engine/tests/test_export.py); this checks the layers a user's copy starts with
(GroupNorm, adaptive pooling) survive each exporter."""

import json

import pytest
import torch
from safetensors import safe_open

from lightkeep.export.formats import export
from lightkeep.testing import QUIET, lightning_model, load_exported
from tests.helpers import cli, run_dirs

NETS = {"MLP": [], "CNN": ["--model.net", "project.nets.CNN"]}  # the base config's net, and the other one
FORMATS = ("safetensors", "onnx", "pt2", "pth")
ONE_STEP = ["--trainer.max_epochs", "1", "--trainer.limit_train_batches", "1", "--trainer.limit_val_batches", "1"]


@pytest.mark.slow  # a real fit of one step: the run folder and checkpoint export reads
@pytest.mark.parametrize("name", list(NETS))
def test_the_examples_nets_export_to_each_format_equal_to_the_classifier(tmp_path, name):
    cli("fit", *QUIET, *ONE_STEP, *NETS[name], cwd=tmp_path)
    (run,) = run_dirs(tmp_path, "digits")
    ckpt = run / "checkpoints" / "last.ckpt"
    paths = {p.suffix[1:]: p for p in export(ckpt, tmp_path / "export", FORMATS)}
    with safe_open(str(paths["safetensors"]), framework="pt") as f:
        metadata = f.metadata()
    assert metadata["class_path"] == "project.module.Classifier"  # precondition: the example, not the stand-in
    assert json.loads(metadata["init_args"])["net"]["class_path"] == f"project.nets.{name}"
    module = lightning_model(ckpt)
    for fmt in FORMATS:
        exported = load_exported(paths[fmt])
        for batch in (1, 7):
            seed = 100 + batch
            x = torch.rand(batch, 1, 8, 8, generator=torch.Generator().manual_seed(seed))
            with torch.no_grad():
                expected, got = module(x), exported(x)
            assert got.shape == expected.shape == (batch, 10)
            delta = (got - expected).abs().max().item()
            assert delta <= 1e-5, f"{name} {fmt} batch {batch} (input seed {seed}): max |delta| {delta}"
