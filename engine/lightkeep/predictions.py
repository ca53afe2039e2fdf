"""Predictions written: ``predict`` leaves ``predictions.csv`` (for people) and ``predictions.pt`` (for programs), one
row per sample in dataset order with its ``index`` in the dataset, from any ``predict_step`` that returns a tensor or
a dict of tensors, batch first (the columns, and what holds under DDP: docs/export.md, 'Predictions'). Under DDP each
rank saves its share to a shard in the run folder (one that every rank sees), which rank 0 merges in index order; a
sample predicted twice (a padded ``DistributedSampler``) is written once, with a warning.
"""

import csv
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import BasePredictionWriter
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn


class PredictionWriter(BasePredictionWriter):
    """Writes ``<name>.csv`` and ``<name>.pt`` at the end of ``predict``.

    Args:
        out_dir: The folder to write into; ``None``: the predict run's own folder. Files
            already there are never overwritten: the run stops before predicting.
        name: The files' name; with several predict dataloaders, ``<name>_<i>`` for the i-th.
    """

    def __init__(self, out_dir: str | None = None, name: str = "predictions") -> None:
        super().__init__(write_interval="batch")
        self.out_dir = out_dir
        self.name = name
        # dataloader index -> key -> per-batch tensors; "index" holds the samples' dataset indices
        self._parts: dict[int, dict[str, list[torch.Tensor]]] = {}
        self._warned: set[str] = set()

    def _folder(self, trainer: L.Trainer) -> Path:
        # the run folder (lightkeep.runs), rank 0's: a broadcast, so every rank asks at the same point
        return Path(self.out_dir if self.out_dir is not None else trainer.strategy.broadcast(trainer.default_root_dir))

    def _stems(self, trainer: L.Trainer) -> list[str]:
        loaders = trainer.predict_dataloaders
        count = len(loaders) if isinstance(loaders, (list, tuple)) else 1
        return [self.name] if count == 1 else [f"{self.name}_{i}" for i in range(count)]

    def on_predict_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._parts = {}
        folder = self._folder(trainer)
        existing = [folder / f"{s}.{ext}" for s in self._stems(trainer) for ext in ("csv", "pt")]
        existing = [p for p in existing if p.exists()]
        if existing:
            raise FileExistsError(f"{existing[0]} exists; predictions are never overwritten: choose another out_dir")

    def write_on_batch_end(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        prediction: Any,
        batch_indices: Sequence[int] | None,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int,
    ) -> None:
        if not batch_indices:  # Lightning tracks them for DataLoaders with a sampler only
            if trainer.world_size > 1:
                raise RuntimeError(
                    "PredictionWriter: the predict loader does not say which samples a batch holds (not a "
                    "DataLoader with a sampler), so the ranks' predictions cannot be put in order"
                )
            seen = sum(len(t) for t in self._parts.get(dataloader_idx, {}).get("index", []))
            values = prediction.values() if isinstance(prediction, dict) else [prediction]
            size = next((len(v) for v in values if isinstance(v, torch.Tensor) and v.dim() > 0), 0)
            batch_indices = range(seen, seen + size)
        columns = self._tensors(prediction, len(batch_indices))
        if not columns:
            return
        parts = self._parts.setdefault(dataloader_idx, defaultdict(list))
        parts["index"].append(torch.as_tensor(list(batch_indices), dtype=torch.long))
        for key, value in columns.items():
            parts[key].append(value.detach().cpu())

    def _tensors(self, prediction: Any, batch_size: int) -> dict[str, torch.Tensor]:
        """The batch-first tensors of ``prediction``; anything else is left out, with one warning per key."""
        if isinstance(prediction, torch.Tensor):
            prediction = {"output": prediction}
        if not isinstance(prediction, dict):
            self._warn_once("*", f"predict_step returned a {type(prediction).__name__}, not a dict of tensors")
            return {}
        kept = {}
        for key, value in prediction.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0 and len(value) == batch_size and key != "index":
                kept[str(key)] = value
            else:
                self._warn_once(str(key), f"predict_step's {key!r} is not a tensor with the batch ({batch_size}) first")
        return kept

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            rank_zero_warn(f"{message}: it is not written to the predictions file")

    def on_predict_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        folder = self._folder(trainer)
        folder.mkdir(parents=True, exist_ok=True)
        rank, world = trainer.global_rank, trainer.world_size
        for i, stem in enumerate(self._stems(trainer)):
            share = {key: torch.cat(parts) for key, parts in self._parts.get(i, {}).items()}
            if world == 1:
                self._write(folder / stem, [share])
                continue
            torch.save(share, folder / f"{stem}.rank{rank}.pt")
            # rank 0 reads the shards only once every rank has finished writing its own
            trainer.strategy.barrier("PredictionWriter.shards")
            if trainer.is_global_zero:
                shards = [folder / f"{stem}.rank{r}.pt" for r in range(world)]
                self._write(folder / stem, [torch.load(p, weights_only=True) for p in shards])
                for path in shards:
                    path.unlink()
        self._parts = {}

    def _write(self, stem: Path, shares: list[dict[str, torch.Tensor]]) -> None:
        shares = [s for s in shares if s]
        if not shares:
            return
        merged = {key: torch.cat([s[key] for s in shares]) for key in shares[0]}
        order = torch.argsort(merged["index"], stable=True)
        merged = {key: value[order] for key, value in merged.items()}
        first = torch.ones(len(order), dtype=torch.bool)
        first[1:] = merged["index"][1:] != merged["index"][:-1]
        if not first.all():
            rank_zero_warn(
                f"{int((~first).sum())} samples were predicted on more than one rank (a padded sampler); each is "
                "written once. The engine's sampler, in a plain DataLoader, gives every sample to exactly one rank"
            )
            merged = {key: value[first] for key, value in merged.items()}
        torch.save(merged, stem.with_suffix(".pt"))
        _write_csv(stem.with_suffix(".csv"), merged)
        rank_zero_info(f"Predictions of {len(merged['index'])} samples: {stem.with_suffix('.csv')} and .pt")


def _write_csv(path: Path, table: dict[str, torch.Tensor]) -> None:
    """One column per 1-D tensor, ``key_j`` per column of a 2-D one; floats with 9 digits, enough for float32."""
    names, columns = [], []
    for key, value in table.items():
        if value.dim() == 1:
            names.append(key)
            columns.append(value)
        elif value.dim() == 2:
            names += [f"{key}_{j}" for j in range(value.shape[1])]
            columns += list(value.T)
    cells = [[f"{v:.9g}" for v in c.tolist()] if c.is_floating_point() else c.long().tolist() for c in columns]
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(names)
        writer.writerows(zip(*cells, strict=True))
