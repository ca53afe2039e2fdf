"""Data: a DataModule skeleton for your own data, written as Lightning's docs teach.

Fill ``DataModule.setup`` with your datasets (downloads belong in ``prepare_data``, which runs on one process) and
return plain ``DataLoader``s: the engine makes them resume mid-epoch exactly and gives each evaluation sample to
exactly one rank under DDP.
"""

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset


class DataModule(L.LightningDataModule):
    """A skeleton to replace: random features labelled by a fixed random linear map, so that a fit can learn.

    Args:
        batch_size: Samples per batch on each rank (the global batch is ``batch_size * world_size``).
        num_samples: Size of the synthetic dataset, all splits together.
        num_features: Features per sample, the network's input size.
        num_classes: Number of classes (the model's ``num_classes`` must match: ``--model.num_classes``).
        val_fraction: Share of the data held out for validation.
        test_fraction: Share of the data held out for testing.
        seed: Seeds the data and the train/val/test split.
        num_workers: Loader worker processes per rank; 0 loads in the main process (best for in-memory data).
    """

    def __init__(
        self,
        batch_size: int = 64,
        num_samples: int = 1024,
        num_features: int = 64,
        num_classes: int = 10,
        val_fraction: float = 0.15,
        test_fraction: float = 0.15,
        seed: int = 0,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"batch_size ({batch_size}) must be >= 1")
        if num_samples < 1 or num_features < 1:
            raise ValueError(f"num_samples ({num_samples}) and num_features ({num_features}) must be >= 1")
        if num_classes < 2:
            raise ValueError(f"num_classes ({num_classes}) must be >= 2")
        if not (0 < val_fraction < 1 and 0 <= test_fraction < 1 and val_fraction + test_fraction < 1):
            raise ValueError(
                f"val_fraction ({val_fraction}) and test_fraction ({test_fraction}) must lie in [0, 1) "
                "and leave some data for training (val_fraction > 0, sum < 1)"
            )
        if num_workers < 0:
            raise ValueError(f"num_workers ({num_workers}) must be >= 0")
        self.save_hyperparameters()
        self.splits: dict[str, Dataset] = {}

    def setup(self, stage: str) -> None:
        if self.splits:
            return
        hp = self.hparams
        generator = torch.Generator().manual_seed(hp.seed)
        # Your data goes here: any Dataset per split. This runs on every rank, so every rank must build the same.
        x = torch.randn(hp.num_samples, hp.num_features, generator=generator)  # (N, F)
        y = (x @ torch.randn(hp.num_features, hp.num_classes, generator=generator)).argmax(dim=1)  # (N,)
        order = torch.randperm(hp.num_samples, generator=generator)
        n_val, n_test = int(hp.num_samples * hp.val_fraction), int(hp.num_samples * hp.test_fraction)
        parts = {"val": order[:n_val], "test": order[n_val : n_val + n_test], "train": order[n_val + n_test :]}
        self.splits = {name: TensorDataset(x[idx], y[idx]) for name, idx in parts.items()}

    def _loader(self, split: str, shuffle: bool = False) -> DataLoader:
        hp = self.hparams
        return DataLoader(self.splits[split], batch_size=hp.batch_size, shuffle=shuffle, num_workers=hp.num_workers)

    def train_dataloader(self) -> DataLoader:
        return self._loader("train", shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader("val")

    def test_dataloader(self) -> DataLoader:
        return self._loader("test")

    def predict_dataloader(self) -> DataLoader:
        return self._loader("test")
