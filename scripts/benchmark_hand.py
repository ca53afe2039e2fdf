"""Side (a) of scripts/benchmark.py: the blog's hand-written loop, in plain PyTorch (no Lightning is imported), run
by ``benchmark.py --worker``; and the digits loaders it shares with side (b), ``scripts/benchmark_lightning.py``.

DataLoader + DistributedSampler, AdamW, warmup-cosine schedule, tqdm, TensorBoard, a full training state saved every
2 epochs, validation after each epoch. ``write_result`` writes the measurements of every side in one format.
"""

import itertools
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any


def digits_splits(seed: int, val_fraction: float, test_fraction: float) -> dict[str, tuple[Any, Any]]:
    """The split of ``DigitsDataModule.setup``, written out so that this side never imports Lightning."""
    import torch
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0  # (N, 1, 8, 8)
    labels = torch.tensor(digits.target, dtype=torch.long)  # (N,)
    n = len(labels)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    n_val, n_test = int(n * val_fraction), int(n * test_fraction)
    parts = {"val": order[:n_val], "test": order[n_val : n_val + n_test], "train": order[n_val + n_test :]}
    return {name: (images[idx], labels[idx]) for name, idx in parts.items()}


def digits_loaders(spec: dict[str, Any]) -> tuple[Any, Any]:
    """The blog's train and validation loaders, shared by (a) and (b): the same batches in the same order."""
    import torch
    from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, SequentialSampler, TensorDataset

    class EpochBatchSampler(BatchSampler):
        """Lightning calls ``set_epoch`` on a loader's sampler: this passes it on to the DistributedSampler inside.
        The epoch's order is padded to whole batches with its first indices, as the template pads its order to
        the global batch (so that it is the same on any number of ranks): the same batches on every side."""

        def set_epoch(self, epoch: int) -> None:
            self.sampler.set_epoch(epoch)  # type: ignore[attr-defined]

        def __iter__(self):  # type: ignore[override]
            order = list(self.sampler)
            order += order[: -len(order) % self.batch_size]
            return iter([order[i : i + self.batch_size] for i in range(0, len(order), self.batch_size)])

        def __len__(self) -> int:
            return -(-len(self.sampler) // self.batch_size)  # type: ignore[arg-type]

    splits = digits_splits(spec["data_seed"], spec["val_fraction"], spec["test_fraction"])
    train_set, val_set = TensorDataset(*splits["train"]), TensorDataset(*splits["val"])
    # The blog's DistributedSampler, one replica: the same order as the template's, a pure function of (seed, epoch).
    # The seed is the run's (seed_everything), as the engine's sampler in the template's plain DataLoader takes it
    # (PL_GLOBAL_SEED, lightkeep.user_loaders), not the data module's, which seeds the split only.
    sampler = DistributedSampler(train_set, num_replicas=1, rank=0, shuffle=True, seed=spec["seed"])
    # A batch is one indexing op, train_set[list of indices], as in the template. As there too, each loader has a
    # generator of its own, so that its base seed never draws from the global RNG and dropout draws the same masks.
    bs = spec["batch_size"]
    train_batches = EpochBatchSampler(sampler, bs, drop_last=False)
    train_loader = DataLoader(train_set, sampler=train_batches, batch_size=None, generator=torch.Generator())
    val_sampler = BatchSampler(SequentialSampler(val_set), bs, drop_last=False)
    val_loader = DataLoader(val_set, sampler=val_sampler, batch_size=None, generator=torch.Generator())
    return train_loader, val_loader


def hand_written(spec: dict[str, Any], out: Path) -> None:
    import torch
    import torch.nn.functional as F
    from torch.utils.tensorboard import SummaryWriter
    from tqdm import tqdm

    from lightkeep.schedule import LinearWarmupCosineAnnealingLR
    from project.nets import MLP

    torch.manual_seed(spec["seed"])
    torch.use_deterministic_algorithms(spec["deterministic"])
    net = MLP(hidden_sizes=spec["hidden_sizes"], dropout=spec["dropout"])
    train_loader, val_loader = digits_loaders(spec)
    n_val = len(val_loader.dataset)
    # fused, as the template's example: the same optimizer kernel on every side
    optimizer = torch.optim.AdamW(net.parameters(), lr=spec["lr"], weight_decay=spec["weight_decay"], fused=True)
    warmup, total = spec["warmup"] * len(train_loader), spec["epochs"] * len(train_loader)
    scheduler = LinearWarmupCosineAnnealingLR(optimizer, warmup, total, spec["lr"] / max(warmup, 1), spec["eta_min"])
    writer = SummaryWriter("runs")
    os.makedirs("checkpoints")

    step, losses, val_acc, val_s, ckpt_s, first_step_at, step_ends = 0, [], [], 0.0, [], None, []
    start, start_cpu = time.perf_counter(), time.process_time()
    for epoch in range(spec["epochs"]):
        train_loader.sampler.set_epoch(epoch)
        net.train()
        loss_sum, correct, seen = torch.zeros(()), torch.zeros((), dtype=torch.long), 0
        for batch_idx, (x, y) in enumerate(tqdm(train_loader, desc=f"epoch {epoch}")):
            lr = optimizer.param_groups[0]["lr"]
            logits = net(x)  # (B, 10)
            loss = F.cross_entropy(logits, y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            scheduler.step()
            step += 1
            if first_step_at is None:
                first_step_at = time.time()
            losses.append(loss.detach())
            writer.add_scalar("train/loss", loss.item(), step)
            writer.add_scalar("lr", lr, step)
            loss_sum += loss.detach() * len(y)
            correct += (logits.argmax(-1) == y).sum()
            seen += len(y)
            step_ends.append((batch_idx, time.perf_counter()))
        writer.add_scalar("train/loss_epoch", (loss_sum / seen).item(), step)
        writer.add_scalar("train/acc", (correct / seen).item(), step)

        val_start = time.perf_counter()
        net.eval()
        loss_sum, correct = torch.zeros(()), torch.zeros((), dtype=torch.long)
        with torch.no_grad():
            for x, y in tqdm(val_loader, desc="validation", leave=False):
                logits = net(x)
                loss_sum += F.cross_entropy(logits, y, reduction="sum")
                correct += (logits.argmax(-1) == y).sum()
        acc = (correct / n_val).item()
        writer.add_scalar("val/loss", (loss_sum / n_val).item(), step)
        writer.add_scalar("val/acc", acc, step)
        val_acc.append((acc, time.time()))
        val_s += time.perf_counter() - val_start

        if (epoch + 1) % 2 == 0:
            ckpt_start = time.perf_counter()
            state = {
                "net": net.state_dict(),
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "epoch": epoch,
                "step": step,
            }
            torch.save(state, f"checkpoints/epoch{epoch:03d}.pth")
            ckpt_s.append(time.perf_counter() - ckpt_start)
    train_s, train_cpu_s = time.perf_counter() - start, time.process_time() - start_cpu
    writer.close()
    losses = torch.stack(losses).tolist()
    write_result(out, step, train_s, train_cpu_s, val_s, ckpt_s, first_step_at, losses, val_acc, step_ends)


def write_result(
    out: Path,
    steps,
    train_s,
    train_cpu_s,
    val_s,
    ckpt_s,
    first_step_at,
    losses,
    val_acc,
    step_ends,
    phases: dict[str, float] | None = None,
) -> None:
    import torch

    # A step's time: from one batch's end to the next's, within an epoch (the first batch of an epoch also holds
    # the previous one's validation and saves, timed apart). Unlike the total, the median is not moved by the few
    # steps that a burst of load from elsewhere on a shared machine slows down.
    step_s = [t - prev for (_, prev), (i, t) in itertools.pairwise(step_ends) if i > 0]

    result = {
        "pid": os.getpid(),
        "phases": phases or {},
        "steps": steps,
        "train_s": train_s,
        "train_cpu_s": train_cpu_s,
        "val_s": val_s,
        "ckpt_s": ckpt_s,
        "first_step_at": first_step_at,
        "losses": losses,
        "val_acc": val_acc,
        "step_s": statistics.median(step_s) if step_s else None,
        "threads": torch.get_num_threads(),
    }
    out.write_text(json.dumps(result))
