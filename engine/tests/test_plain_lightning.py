"""A project that used plain Lightning brings its checkpoints: one written by ``Trainer.fit`` without the engine is
validated, tested, predicted, exported and resumed by the engine's CLI (the resume said to be inexact: no engine
state), with plain Lightning's own numbers for the same checkpoint as the oracle."""

from pathlib import Path

import lightning as L
import pytest
import torch

from lightkeep.checkpoint_files import load_checkpoint_file
from lightkeep.export.formats import example_inputs
from tests.fixtures.stand_in import BlobsDataModule, StandIn
from tests.helpers import PYTHONPATH, QUIET, REPO, cli, cli_in_process

SMALL = ["--model.net.init_args.hidden_sizes", "[32]", "--model.lr", "0.01"]


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """A checkpoint of plain Lightning (no CLI, no engine) of a non-default StandIn, and plain Lightning's own
    validation, test and predictions of it: ``{"val/acc": ..., "test/loss": ..., "prob": (N, 10) tensor}``."""
    from tests.fixtures.stand_in import MLP

    folder = tmp_path_factory.mktemp("plain")
    L.seed_everything(0)
    model, data = StandIn(net=MLP(hidden_sizes=[32]), lr=0.01), BlobsDataModule()
    trainer = L.Trainer(max_epochs=1, limit_train_batches=3, limit_val_batches=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    trainer.fit(model, data)
    trainer.save_checkpoint(folder / "plain.ckpt")
    evaluator = L.Trainer(logger=False, enable_progress_bar=False, enable_model_summary=False)
    (metrics,) = evaluator.validate(model, data, verbose=False)  # the oracle: plain Lightning's own numbers
    (tested,) = evaluator.test(model, data, verbose=False)
    predicted = evaluator.predict(model, data)  # the test split, in dataset order (predict_dataloader: no shuffle)
    return folder, {**metrics, **tested, "prob": torch.cat([batch["prob"] for batch in predicted])}


@pytest.mark.slow
def test_validate_and_resume_a_plain_lightning_checkpoint(plain, tmp_path, capsys):
    folder, oracle = plain
    ckpt = folder / "plain.ckpt"
    assert "_class_path" not in load_checkpoint_file(ckpt)["hyper_parameters"]  # the precondition: not the CLI's
    proc = cli("validate", *QUIET, *SMALL, "--ckpt_path", str(ckpt), cwd=tmp_path, check=False)
    assert proc.returncode == 0 and "Parsing of ckpt_path" not in proc.stderr, proc.stderr[-2000:]
    logged = {line.split()[1]: float(line.split()[3]) for line in proc.stdout.splitlines()
              if line.startswith("│") and "val/" in line}  # fmt: skip
    assert logged["val/acc"] == pytest.approx(oracle["val/acc"], rel=1e-6), (logged, oracle)
    assert logged["val/loss"] == pytest.approx(oracle["val/loss"], rel=1e-6), (logged, oracle)

    # the validate above is a process: its stderr (no "Parsing of ckpt_path" warning) and its printed table are read;
    # the fit is read by its start line and files: the real CLI in this process
    capsys.readouterr()
    cli_in_process("fit", *QUIET, *SMALL, "--trainer.max_epochs", "2", "--trainer.limit_train_batches", "3",
                   "--trainer.limit_val_batches", "2", "--ckpt_path", str(ckpt), root=tmp_path / "runs")  # fmt: skip
    (line,) = [line for line in capsys.readouterr().out.splitlines() if "exact resume:" in line]
    # the plain run stepped the schedule with no fitting to its length (pl_bolts' counts in steps); the engine fits
    # it to this run, so the rate the resume starts at is not the checkpoint's, which the start line says first
    assert "exact resume: no: optimizer 0's param group 0 resumes at learning rate" in line, line
    assert "holds no resume state of the engine's" in line, line
    (last,) = tmp_path.glob("runs/*/version_*/checkpoints/last.ckpt")
    assert load_checkpoint_file(last)["global_step"] == 6  # continued from the plain run's 3 steps


def test_test_and_predict_a_plain_lightning_checkpoint_give_plain_lightnings_numbers(plain, tmp_path):
    folder, oracle = plain
    ckpt = str(folder / "plain.ckpt")
    assert "_class_path" not in load_checkpoint_file(ckpt)["hyper_parameters"]  # the precondition: not the CLI's
    tested = cli_in_process("test", *QUIET, *SMALL, "--ckpt_path", ckpt, root=tmp_path)
    logged = {k: v.item() for k, v in tested.trainer.callback_metrics.items() if k.startswith("test/")}
    expected = {k: oracle[k] for k in logged}
    print(f"test of a plain checkpoint: engine {logged}, plain Lightning {expected}")
    assert logged.keys() == {"test/acc", "test/loss"}, logged
    for key in logged:
        assert logged[key] == pytest.approx(oracle[key], rel=1e-6), (key, logged, oracle)

    predicted = cli_in_process("predict", *QUIET, *SMALL, "--ckpt_path", ckpt, root=tmp_path)
    run = Path(predicted.trainer.default_root_dir)
    saved = torch.load(run / "predictions.pt", weights_only=True)
    probs = oracle["prob"]  # plain Lightning's predict of the same checkpoint: the module's own outputs
    header, *rows = (run / "predictions.csv").read_text().splitlines()
    written = torch.tensor([[float(v) for v in row.split(",")[2:]] for row in rows])
    delta_pt, delta_csv = (saved["prob"] - probs).abs().max().item(), (written - probs).abs().max().item()
    print(f"predict of a plain checkpoint: {len(rows)} rows, max |delta| vs plain Lightning: pt {delta_pt:.3g}, "
          f"csv {delta_csv:.3g}")  # fmt: skip
    assert header.split(",")[:2] == ["index", "pred"] and len(rows) == len(probs) > 0
    assert saved["index"].tolist() == list(range(len(probs)))  # every sample once, in dataset order
    assert delta_pt <= 1e-6 and delta_csv <= 1e-6
    assert torch.equal(saved["pred"], probs.argmax(-1))


@pytest.mark.slow
@pytest.mark.long  # CI and make test-all
def test_export_a_plain_lightning_checkpoint_with_a_config_naming_its_class(plain, tmp_path):
    import subprocess
    import sys

    folder, _ = plain
    config = tmp_path / "model.yaml"
    config.write_text("model:\n  class_path: tests.fixtures.stand_in.StandIn\n  init_args:\n    net:\n"
                      "      class_path: tests.fixtures.stand_in.MLP\n      init_args: {hidden_sizes: [32]}\n"
                      "data: tests.fixtures.stand_in.BlobsDataModule\n")  # fmt: skip
    export = [sys.executable, str(REPO / "scripts" / "export.py"), str(folder / "plain.ckpt"), "--format", "pth"]
    env = {"PYTHONPATH": PYTHONPATH}
    refused = subprocess.run([*export, "--out", str(tmp_path / "a")], env=env, capture_output=True, text=True)
    assert refused.returncode == 2 and "give --config FILE" in refused.stderr, refused.stderr
    done = subprocess.run([*export, "--out", str(tmp_path / "b"), "--config", str(config)], env=env,
                          capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    # the net comes from the config (StandIn leaves it out of save_hyperparameters), lr from the checkpoint's
    saved = load_checkpoint_file(folder / "plain.ckpt")["state_dict"]
    written = torch.load(tmp_path / "b" / "model.pth", weights_only=True)
    assert written.keys() == saved.keys() and all(torch.equal(written[k], v) for k, v in saved.items())


class TwoInputs(L.LightningModule):
    """Lightning's demo transformer's shape: ``forward(inputs, target)`` called by its only step, ``training_step``,
    on its only loader's batches."""

    def forward(self, inputs: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return inputs * target

    def training_step(self, batch: tuple[torch.Tensor, ...], batch_idx: int) -> torch.Tensor:
        inputs, target, _ = batch
        return self(inputs, target).sum()


def test_a_forward_of_two_inputs_is_traced_on_what_training_step_gives_it(monkeypatch):
    batch = (torch.arange(6.0).reshape(3, 2), torch.ones(3, 2), torch.zeros(3))

    class Data(L.LightningDataModule):
        def train_dataloader(self):
            return [batch]

    import lightkeep.export.formats as export

    monkeypatch.setattr(export, "build", lambda recipe, kind: Data())
    (args, kwargs), said = example_inputs(TwoInputs(), {"data": "x.Data"})
    assert len(args) == 2 and torch.equal(args[0], batch[0][:2]) and torch.equal(args[1], batch[1][:2]), args
    assert kwargs == {}
    assert said == "what training_step gives it on a batch of train_dataloader: forward(Tensor[2, 2], Tensor[2, 2])"
