"""Side (c) of scripts/benchmark.py: ``BenchmarkTimer``, the one callback the template's real CLI gets (class path
``benchmark_timer.BenchmarkTimer``); side (b), scripts/benchmark_lightning.py, is timed by it too. In a module of its
own so that the driver and the hand-written side never load Lightning.
"""

import cProfile
import time
from pathlib import Path
from typing import Any

import lightning as L
from benchmark_hand import write_result  # scripts/benchmark_hand.py, on the path benchmark.py gives the runs


class BenchmarkTimer(L.Callback):
    """Benchmark only: times training, validation and each checkpoint save, keeps each step's loss.

    Args:
        out: Where to write the measurements as JSON, at the end of training.
        profile: Run cProfile over the training span and dump its stats next to ``out``.
    """

    def __init__(self, out: str, profile: bool = False) -> None:
        # Start-up phases, as wall-clock times: this callback is built once the command line is parsed and the
        # config read (the template's CLI instantiates it with the Trainer), before any data is touched.
        self.phases = {"built": time.time()}
        self.out, self.profile = Path(out), profile
        self.losses: list[Any] = []
        self.val_acc: list[tuple[float, float]] = []
        self.ckpt_s: list[float] = []
        self.val_s = 0.0
        self.first_step_at: float | None = None
        self.step_ends: list[tuple[int, float]] = []

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        save = trainer.save_checkpoint

        def timed_save(*args: Any, **kwargs: Any) -> None:
            start = time.perf_counter()
            save(*args, **kwargs)
            self.ckpt_s.append(time.perf_counter() - start)

        trainer.save_checkpoint = timed_save  # ModelCheckpoint saves through this attribute
        self.phases["set_up"] = time.time()  # after the strategy's and the data module's setup

    def on_sanity_check_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.phases["sanity_start"] = time.time()

    def on_sanity_check_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.phases["sanity_end"] = time.time()

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.profiler = cProfile.Profile() if self.profile else None
        if self.profiler:
            self.profiler.enable()
        self.start, self.start_cpu = time.perf_counter(), time.process_time()
        self.phases["train_start"] = time.time()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # type: ignore[no-untyped-def]
        if self.first_step_at is None:
            self.first_step_at = time.time()
        self.losses.append(outputs["loss"].detach())
        self.step_ends.append((batch_idx, time.perf_counter()))

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.val_start = time.perf_counter()

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Runs before the ModelCheckpoints' hook (Lightning moves those last), so saves are not counted here.
        if not trainer.sanity_checking:
            self.val_s += time.perf_counter() - self.val_start
            if "val/acc" in trainer.callback_metrics:
                self.val_acc.append((float(trainer.callback_metrics["val/acc"]), time.time()))

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        train_s, train_cpu_s = time.perf_counter() - self.start, time.process_time() - self.start_cpu
        if self.profiler:
            self.profiler.disable()
            self.profiler.dump_stats(self.out.with_suffix(".prof"))
        import torch

        losses = torch.stack(self.losses).tolist()
        timings = (train_s, train_cpu_s, self.val_s, self.ckpt_s, self.first_step_at)
        write_result(self.out, trainer.global_step, *timings, losses, self.val_acc, self.step_ends, self.phases)
