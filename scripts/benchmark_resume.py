"""Resume cost: launch to the first resumed optimizer step, at 10% and at 90% of an epoch, with a slow data set.

    python scripts/benchmark_resume.py [--delay-ms 5] [--repeats 3] [--at 0.1 0.9]

Each sample of the digits costs ``--delay-ms`` to load (a sleep in ``__getitem__``, as a decoded image or a read
from a network disk would). For each point of the epoch: a run stops there (``--trainer.max_steps``; its end of
fit writes ``last.ckpt``, mid-epoch), then ``--ckpt_path last`` resumes it for one step, timed from launch to the end
of that step. A fresh run's first step is the baseline. A loader that replayed the consumed batches to find its
place would pay their loading (the last column) before the first step; the template's sampler skips their indices
without loading them, so the resume costs the same at 10% and at 90%. Rounds alternate the points (10 90 fresh,
fresh 90 10, ...) and the figures are medians. Exits 1 unless every resume started at the batch it stopped at.
"""

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
QUIET = ["--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false"]

if __name__ != "__main__":  # imported by the CLI (class paths benchmark_resume.SlowDigits, ...)
    import lightning as L
    from torch.utils.data import Dataset

    from project.data import DigitsDataModule

    class SlowDataset(Dataset):
        """``dataset`` with each sample taking ``delay`` seconds to load."""

        def __init__(self, dataset: Dataset, delay: float) -> None:
            self.dataset, self.delay = dataset, delay

        def __len__(self) -> int:
            return len(self.dataset)  # type: ignore[arg-type]

        def __getitem__(self, index: int) -> Any:
            time.sleep(self.delay)
            return self.dataset[index]

    class SlowDigits(DigitsDataModule):
        """The digits, each training sample ``delay_ms`` slow to load.

        Args:
            delay_ms: Milliseconds each training sample takes to load.
        """

        def __init__(self, delay_ms: float = 5.0, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.delay_ms = delay_ms

        def setup(self, stage: str) -> None:
            if not self.splits:
                super().setup(stage)
                self.splits["train"] = SlowDataset(self.splits["train"], self.delay_ms / 1000)

    class FirstStepTimer(L.Callback):
        """Writes, after the first optimizer step of this process: when it ended and which batch of which epoch it
        was.

        Args:
            out: The JSON file to write.
        """

        def __init__(self, out: str) -> None:
            self.out, self.done = Path(out), False

        def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx):  # type: ignore[no-untyped-def]
            if not self.done:
                self.done = True
                record = {"at": time.time(), "batch_idx": batch_idx, "epoch": trainer.current_epoch}
                self.out.write_text(json.dumps(record))


def fit(workdir: Path, *args: str) -> dict[str, Any]:
    """``python -m project fit`` in ``workdir`` with the slow digits; launch to first step, and where it was."""
    out = workdir / "first_step.json"
    out.unlink(missing_ok=True)
    timer = {"class_path": "benchmark_resume.FirstStepTimer", "init_args": {"out": str(out)}}
    cmd = [sys.executable, "-m", "project", "fit", "--config", str(REPO / "configs" / "default.yaml"), *QUIET]
    cmd += ["--trainer.num_sanity_val_steps", "0", *args, f"--trainer.callbacks+={json.dumps(timer)}"]
    path = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p] + [str(REPO), str(REPO / "scripts")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path), "PYTHONWARNINGS": "ignore"}
    launched = time.time()
    proc = subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"exit {proc.returncode}: {' '.join(cmd)}\n{proc.stderr[-3000:]}")
    record = json.loads(out.read_text())
    return {"first_step_s": record["at"] - launched, "batch_idx": record["batch_idx"], "epoch": record["epoch"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--delay-ms", type=float, default=5.0, help="load time of one training sample (default 5)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds (default 3)")
    parser.add_argument("--at", type=float, nargs="+", default=[0.1, 0.9], help="points of the epoch to resume at")
    args = parser.parse_args(argv)
    if any(not 0 < at < 1 for at in args.at):
        parser.error(f"--at {args.at}: each point must be inside the epoch, between 0 and 1")
    data = ["--data", "benchmark_resume.SlowDigits", "--data.delay_ms", str(args.delay_ms)]
    sys.path.insert(0, str(REPO))
    from project.data import DigitsDataModule  # the default config's data, with its default splits and batch

    digits = DigitsDataModule()
    digits.setup("fit")
    batch_size = digits.hparams.batch_size
    steps_per_epoch = math.ceil(len(digits.splits["train"]) / batch_size)
    points = {at: max(1, round(at * steps_per_epoch)) for at in args.at}
    results: dict[Any, list[dict[str, Any]]] = {at: [] for at in [*args.at, "fresh"]}
    order = [*args.at, "fresh"]
    with tempfile.TemporaryDirectory(prefix="benchmark-resume-") as tmp:
        for i in range(args.repeats):
            for at in order if i % 2 == 0 else order[::-1]:
                workdir = Path(tmp) / f"{i}-{at}"
                workdir.mkdir()
                if at == "fresh":
                    results[at].append(fit(workdir, *data, "--trainer.max_steps", "1"))
                else:
                    step = points[at]
                    fit(workdir, *data, "--trainer.max_steps", str(step))
                    got = fit(workdir, *data, "--trainer.max_steps", str(step + 1), "--ckpt_path", "last")
                    got["expected_batch_idx"] = step
                    results[at].append(got)
                print(f"round {i + 1}/{args.repeats} {at}: {results[at][-1]['first_step_s']:.2f} s", file=sys.stderr)

    batch_load_s = batch_size * args.delay_ms / 1000
    print(f"\nMLP default config, batch {batch_size}, {steps_per_epoch} steps an epoch, {args.delay_ms:g} ms a sample "
          f"({batch_load_s:.2f} s a batch), {args.repeats} round(s); medians")  # fmt: skip
    print(f"{'':<30}{'launch to first step s':>24}{'replaying the skipped batches would add s':>44}")
    fresh = statistics.median(r["first_step_s"] for r in results["fresh"])
    print(f"{'fresh run (step 0)':<30}{fresh:>24.2f}{'':>44}")
    exact = True
    summary: dict[str, Any] = {"fresh_s": fresh, "resume_s": {}}
    for at in args.at:
        med = statistics.median(r["first_step_s"] for r in results[at])
        exact &= all(r["batch_idx"] == r["expected_batch_idx"] and r["epoch"] == 0 for r in results[at])
        label = f"resumed at {at:.0%} (step {points[at]})"
        print(f"{label:<30}{med:>24.2f}{points[at] * batch_load_s:>44.2f}")
        summary["resume_s"][str(at)] = med
    first, last = (summary["resume_s"][str(at)] for at in (args.at[0], args.at[-1]))
    print(f"resumed at {args.at[-1]:.0%} / at {args.at[0]:.0%}: {last / first:.3f}; every resume started at the batch "
          f"it stopped at: {exact}")  # fmt: skip
    summary["runs"] = {str(at): runs for at, runs in results.items()}
    print(json.dumps(summary))
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
