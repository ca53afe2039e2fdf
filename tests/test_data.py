"""The digits DataModule: its split, and the checks of its constructor."""

import pytest
import torch

from project.data import DigitsDataModule


def test_split_is_deterministic_disjoint_and_complete():
    a, b = DigitsDataModule(seed=3), DigitsDataModule(seed=3)
    a.setup("fit")
    b.setup("fit")
    sizes = {k: len(v) for k, v in a.splits.items()}
    assert sizes == {"val": int(1797 * 0.15), "test": int(1797 * 0.15), "train": 1797 - 2 * int(1797 * 0.15)}
    for name in ("train", "val", "test"):
        assert torch.equal(a.splits[name].tensors[0], b.splits[name].tensors[0])
    rows = torch.cat([a.splits[n].tensors[0].flatten(1) for n in ("train", "val", "test")])
    assert rows.shape == (1797, 64) and rows.min() >= 0 and rows.max() <= 1
    c = DigitsDataModule(seed=4)
    c.setup("fit")
    assert not torch.equal(a.splits["val"].tensors[1], c.splits["val"].tensors[1])


def test_init_has_no_side_effects_and_rejects_bad_values():
    dm = DigitsDataModule()
    assert dm.splits == {}
    with pytest.raises(ValueError, match=r"batch_size \(0\) must be >= 1"):
        DigitsDataModule(batch_size=0)
    with pytest.raises(ValueError, match="persistent_workers=True needs num_workers > 0"):
        DigitsDataModule(persistent_workers=True)
    with pytest.raises(ValueError, match="val_fraction"):
        DigitsDataModule(val_fraction=0.6, test_fraction=0.5)
