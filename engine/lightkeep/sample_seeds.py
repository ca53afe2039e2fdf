"""Random augmentation that resumes exactly: in loader workers, the randomness a training sample draws inside
``Dataset.__getitem__`` from torch's, numpy's or Python's global generator (torchvision's transforms,
albumentations, ``torch.rand``) is a pure function of ``(seed, epoch, index)`` (``--run.seed_per_sample``, on by
default).

Without it, a worker's draws depend on which worker fetched the sample and on everything that worker drew before:
the number of workers, persistent workers, a resume mid-epoch (the workers start afresh) or at an epoch's end (a
persistent worker's stream had moved on) all change them, and a resumed run drifts from the uninterrupted one (5.7e-4
in the weights after 36 steps). With it, each worker seeds the three global generators from ``(seed, epoch, index)``
before each training sample's ``__getitem__``, so the same sample of the same epoch is augmented alike whatever
worker, number of workers (1 or more) or ranks, persistent or not, and after any resume. A worker's generators are
its own, so nothing else depends on where they were; CUDA's are never touched.

With ``num_workers=0`` the samples are fetched in the main process, whose generators the checkpoint holds (dropout
draws from them too): they are left as they are, and a resume is exact as it is (the draws then follow the main
process's stream, so they differ from those of a run with workers).

How: the engine's sampler (``loaders.ResumableSampler``) hands out ``epoch * len(dataset) + index``, and each
worker's copy of the dataset takes a subclass of its class whose ``__getitem__`` decodes that key, seeds, and calls
the class's own with the index (set by the loader's ``worker_init_fn``; the user's own runs after it). Cost: a few
microseconds a sample (``scripts/benchmark_sample_seeds.py``), next to the milliseconds an image transform takes.
"""

import functools
import random
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, get_worker_info

_MASK = (1 << 64) - 1


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """A 64-bit seed from ``(seed, epoch, index)``, mixed (splitmix64) so that neighbouring samples and epochs get
    unrelated streams."""
    x = (seed * 0x9E3779B97F4A7C15 + (epoch + 1) * 0xD1B54A32D192ED03 + index * 0x8CB92BA72F3D8DD7) & _MASK
    for shift, multiplier in ((30, 0xBF58476D1CE4E5B9), (27, 0x94D049BB133111EB)):
        x = ((x ^ (x >> shift)) * multiplier) & _MASK
    return x ^ (x >> 31)


@functools.cache
def _seeded_class(cls: type, seed: int, length: int) -> type:
    """``cls`` with the seeded ``__getitem__`` (see the module docstring) in front of its own; the same memory
    layout (no slots, no dict of its own), so an instance of ``cls`` can take it. One per class, seed and length."""
    own = cls.__getitem__

    def __getitem__(self: Any, key: Any) -> Any:
        if not isinstance(key, int):  # a slice, a string key: the class's own
            return own(self, key)
        epoch, index = divmod(key, length)
        drawn = sample_seed(seed, epoch, index)
        torch.random.default_generator.manual_seed(drawn)  # the CPU generator only
        np.random.seed(drawn & 0xFFFFFFFF)
        random.seed(drawn)
        return own(self, index)

    namespace = {"__module__": cls.__module__, "__slots__": (), "__getitem__": __getitem__, SEEDED: cls}
    return type(cls.__name__, (cls,), namespace)


SEEDED = "_seeded_from"  # the class attribute of a seeded class: the dataset's own class


def can_seed(dataset: Any) -> bool:
    """Whether ``dataset`` can take the seeded subclass of its class (tried here, and undone): a map-style
    ``Dataset`` of a Python class with a length."""
    if not isinstance(dataset, Dataset) or not hasattr(type(dataset), "__getitem__"):
        return False
    try:
        seed_per_sample(dataset, 0)()
    except TypeError:  # no len(), or a class whose instances cannot change class (slots, a C type)
        return False
    return True


def seed_per_sample(dataset: Any, seed: int) -> Callable[[], None]:
    """Gives ``dataset`` (in this process) the seeded ``__getitem__``; returns what undoes it."""
    cls = type(dataset)
    if SEEDED in vars(cls):
        return lambda: None
    dataset.__class__ = _seeded_class(cls, seed, len(dataset))

    def undo() -> None:
        dataset.__class__ = cls

    return undo


def seeding_worker_init(seed: int, user_init: Callable[[int], Any] | None, worker_id: int) -> None:
    """A loader worker's ``worker_init_fn``: its copy of the dataset seeded per sample, then the user's own."""
    info = get_worker_info()
    if info is not None:
        seed_per_sample(info.dataset, seed)
    if user_init is not None:
        user_init(worker_id)


def worker_init(seed: int, user_init: Callable[[int], Any] | None) -> Callable[[int], None]:
    return functools.partial(seeding_worker_init, seed, user_init)


def generator_states(cuda: bool = True) -> dict[str, torch.Tensor]:
    """The global generators' states (torch's CPU one, numpy's, Python's; CUDA's where it runs and ``cuda``) as
    tensors: a ``weights_only`` checkpoint may hold nothing else safely."""
    version, py_state, gauss = random.getstate()
    _, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    states = {
        "torch": torch.get_rng_state(),
        "python": torch.tensor([version, *py_state], dtype=torch.int64),
        "python_gauss": torch.tensor([gauss is not None, gauss or 0.0], dtype=torch.float64),
        "numpy": torch.tensor(np_keys.astype(np.int64)),
        "numpy_rest": torch.tensor([np_pos, np_has_gauss, np_gauss], dtype=torch.float64),
    }
    if cuda and torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state()
    return states


def set_generator_states(states: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(states["torch"].cpu().clone())
    python = states["python"].tolist()
    has_gauss, gauss = states["python_gauss"].tolist()
    random.setstate((python[0], tuple(python[1:]), gauss if has_gauss else None))
    pos, np_has_gauss, np_gauss = states["numpy_rest"].tolist()
    np.random.set_state(("MT19937", states["numpy"].numpy().astype(np.uint32), int(pos), int(np_has_gauss), np_gauss))
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state(states["cuda"].cpu().clone())
