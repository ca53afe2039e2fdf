"""Predictions written: one row per sample in dataset order, from any dict-of-tensors predict_step, and under DDP
the ranks' shares merged into the single-process file: index and order exact, probabilities within 1e-6."""

import csv
from pathlib import Path

import lightning as L
import pytest
import torch
import yaml
from torch.utils.data import DataLoader, TensorDataset

from lightkeep.predictions import PredictionWriter
from tests.fixtures.stand_in import SAMPLES, BlobsDataModule, StandIn
from tests.helpers import QUIET, RUN_NAME, cli, cli_in_process

PREDICT_SIZE = int(SAMPLES * BlobsDataModule().hparams.test_fraction)  # the test split, which predict_dataloader serves
TINY_FIT = [
    *QUIET,
    "--trainer.max_epochs",
    "1",
    "--trainer.limit_train_batches",
    "3",
    "--trainer.limit_val_batches",
    "1",
]


def read_csv(path: Path) -> tuple[list[str], list[list[str]]]:
    with open(path, newline="") as f:
        header, *rows = list(csv.reader(f))
    return header, rows


class Scorer(L.LightningModule):
    """A user's predict_step of their own: a dict with a 1-D, a 2-D and a 3-D tensor, and a non-tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.tensor(2.0))

    def predict_step(self, batch, batch_idx):
        (x,) = batch  # (B, 3)
        return {"score": self.scale * x.sum(1), "emb": x, "grid": x[:, :2, None].expand(-1, 2, 2), "note": "hi"}


@pytest.mark.parametrize("shuffle", [False, True])
def test_a_users_dict_of_tensors_is_written_one_row_per_sample_in_dataset_order(tmp_path, shuffle):
    x = torch.randn(11, 3, generator=torch.Generator().manual_seed(0))
    loader = DataLoader(TensorDataset(x), batch_size=4, shuffle=shuffle, generator=torch.Generator().manual_seed(1))
    trainer = L.Trainer(
        accelerator="cpu", logger=False, enable_progress_bar=False, callbacks=[PredictionWriter(out_dir=tmp_path)]
    )
    with pytest.warns(UserWarning, match="'note' is not a tensor"):
        trainer.predict(Scorer(), loader)
    header, rows = read_csv(tmp_path / "predictions.csv")
    assert header == ["index", "score", "emb_0", "emb_1", "emb_2"]  # grid (3-D) goes to the .pt only
    assert [int(r[0]) for r in rows] == list(range(11))
    got = torch.tensor([[float(v) for v in r[1:]] for r in rows])
    assert torch.allclose(got, torch.cat([2 * x.sum(1, keepdim=True), x], 1), atol=1e-6)
    saved = torch.load(tmp_path / "predictions.pt", weights_only=True)
    assert saved["index"].tolist() == list(range(11)) and saved["grid"].shape == (11, 2, 2)
    assert torch.equal(saved["emb"], x)
    with pytest.raises(FileExistsError, match="never overwritten"):  # a second predict into the same folder
        trainer.predict(Scorer(), loader)


@pytest.fixture(scope="module")
def fitted(tmp_path_factory) -> tuple[Path, Path]:
    workdir = tmp_path_factory.mktemp("predict")
    cli_in_process("fit", *TINY_FIT, "--model.warmup", "1", root=workdir / "runs")  # the real CLI, in this process
    (ckpt,) = workdir.glob(f"runs/{RUN_NAME}/version_*/checkpoints/last.ckpt")
    return workdir, ckpt


def predict(workdir: Path, ckpt: Path, *args: str, in_process: bool = False) -> Path:
    """Runs ``predict`` through the real CLI and returns the folder it wrote into (a new version_N): in a process of
    its own (DDP re-executes the command), or with ``in_process`` in this one."""
    before = set(workdir.glob(f"runs/{RUN_NAME}/version_*"))
    if in_process:
        cli_in_process("predict", *QUIET, "--ckpt_path", str(ckpt), *args, root=workdir / "runs")
    else:
        cli("predict", *QUIET, "--ckpt_path", str(ckpt), *args, cwd=workdir, timeout=400)
    (run,) = set(workdir.glob(f"runs/{RUN_NAME}/version_*")) - before
    return run


@pytest.fixture(scope="module")
def single(fitted) -> Path:
    return predict(*fitted, in_process=True)


@pytest.mark.slow
def test_predict_writes_index_pred_and_probabilities_of_every_sample_as_the_model_computes_them(fitted, single):
    assert PREDICT_SIZE == 269 and all(PREDICT_SIZE % d for d in range(2, 17))  # prime: no rank count divides it
    header, rows = read_csv(single / "predictions.csv")
    assert header == ["index", "pred", *(f"prob_{c}" for c in range(10))]
    assert [int(r[0]) for r in rows] == list(range(PREDICT_SIZE))
    # independent oracle: the checkpoint's module on the test split, in this process, in one batch
    from lightkeep.checkpoint_files import load_checkpoint_file
    from lightkeep.export.weights import build

    net = yaml.safe_load((fitted[1].parent.parent / "config.yaml").read_text())["model"]["init_args"]["net"]
    module = StandIn(build(net)).eval()
    module.load_state_dict(load_checkpoint_file(fitted[1])["state_dict"])
    data = BlobsDataModule()
    data.setup("predict")
    x, _ = data.splits["test"].tensors
    with torch.no_grad():
        probs = module(x).softmax(-1)
    written = torch.tensor([[float(v) for v in r[2:]] for r in rows])
    print(f"1 process: {len(rows)} rows, max |delta| vs the model {(written - probs).abs().max().item():.3g}")
    assert (written - probs).abs().max() <= 1e-6
    assert [int(r[1]) for r in rows] == probs.argmax(-1).tolist()
    saved = torch.load(single / "predictions.pt", weights_only=True)
    assert sorted(saved) == ["index", "pred", "prob"] and (saved["prob"] - probs).abs().max() <= 1e-6


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [2, pytest.param(3, marks=pytest.mark.long)])  # 3: CI and make test-all
def test_ddp_predictions_merge_into_the_single_process_file(fitted, single, ranks):
    ddp = ["--trainer.accelerator", "cpu", "--trainer.devices", str(ranks), "--trainer.strategy", "ddp"]
    run = predict(*fitted, *ddp)
    header, rows = read_csv(run / "predictions.csv")
    one_header, one_rows = read_csv(single / "predictions.csv")
    assert header == one_header and len(rows) == len(one_rows) == PREDICT_SIZE
    assert [r[:2] for r in rows] == [r[:2] for r in one_rows]  # index and predicted class, row by row
    delta = max(
        abs(float(a) - float(b)) for r, s in zip(rows, one_rows, strict=True) for a, b in zip(r, s, strict=True)
    )
    merged, one = (torch.load(d / "predictions.pt", weights_only=True) for d in (run, single))
    tensor_delta = (merged["prob"] - one["prob"]).abs().max().item()
    print(f"{ranks} ranks: {len(rows)} rows, max |delta| vs 1 process: csv {delta:.3g}, pt {tensor_delta:.3g}")
    assert delta <= 1e-6 and tensor_delta <= 1e-6
    assert torch.equal(merged["index"], one["index"]) and torch.equal(merged["pred"], one["pred"])
    assert not list(run.glob("*.rank*.pt"))  # the shards are gone
