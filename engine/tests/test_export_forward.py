"""Export follows the module's own forward: with no ``example_input_array`` and no ``--input_shape``, the command
(``scripts/export.py``) runs one of the module's steps on a batch, records what the step calls ``forward`` with (one
tensor, several, keywords) and exports that; each file then gives ``forward``'s outputs. A module whose steps never
call ``forward`` is refused in one line."""

import runpy
import sys
from pathlib import Path
from unittest import mock

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from lightkeep.testing import lightning_model, load_exported
from tests.helpers import REPO
from tests.test_export import make_run

FORMATS = ("safetensors", "onnx", "pt2", "pth")
HERE = "tests.test_export_forward"


class Regression(L.LightningModule):
    """The issue's module: dict batches ``{"features": (B, 4), "target": (B,)}``, a forward of the features tensor."""

    def __init__(self, hidden: int = 8) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, hidden), nn.Tanh(), nn.Linear(hidden, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, 4) -> (B,)
        return self.body(x).squeeze(-1)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = F.mse_loss(self(batch["features"]), batch["target"])
        self.log("train_loss", loss)
        return loss

    def predict_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self(batch["features"])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Keywords(Regression):
    """Dict batches ``{"image", "meta", "target"}``; its step calls ``forward`` by keyword, names of its own."""

    def __init__(self, hidden: int = 8) -> None:
        super().__init__(hidden)
        self.embed = nn.Linear(2, 4)

    def forward(self, pixels: torch.Tensor, *, condition: torch.Tensor) -> torch.Tensor:  # (B, 4), (B, 2) -> (B,)
        return super().forward(pixels + self.embed(condition))

    def predict_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self(pixels=batch["image"], condition=batch["meta"])


class NeverCalled(Regression):
    """Its steps use the layers directly: what ``forward`` takes, nothing of it says."""

    def predict_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.body(batch["features"]).squeeze(-1)


class Masked(Regression):
    """Padded sequences: tuple batches ``(x (B, 5, 4), lengths (B,), target (B,))``; its validation_step builds the
    mask and calls ``forward(x, mask)``. No predict_step, and its data no predict loader."""

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:  # (B, L, 4), (B, L) -> (B,)
        kept = mask.unsqueeze(-1).to(x.dtype)
        return super().forward((x * kept).sum(1) / kept.sum(1).clamp(min=1))

    def validation_step(self, batch: tuple[torch.Tensor, ...], batch_idx: int) -> None:
        x, lengths, target = batch
        mask = torch.arange(x.size(1)) < lengths.unsqueeze(-1)
        self.log("val_loss", F.mse_loss(self(x, mask), target))

    predict_step = L.LightningModule.predict_step  # Lightning's own, as if never written


class Data(L.LightningDataModule):
    """Dict batches of 16 (``Regression``'s, ``Keywords``' and ``NeverCalled``'s layout), or ``Masked``'s tuples."""

    def __init__(self, layout: str = "features") -> None:
        super().__init__()
        self.layout = layout

    def setup(self, stage: str) -> None:
        g = torch.Generator().manual_seed(0)
        x, target = torch.randn(64, 5, 4, generator=g), torch.randn(64, generator=g)
        if self.layout == "masked":
            self.samples = list(zip(x, torch.randint(1, 6, (64,), generator=g), target, strict=True))
        elif self.layout == "keywords":
            self.samples = [{"image": x[i, 0], "meta": x[i, 1, :2], "target": target[i]} for i in range(64)]
        else:
            self.samples = [{"features": x[i, 0], "target": target[i]} for i in range(64)]

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.samples, batch_size=16)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.samples, batch_size=16)

    def predict_dataloader(self) -> DataLoader:
        if self.layout == "masked":
            raise NotImplementedError("`predict_dataloader` must be implemented")  # as Lightning's own hook says
        return DataLoader(self.samples, batch_size=16)


def inputs(model: str, batch: int, seed: int) -> tuple[tuple[torch.Tensor, ...], dict[str, torch.Tensor]]:
    """Fresh inputs of ``batch`` samples, called as the module's step calls forward."""
    g = torch.Generator().manual_seed(seed)
    if model == "Masked":
        return (torch.randn(batch, 5, 4, generator=g), torch.rand(batch, 5, generator=g) < 0.7), {}
    if model == "Keywords":
        return (), {"pixels": torch.randn(batch, 4, generator=g), "condition": torch.randn(batch, 2, generator=g)}
    return (torch.randn(batch, 4, generator=g),), {}


def export_command(capsys, *args: str) -> tuple[int, str, str]:
    """``python scripts/export.py ARGS``, run in this process: its exit code, stdout and stderr."""
    code = 0
    with mock.patch.object(sys, "argv", ["export.py", *args]):
        try:
            runpy.run_path(str(REPO / "scripts" / "export.py"), run_name="__main__")
        except SystemExit as exit_:
            code = exit_.code
    out, err = capsys.readouterr()
    return code, out, err


def run_of(root: Path, model: str, layout: str) -> Path:
    return make_run(root, ["--model", f"{HERE}.{model}", "--data", f"{HERE}.Data", "--data.layout", layout], "own")


# each module, its data's layout, and what its step calls forward with (the command's first line)
CALLED = {
    "Regression": ("features", "predict_step gives it on a batch of predict_dataloader: forward(Tensor[2, 4])"),
    "Masked": (
        "masked",
        "validation_step gives it on a batch of val_dataloader: forward(Tensor[2, 5, 4], Tensor[2, 5])",
    ),
    "Keywords": (
        "keywords",
        "predict_step gives it on a batch of predict_dataloader: forward(pixels=Tensor[2, 4], condition=Tensor[2, 2])",
    ),
}


@pytest.mark.parametrize("model", list(CALLED))
def test_each_format_gives_forwards_outputs_called_as_the_modules_own_step_calls_it(tmp_path, capsys, model):
    layout, called = CALLED[model]
    ckpt = run_of(tmp_path, model, layout)
    code, out, err = export_command(capsys, str(ckpt), "--format", "all", "--out", str(tmp_path / "export"))
    assert code == 0, err[-2000:]
    assert out.splitlines()[0] == f"Tracing forward for onnx/pt2 on what {called}", out
    oracle = lightning_model(ckpt)
    for fmt in FORMATS:
        run = load_exported(tmp_path / "export" / f"model.{fmt}")
        for batch in (1, 5):  # 5: not the traced batch of 2
            seed = 300 + batch
            args, kwargs = inputs(model, batch, seed)
            with torch.no_grad():
                expected, got = oracle(*args, **kwargs), run(*args, **kwargs)
            assert got.shape == expected.shape == (batch,), (fmt, got.shape)
            delta = (got - expected).abs().max().item()
            assert delta <= 1e-5, f"{model} {fmt} batch {batch} (input seed {seed}): max |delta| {delta}"


def test_a_module_whose_steps_never_call_forward_is_refused_in_one_line(tmp_path, capsys):
    ckpt = run_of(tmp_path, "NeverCalled", "features")
    code, out, err = export_command(capsys, str(ckpt), "--format", "onnx", "--out", str(tmp_path / "export"))
    assert code == 2 and out == "", out
    assert err.splitlines()[-1] == (
        "export.py: error: no example input: predict_step never calls forward (self(...)) on a batch of "
        "predict_dataloader; set self.example_input_array in the module, or give --input_shape"
    ), err
    assert not (tmp_path / "export" / "model.onnx").exists()
