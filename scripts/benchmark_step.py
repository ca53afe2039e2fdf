"""Where a training step's time goes: the bare PyTorch step, and what Lightning and the template add to it.

    python scripts/benchmark_step.py                       # hidden 256, the default config's net
    python scripts/benchmark_step.py --hidden 2048 --repeats 5

``scripts/benchmark.py`` times whole runs against each other; this splits a step into its pieces, in one process
(1 torch thread), each a median over steps and then over alternating repetitions, so that the README's account of
the template's extra time per step can be checked:

- the **bare step**: forward, backward and AdamW of the MLP on a batch from a DataLoader, in plain PyTorch (the
  hand-written loop's compute);
- **Lightning's loop**: ``Trainer.fit`` of a minimal LightningModule (the same net and AdamW; no logger, callback,
  checkpoint, schedule or metric), and of the template's ``Classifier`` (torchmetrics updates, ``self.log``, the
  warmup-cosine schedule), step medians against the bare step's;
- the **NaN guard** (``StopOnNonFinite``): its read of every gradient, alone;
- **``self.log``'s move of its stored result**, Lightning's against the engine's skip, per call;
- **a hook's profiling context**, Lightning's ``PassThroughProfiler`` against the engine's ``NoProfiler``, per
  hook call, and how many a step makes with the template's callbacks.

Every side runs with what ``python -m project`` sets up first: the engine's malloc thresholds and its skip of
``self.log``'s moves (the ``Classifier`` fit also with ``NoProfiler``).
"""

import argparse
import itertools
import logging
import statistics
import sys
import time
import timeit
import unittest.mock
from collections.abc import Callable
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightkeep.compat_logging import skip_moves_already_done
from lightkeep.speed.host_memory import keep_freed_host_memory
from lightkeep.speed.profiler import NoProfiler
from project.module import Classifier
from project.nets import MLP


def batches(steps: int, batch_size: int) -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    x = torch.rand(steps * batch_size, 1, 8, 8, generator=generator)  # (N, 1, 8, 8), digits-shaped
    y = torch.randint(0, 10, (steps * batch_size,), generator=generator)  # (N,)
    return DataLoader(TensorDataset(x, y), batch_size=batch_size)


def seeded_net(hidden: list[int]) -> torch.nn.Module:
    torch.manual_seed(0)  # the same weights, and then the same dropout masks, on every side
    return MLP(hidden_sizes=hidden)


def bare_step_s(hidden: list[int], loader: DataLoader, losses: list[float]) -> float:
    """Median step of the plain PyTorch loop, batch end to batch end; each step's loss into ``losses``."""
    net = seeded_net(hidden)
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)
    ends, step_losses = [], []
    for x, y in loader:
        loss = F.cross_entropy(net(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        step_losses.append(loss.detach())
        ends.append(time.perf_counter())
    losses[:] = torch.stack(step_losses).tolist()
    return _median_step(ends)


class Minimal(L.LightningModule):
    """The least a LightningModule can be: the net, its loss, AdamW; each step's loss into ``losses``."""

    def __init__(self, net: torch.nn.Module, losses: list[float]) -> None:
        super().__init__()
        self.net, self.losses, self.step_losses = net, losses, []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.step_losses.append(loss.detach())
        return loss

    def on_train_end(self) -> None:
        self.losses[:] = torch.stack(self.step_losses).tolist()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class StepEnds(L.Callback):
    def __init__(self) -> None:
        self.ends: list[float] = []

    def on_train_batch_end(self, *_: Any) -> None:
        self.ends.append(time.perf_counter())


class CountingProfiler(NoProfiler):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def profile(self, action_name: str) -> Any:
        self.calls += 1
        return super().profile(action_name)


def lightning_step_s(module: L.LightningModule, loader: DataLoader, profiler: Any = None) -> float:
    """Median step of ``Trainer.fit``, batch end to batch end, without logger, checkpoints or progress bar."""
    timer = StepEnds()
    trainer = L.Trainer(max_epochs=1, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        callbacks=[timer], profiler=profiler)  # fmt: skip
    trainer.fit(module, loader)
    return _median_step(timer.ends)


def _median_step(ends: list[float]) -> float:
    steps = [b - a for a, b in itertools.pairwise(ends)]
    return statistics.median(steps[len(steps) // 5 :])  # the first fifth warms up


def per_call_s(fn: Callable[[], Any], number: int) -> float:
    return min(timeit.repeat(fn, number=number, repeat=5)) / number


def gradients_finite(optimizer: Any) -> bool:
    """Whether every gradient of ``optimizer``'s parameters is finite, read on the host at once (a device sync): what
    the NaN guard's read of every gradient costs."""
    grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    return not grads or bool(torch.isfinite(torch.stack([g.detach().sum(dtype=torch.float32) for g in grads]).sum()))


def guard_s(hidden: list[int], loader: DataLoader) -> float:
    net = MLP(hidden_sizes=hidden)
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)
    x, y = next(iter(loader))
    F.cross_entropy(net(x), y).backward()
    return statistics.median(per_call_s(lambda: gradients_finite(optimizer), 3) for _ in range(5))


def log_move_s() -> tuple[float, float]:
    """One ``self.log`` result's move to its device: Lightning's own, and with the engine's skip."""
    from lightning.pytorch.trainer.connectors.logger_connector.result import _ResultCollection, _ResultMetric

    skip_moves_already_done()
    skipping = _ResultMetric.to
    results = _ResultCollection(training=True)
    value = torch.tensor(1.0)
    results.log("training_step", "train/loss", value, on_step=True, on_epoch=False)
    result = results["training_step.train/loss"]
    own = per_call_s(lambda: skipping.__wrapped__(result, value.device), 200)
    skipped = per_call_s(lambda: skipping(result, value.device), 2000)
    return own, skipped


def profile_context_s() -> tuple[float, float]:
    from lightning.pytorch.profilers import PassThroughProfiler

    def enter(profiler: Any) -> Callable[[], None]:
        def once() -> None:
            with profiler.profile("[Callback]ModelCheckpoint.on_train_batch_end"):
                pass

        return once

    return per_call_s(enter(PassThroughProfiler()), 5000), per_call_s(enter(NoProfiler()), 5000)


def contexts_per_step(hidden: list[int], loader: DataLoader) -> float:
    """Profiling contexts a training step enters with the callbacks ``python -m project fit`` runs with."""
    import contextlib
    import io
    import tempfile

    from project.__main__ import main as cli_main  # python -m project: its base config

    with unittest.mock.patch.object(sys, "argv", sys.argv[:1]):  # the CLI parses its args, not this script's
        cli = cli_main(["--trainer.logger", "false", "--trainer.enable_progress_bar", "false"], run=False)
    assert cli is not None
    profiler, counts = CountingProfiler(), []

    class Count(L.Callback):
        def on_train_batch_end(self, *_: Any) -> None:
            counts.append(profiler.calls)

    with tempfile.TemporaryDirectory() as root, contextlib.redirect_stdout(io.StringIO()):
        trainer = L.Trainer(max_epochs=1, limit_train_batches=20, limit_val_batches=2, logger=False,
                            enable_progress_bar=False, default_root_dir=root, profiler=profiler,
                            callbacks=[*cli.trainer.callbacks, Count()])  # fmt: skip
        trainer.fit(Classifier(MLP(hidden_sizes=hidden), warmup=1), loader, loader)
    return (counts[-1] - counts[0]) / (len(counts) - 1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=256, help="width of both hidden layers (default: 256)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="alternating repetitions (default: 3)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    keep_freed_host_memory()  # as python -m project does: every side below runs with it
    skip_moves_already_done()
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    hidden = [args.hidden, args.hidden]
    steps = 300 if args.hidden <= 512 else 60
    loader = batches(steps, args.batch_size)

    bare_losses: list[float] = []
    lightning_losses: list[float] = []
    sides: dict[str, Callable[[], float]] = {
        "bare PyTorch step": lambda: bare_step_s(hidden, loader, bare_losses),
        "Lightning, minimal module": lambda: lightning_step_s(Minimal(seeded_net(hidden), lightning_losses), loader),
        "Lightning, the template's Classifier": lambda: lightning_step_s(
            Classifier(MLP(hidden_sizes=hidden), warmup=1), loader, NoProfiler()
        ),
    }
    times: dict[str, list[float]] = {name: [] for name in sides}
    for side in sides.values():
        side()  # warm-up, not counted
    for i in range(args.repeats):
        for name in sides if i % 2 == 0 else list(sides)[::-1]:
            times[name].append(sides[name]())
            print(f"repetition {i + 1}/{args.repeats}, {name}: {1e3 * times[name][-1]:.2f} ms", file=sys.stderr)

    bare = statistics.median(times["bare PyTorch step"])
    print(f"\nMLP {hidden}, batch {args.batch_size}, {steps} steps, 1 thread, {args.repeats} repetitions (medians)")
    for name, ts in times.items():
        t = statistics.median(ts)
        extra = "" if t is bare else f"  {1e3 * (t - bare):+7.2f} ms ({100 * (t - bare) / bare:+.1f}%)"
        print(f"  {name:<40}{1e3 * t:8.2f} ms ({1e3 * min(ts):.2f}-{1e3 * max(ts):.2f}){extra}")
    # the oracle of a fair comparison: the bare loop and the minimal module take the same steps with the same losses
    same = len(bare_losses) == len(lightning_losses) == steps and bare_losses == lightning_losses
    print(f"  same steps and losses, bare and minimal Lightning: {same}")
    guard = guard_s(hidden, loader)
    share = f"{100 * guard / bare:.1f}% of a bare step"
    print(f"  {'NaN guard, one read of every gradient':<40}{1e3 * guard:8.2f} ms ({share})")
    own, skipped = log_move_s()
    print(f"  {'self.log, moving its stored result':<40}{1e6 * own:8.1f} us a call; {1e6 * skipped:.1f} us skipped")
    lightnings, ours = profile_context_s()
    per_step = contexts_per_step(hidden, loader)
    print(
        f"  {'profiling context of a hook call':<40}{1e6 * lightnings:8.2f} us; {1e6 * ours:.2f} us as NoProfiler, "
        f"{per_step:.0f} a step with the template's callbacks: {1e6 * per_step * (lightnings - ours):.0f} us a step"
    )
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
