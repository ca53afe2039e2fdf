"""What seeding each training sample from (seed, epoch, index) costs (``--run.seed_per_sample``, on by default):
microseconds per sample fetched in a loader worker, with and without it, side by side; median of 7 repeats.

    python scripts/benchmark_sample_seeds.py
"""

import statistics
import time

import torch
from torch.utils.data import TensorDataset

from lightkeep.sample_seeds import seed_per_sample

SAMPLES = 20_000


def per_sample_us(dataset: TensorDataset, keys: list[int]) -> float:
    start = time.perf_counter()
    for key in keys:
        dataset[key]
    return (time.perf_counter() - start) / len(keys) * 1e6


if __name__ == "__main__":
    torch.set_num_threads(1)
    dataset = TensorDataset(torch.rand(2_000, 3, 32, 32), torch.arange(2_000))  # CIFAR-sized samples
    keys = [3 * 2_000 + i % 2_000 for i in range(SAMPLES)]  # epoch 3's keys, as the engine's sampler hands them out
    plain, seeded = [], []
    for _ in range(7):
        plain.append(per_sample_us(dataset, [k % 2_000 for k in keys]))
        undo = seed_per_sample(dataset, seed=0)  # what each loader worker does to its copy
        seeded.append(per_sample_us(dataset, keys))
        undo()
    p, s = statistics.median(plain), statistics.median(seeded)
    print(f"fetch of a TensorDataset sample: {p:.1f} us plain, {s:.1f} us seeded per sample: +{s - p:.1f} us a sample")
