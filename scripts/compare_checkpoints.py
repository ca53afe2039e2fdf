"""Max |Δ| between checkpoints' weights and optimizer states: 0.0 means bit-equal.

    python scripts/compare_checkpoints.py runs-a/.../last.ckpt runs-b/.../last.ckpt [more.ckpt ...]

Each file after the first is compared with the first, over every tensor of ``state_dict`` and
``optimizer_states``; exits 1 if any differs (or holds other tensors, or another global step).
"""

import sys
from collections.abc import Iterator
from typing import Any

import torch


def tensors(tree: Any, path: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(tree, torch.Tensor):
        yield path, tree
    elif isinstance(tree, dict):
        for key, value in tree.items():
            yield from tensors(value, f"{path}.{key}")
    elif isinstance(tree, list | tuple):
        for i, value in enumerate(tree):
            yield from tensors(value, f"{path}[{i}]")


def state(file: str) -> tuple[int, dict[str, torch.Tensor]]:
    checkpoint = torch.load(file, map_location="cpu", weights_only=True)
    parts = {"state_dict": checkpoint["state_dict"], "optimizer_states": checkpoint["optimizer_states"]}
    return checkpoint["global_step"], dict(tensors(parts))


def main(files: list[str]) -> int:
    if len(files) < 2:
        sys.exit(__doc__)
    step, reference = state(files[0])
    differs = False
    for file in files[1:]:
        got_step, got = state(file)
        if got_step != step or got.keys() != reference.keys():
            print(f"{file}: global step {got_step} vs {step}, or other tensors: not the same run")
            differs = True
            continue
        deltas = {k: (got[k].double() - v.double()).abs().max().item() for k, v in reference.items() if v.numel()}
        worst = max(deltas, key=deltas.get)
        print(f"{file}: max |Δ| {deltas[worst]:.3g}" + (f" ({worst})" if deltas[worst] else ""))
        differs |= deltas[worst] != 0
    return int(differs)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
