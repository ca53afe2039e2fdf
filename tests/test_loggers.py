"""ThrottledTensorBoardLogger holds values back between flushes and writes every one of them, in order."""

from project.engine.loggers import ThrottledTensorBoardLogger
from tests.conftest import scalars


def test_values_wait_until_a_flush_then_all_are_written_in_order(tmp_path):
    logger = ThrottledTensorBoardLogger(save_dir=str(tmp_path), name="t", flush_seconds=3600, default_hp_metric=False)
    logger.save()  # the first save flushes (nothing held yet) and starts the interval
    for step in range(5):
        logger.log_metrics({"train/loss": 1.0 / (step + 1)}, step=step)
        logger.save()  # what Lightning calls after each log_metrics: within the interval, nothing is handed over
    assert "train/loss" not in scalars(tmp_path / "t" / "version_0")
    logger.flush()  # what ExactResume calls at each checkpoint and epoch start
    logger.log_metrics({"train/loss": 0.1}, step=5)
    logger.finalize("success")  # the end of the run writes the rest
    expected = [(step, 1.0 / (step + 1)) for step in range(5)] + [(5, 0.1)]
    got = scalars(tmp_path / "t" / "version_0")["train/loss"]
    assert [s for s, _ in got] == [s for s, _ in expected]
    assert all(abs(v - e) < 1e-7 for (_, v), (_, e) in zip(got, expected, strict=True))
