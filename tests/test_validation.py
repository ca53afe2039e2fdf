"""The example's sample predictions under DDP: rank zero writes them, once."""

import pytest

from tests.helpers import DDP2, QUIET, cli, run_dirs

pytestmark = pytest.mark.slow  # DDP: subprocesses


@pytest.mark.long  # CI and make test-all; a fit, then a validation on 2 ranks
def test_rank_zero_writes_sample_predictions_once(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    train, validate = tmp_path / "train", tmp_path / "validate"
    train.mkdir()
    validate.mkdir()
    cli("fit", *QUIET, "--trainer.max_epochs", "1", "--trainer.limit_train_batches", "4", "--trainer.limit_val_batches",
        "1", cwd=train)  # fmt: skip
    (trained,) = run_dirs(train, "digits")
    checkpoint = trained / "checkpoints" / "last.ckpt"
    cli("validate", *QUIET, *DDP2, "--ckpt_path", str(checkpoint), cwd=validate, timeout=240)
    (run,) = run_dirs(validate, "digits")
    assert len(list(run.glob("events.out.tfevents.*"))) == 1
    events = EventAccumulator(str(run), size_guidance={"images": 0, "tensors": 0})
    events.Reload()
    assert events.Tags()["images"] == ["val/samples"] and len(events.Images("val/samples")) == 1
    table = events.Tensors("val/predictions/text_summary")[0].tensor_proto.string_val[0].decode()
    assert len(table.splitlines()) == 2 + 16  # header, separator, 16 samples (sample_images' default)
