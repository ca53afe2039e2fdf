"""Lightning's own demo modules, as Lightning ships them (``lightning.pytorch.demos``: nothing subclassed, nothing of
the engine imported), through the engine's CLI as a user would name them: fit, kill -9 mid-epoch, ``fit
--ckpt_path last`` ending bit for bit where the uninterrupted run ends, and the export of what it trained giving the
module's own outputs. ``LightningTransformer`` loads its own data (``WikiText2``, read from ``data/wikitext-2.txt``:
a small made-up text here, since nothing is downloaded) and its ``forward`` takes two inputs."""

import os
import random
from pathlib import Path

import pytest
import torch

from lightkeep.export.formats import export
from lightkeep.testing import lightning_model, load_exported, run_cli, run_dirs
from tests.faults import kill_at
from tests.helpers import DDP2, ENGINE, QUIET

pytestmark = pytest.mark.slow

DEMOS = "lightning.pytorch.demos"
BORING = ["--model", f"{DEMOS}.boring_classes.BoringModel", "--data", f"{DEMOS}.boring_classes.BoringDataModule",
          "--trainer.limit_val_batches", "4"]  # fmt: skip
TRANSFORMER = ["--model", f"{DEMOS}.transformer.LightningTransformer", "--model.vocab_size", "40"]
# the user's own checkpointing, the Lightning way: last.ckpt every 5 steps; 12 batches an epoch, 2 epochs
EVERY_5 = [*QUIET, "--trainer.max_epochs", "2", "--trainer.limit_train_batches", "12",
           "--trainer.callbacks+=ModelCheckpoint", "--trainer.callbacks.every_n_train_steps=5",
           "--trainer.callbacks.save_top_k=0", "--trainer.callbacks.save_last=true"]  # fmt: skip


def wikitext(folder: Path) -> Path:
    """``data/wikitext-2.txt`` in ``folder``: 300 lines of words of a 37-word vocabulary (with ``<eos>``: 38)."""
    words = [f"w{i}" for i in range(37)]
    rng = random.Random(0)
    (folder / "data").mkdir(parents=True)
    (folder / "data" / "wikitext-2.txt").write_text(
        "".join(" ".join(rng.choices(words, k=12)) + "\n" for _ in range(300))
    )
    return folder


def fit(folder: Path, *args: str, check: bool = True):
    return run_cli("lightkeep", "fit", *args, cwd=folder, pythonpath=str(ENGINE), check=check)  # tests.faults


def last(folder: Path, family: str) -> dict:
    (run,) = run_dirs(folder, family)
    return torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)


def killed_and_resumed(
    tmp_path: Path, family: str, args: list[str], data=lambda folder: folder
) -> tuple[dict, dict, str]:
    """The uninterrupted run's and the resumed run's final last.ckpt, and the resumed run's start line."""
    reference, resumed = (data(tmp_path / name) for name in ("reference", "resumed"))
    for folder in (reference, resumed):
        folder.mkdir(exist_ok=True)
    fit(reference, *args)
    proc = fit(resumed, *args, *kill_at(17, settle=True), check=False)  # epoch 1, batch 5: step 15's last.ckpt
    assert proc.returncode != 0, proc.stderr[-3000:]
    saved = last(resumed, family)
    assert saved["global_step"] == 15 and saved["epoch"] == 1, "precondition: a mid-epoch last.ckpt"
    out = fit(resumed, *args, "--ckpt_path", "last").stdout
    start = next(line for line in out.splitlines() if line.startswith("Run "))
    return last(reference, family), last(resumed, family), start


def max_delta(ref: dict, got: dict) -> float:
    from tests.helpers import max_abs_diff

    assert got["global_step"] == ref["global_step"] == 24
    return max(max_abs_diff(ref["state_dict"], got["state_dict"]),
               max_abs_diff(ref["optimizer_states"], got["optimizer_states"]))  # fmt: skip


def exported_outputs_equal(folder: Path, family: str, *inputs: torch.Tensor, formats=("pt2", "pth")) -> None:
    """Exports of the run's last.ckpt, made in the run's folder as a user would (a module that loads its own data
    reads it from there), give the module's own outputs for ``inputs``."""
    os.chdir(folder)  # the test's own working folder comes back with pytest's monkeypatch (the callers' chdir)
    (run,) = run_dirs(folder, family)
    ckpt = run / "checkpoints" / "last.ckpt"
    module = lightning_model(ckpt)
    with torch.no_grad():
        expected = module(*inputs)
        for path in export(ckpt, folder / "export", formats):
            got = load_exported(path)(*inputs)
            assert got.shape == expected.shape and torch.allclose(got, expected, atol=1e-5), path.name


@pytest.mark.long  # CI and make test-all; make test kills and resumes a module of its own in test_existing_project.py
def test_boring_model_killed_mid_epoch_resumes_exactly_and_exports(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ref, got, start = killed_and_resumed(tmp_path, "boring", [*BORING, *EVERY_5])
    delta = max_delta(ref, got)
    print(f"BoringModel, 1 process: max |delta| {delta} | {start}")
    assert delta == 0.0
    assert "exact resume: resume verified" in start, start
    exported_outputs_equal(tmp_path / "resumed", "boring", torch.randn(3, 32))


@pytest.mark.long
def test_boring_model_on_two_ranks_killed_mid_epoch_resumes_exactly(tmp_path):
    # 12 batches of the 2 ranks' 64 samples: 32 a rank
    ref, got, start = killed_and_resumed(tmp_path, "boring", [*BORING, *EVERY_5, *DDP2])
    delta = max_delta(ref, got)
    print(f"BoringModel, 2 ranks: max |delta| {delta} | {start}")
    assert delta == 0.0
    assert "exact resume: resume verified" in start, start


@pytest.mark.long  # CI and make test-all
def test_lightning_transformer_with_its_own_data_resumes_exactly_and_exports_its_two_input_forward(
    tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    ref, got, start = killed_and_resumed(tmp_path, "lightning_transformer", [*TRANSFORMER, *EVERY_5], wikitext)
    delta = max_delta(ref, got)
    print(f"LightningTransformer, 1 process: max |delta| {delta} | {start}")
    assert delta == 0.0
    assert "exact resume: resume verified" in start, start
    tokens = torch.randint(0, 40, (2, 36), generator=torch.Generator().manual_seed(1))
    # pth only: torch.export stops in nn.Transformer itself, which checks its mask's values (in one line: "pt2 export
    # of ...LightningTransformer failed: forward branches on a tensor's value at transformer.py:78 ...")
    exported_outputs_equal(
        tmp_path / "resumed", "lightning_transformer", tokens[:, :-1], tokens[:, 1:], formats=["pth"]
    )
