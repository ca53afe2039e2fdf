"""scripts/plot_run.py: the curves of a real run, read back from its TensorBoard events, in one PNG."""

import importlib.util
import re
import subprocess
import sys

import pytest
import torch

from tests.helpers import QUIET, REPO, cli_in_process, run_dirs, scalars

pytest.importorskip("matplotlib", reason='plot_run.py needs the plot extra: pip install -e ".[plot]"')
from matplotlib.image import imread  # only once matplotlib is known to be there

pytestmark = pytest.mark.slow  # a real fit (the CLI in this process) and scripts/plot_run.py in a subprocess

SCRIPT = REPO / "scripts" / "plot_run.py"
spec = importlib.util.spec_from_file_location("plot_run", SCRIPT)
plot_run = importlib.util.module_from_spec(spec)
spec.loader.exec_module(plot_run)


def test_png_of_a_real_run_from_its_events(workdir):
    # every step logged (the default logs every 50th: fewer host syncs), as a user wanting per-step curves asks
    cli_in_process("fit", *QUIET, "--trainer.max_epochs", "2", "--trainer.limit_train_batches", "4",
                   "--trainer.log_every_n_steps", "1", root=workdir / "runs")  # fmt: skip
    (run,) = run_dirs(workdir)
    out = workdir / "figs" / "curves.png"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), str(run), "--out", str(out), "--dpi", "50"], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"wrote {out}"
    image = imread(out)  # a PNG matplotlib can read back: 3 panels, 15 x 4 inches
    assert image.shape[:2] == (4 * 50, 15 * 50)
    assert image[..., :3].std() > 0.05  # curves drawn, not a blank canvas

    curves = plot_run.load_curves(run)
    steps = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["global_step"]
    assert curves["train/loss"][0] == curves["lr"][0] == list(range(steps))
    assert len(curves["val/acc"][0]) == 2
    logged = scalars(run)
    for tag in ("train/loss", "lr", "val/loss", "val/acc", "train/acc"):
        assert list(zip(*curves[tag], strict=True)) == logged[tag]


def test_a_resumed_runs_repeated_steps_keep_the_latest_value(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    for values in ([0.5, 0.6, 0.7], [None, 0.65, 0.75, 0.8]):  # the second file: a resume from step 1
        with SummaryWriter(tmp_path) as writer:
            for step, value in enumerate(values):
                if value is not None:
                    writer.add_scalar("val/acc", value, step)
    steps, values = plot_run.load_curves(tmp_path)["val/acc"]
    assert steps == [0, 1, 2, 3] and values == pytest.approx([0.5, 0.65, 0.75, 0.8])


def test_a_folder_without_events_is_refused_with_a_hint(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path)], capture_output=True, text=True)
    assert proc.returncode == 1 and re.search(r"give a run folder like runs/<name>/version_0", proc.stderr), proc.stderr
