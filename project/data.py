"""Data: the bundled scikit-learn digits, split deterministically, in plain ``DataLoader``s.

To train on your own data, write a LightningDataModule like ``DigitsDataModule`` (``setup`` builds datasets,
``*_dataloader`` returns ``DataLoader``s, as Lightning's docs teach) and select it with ``--data my_pkg.data.MyData``.
The engine puts its own samplers into these loaders, so a resumed run sees the same batches and, under DDP, every
evaluation sample is counted exactly once (``lightkeep.user_loaders``).
"""

import lightning as L
import torch
from sklearn.datasets import load_digits
from torch.utils.data import DataLoader, TensorDataset


class DigitsDataModule(L.LightningDataModule):
    """scikit-learn's 1,797 handwritten digits (8 x 8 images, 10 classes), shipped with the package.

    Args:
        batch_size: Samples per batch on each rank (the global batch is ``batch_size * world_size``).
        val_fraction: Share of the data held out for validation.
        test_fraction: Share of the data held out for testing.
        seed: Seeds the train/val/test split (the shuffle order of each epoch follows the run's ``seed_everything``).
        num_workers: Loader worker processes per rank; 0 loads in the main process (best for in-memory data).
        pin_memory: Page-lock batches for faster host-to-GPU copies.
        persistent_workers: Keep workers alive between epochs (needs ``num_workers > 0``).
    """

    num_classes = 10

    def __init__(
        self,
        batch_size: int = 64,
        val_fraction: float = 0.15,
        test_fraction: float = 0.15,
        seed: int = 0,
        num_workers: int = 0,
        pin_memory: bool = False,
        persistent_workers: bool = False,
    ) -> None:
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"batch_size ({batch_size}) must be >= 1")
        if not (0 < val_fraction < 1 and 0 <= test_fraction < 1 and val_fraction + test_fraction < 1):
            raise ValueError(
                f"val_fraction ({val_fraction}) and test_fraction ({test_fraction}) must lie in [0, 1) "
                "and leave some data for training (val_fraction > 0, sum < 1)"
            )
        if num_workers < 0:
            raise ValueError(f"num_workers ({num_workers}) must be >= 0")
        if persistent_workers and num_workers == 0:
            raise ValueError("persistent_workers=True needs num_workers > 0")
        self.save_hyperparameters()
        self.splits: dict[str, TensorDataset] = {}

    def setup(self, stage: str) -> None:
        if self.splits:
            return
        digits = load_digits()  # images (N, 8, 8) with values 0-16, labels (N,)
        pixels, targets = digits.images, digits.target
        images = torch.tensor(pixels, dtype=torch.float32).unsqueeze(1) / 16.0  # (N, 1, 8, 8) in [0, 1]
        labels = torch.tensor(targets, dtype=torch.long)  # (N,)
        n = len(labels)
        order = torch.randperm(n, generator=torch.Generator().manual_seed(self.hparams.seed))
        n_val, n_test = int(n * self.hparams.val_fraction), int(n * self.hparams.test_fraction)
        parts = {"val": order[:n_val], "test": order[n_val : n_val + n_test], "train": order[n_val + n_test :]}
        self.splits = {name: TensorDataset(images[idx], labels[idx]) for name, idx in parts.items()}

    def _loader(self, split: str, shuffle: bool = False) -> DataLoader:
        hp = self.hparams
        if len(self.splits[split]) == 0:  # the fractions were checked in __init__, the counts only exist now
            n, fraction = sum(len(s) for s in self.splits.values()), f"{split}_fraction"
            raise ValueError(
                f"{fraction} ({hp[fraction]}) leaves no {split} samples: int({hp[fraction]} * {n}) = 0 of the {n} "
                f"digits. Raise --data.{fraction} to at least {-(-10000 // n) / 1e4}."
            )
        return DataLoader(
            self.splits[split],
            batch_size=hp.batch_size,
            shuffle=shuffle,
            num_workers=hp.num_workers,
            pin_memory=hp.pin_memory,
            persistent_workers=hp.persistent_workers,
        )

    def train_dataloader(self) -> DataLoader:
        return self._loader("train", shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader("val")

    def test_dataloader(self) -> DataLoader:
        return self._loader("test")

    def predict_dataloader(self) -> DataLoader:
        return self._loader("test")
