"""The folders ``strategy.ShardedStrategy`` writes (DCP: torch's distributed checkpoint, one shard per rank), read so
that nothing in them runs code, and checked before a run resumes from one (what that guarantees: docs/sharding.md).
A folder is complete with ``.metadata`` (DCP's index, written last) and ``meta.pt`` (Lightning's loops, callbacks,
RNG states). DCP's own reader unpickles its index and loads non-tensor values with ``weights_only=False``: here the
index goes through an unpickler that knows only DCP's metadata classes. The same network: each saved tensor's full
shape equals the configured model's, compared before anything loads.

``full_state_dict`` consolidates a folder into one state dict on one process (for export), without a process group.
"""

import functools
import importlib
import io
import pickle
import warnings
from pathlib import Path
from typing import Any

# torch.distributed.checkpoint is imported in the functions that use it: every run imports this module (the CLI
# checks for the strategy, --ckpt_path last looks for folders), and DCP costs ~30 ms of each start-up.
import torch

from lightkeep.checkpoint_files import CheckpointLoadError, FilePath, check_shapes
from lightkeep.compat_torch import index_for_reader, load_bytes_weights_only
from lightkeep.console import first_line

META = "meta.pt"  # Lightning's name for the non-tensor part (loops, callbacks, hyperparameters)
INDEX = ".metadata"  # DCP's index of the shards, written by the coordinator once every rank has written
WORLD_SIZE = "sharded_world_size"  # key in meta.pt: how many ranks wrote the folder


def is_sharded_checkpoint(path: FilePath) -> bool:
    """A sharded checkpoint folder whose save finished (an interrupted save leaves ``<name>.tmp``, which is never
    one); ``check_complete`` also checks its shards."""
    path = Path(path)
    return path.is_dir() and (path / META).is_file() and (path / INDEX).is_file()


def is_checkpoint_folder(path: FilePath) -> bool:
    """A sharded checkpoint folder, complete or not (a run folder holds none of these files)."""
    path = Path(path)
    return path.is_dir() and ((path / META).exists() or (path / INDEX).exists() or any(path.glob("*.distcp")))


def check_complete(path: FilePath) -> Any:
    """DCP's index (``Metadata``, read by ``_IndexUnpickler``) of a folder whose save finished: ``meta.pt`` and the
    index are there, and every shard file the index names holds the bytes it points at. Raises ``CheckpointLoadError``
    naming what is missing (a shard lost after the save, e.g. a copy cut short, would otherwise load as a traceback
    from every rank)."""
    path = Path(path)
    missing = [name for name in (META, INDEX) if not (path / name).is_file()]
    if missing:
        raise CheckpointLoadError(
            f"{path} is not a complete sharded checkpoint (no {' or '.join(missing)}: its save was cut short)"
        )
    index = _read_index_file(path)
    needed: dict[str, int] = {}  # shard file -> the end of the last byte range read from it
    for where in index.storage_data.values():
        name = where.relative_path
        if Path(name).name != name:  # a shard is always a file of the folder itself
            raise CheckpointLoadError(f"{path}/{INDEX} names a shard outside its folder ({name!r}); it was not loaded")
        needed[name] = max(needed.get(name, 0), where.offset + where.length)
    problems = []
    for name, end in sorted(needed.items()):
        shard = path / name
        if not shard.is_file():
            problems.append(f"{name} is missing")
        elif shard.stat().st_size < end:
            problems.append(f"{name} has {shard.stat().st_size} of its {end} bytes")
    if problems:
        raise CheckpointLoadError(
            f"{path} is not a complete sharded checkpoint ({'; '.join(problems)}, of the {len(needed)} shard(s) its "
            "index names)"
        )
    return index


def read_meta(path: FilePath) -> dict[str, Any]:
    """``meta.pt`` of a complete folder, with ``weights_only=True``; raises ``CheckpointLoadError``."""
    check_complete(path)
    try:
        return torch.load(Path(path) / META, map_location="cpu", weights_only=True)
    except Exception as error:
        raise CheckpointLoadError(f"{path}/{META} is not readable ({first_line(error)})") from None


class _IndexUnpickler(pickle.Unpickler):
    """Builds the classes DCP's index is made of, by name, and nothing else.

    Each allowed global is one exact ``(module, name)``: no module is allowed as a whole and no dotted name is
    resolved, since pickle protocol 4 looks ``a.b`` up attribute by attribute (``filesystem`` + ``os.system`` is
    ``os.system``). The list is what torch's ``FileSystemWriter`` writes (tests/test_unpicklers.py checks it
    against a real index); a new torch that writes another class fails loudly here, naming it.
    """

    ALLOWED = {
        *(
            ("torch.distributed.checkpoint.metadata", name)
            for name in (
                "Metadata",
                "MetadataIndex",
                "StorageMeta",
                "TensorProperties",
                "TensorStorageMetadata",
                "BytesStorageMetadata",
                "ChunkStorageMetadata",
                "_MEM_FORMAT_ENCODING",
            )
        ),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch", "device"),
        ("torch.serialization", "_get_layout"),  # a layout by its name (torch.strided)
        ("pathlib", "PosixPath"),  # where the folder was written
        ("pathlib", "WindowsPath"),
        ("collections", "OrderedDict"),
        ("builtins", "set"),
        ("builtins", "frozenset"),
        ("builtins", "slice"),
    }

    def find_class(self, module: str, name: str) -> Any:
        if "." not in name:
            if module == "torch" and isinstance(
                getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format)
            ):
                return getattr(torch, name)  # torch.float32, torch.strided, torch.channels_last
            if (module, name) in self.ALLOWED:
                return getattr(importlib.import_module(module), name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a checkpoint index")


def _read_index_file(path: Path) -> Any:
    try:
        with open(path / INDEX, "rb") as f:
            index = _IndexUnpickler(f).load()
    except Exception as error:
        raise CheckpointLoadError(
            f"{path}/{INDEX} is not a DCP index of tensors ({error}); loading it could run code, so it was not loaded"
        ) from None
    from torch.distributed.checkpoint.metadata import Metadata

    if not isinstance(index, Metadata):
        raise CheckpointLoadError(f"{path}/{INDEX} is not a DCP index (it holds a {type(index).__name__})")
    return index


@functools.cache
def _safe_reader_and_planner() -> tuple[type, type]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    class SafeReader(dcp.FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            return index_for_reader(self, check_complete(self.path))

    class SafePlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:  # the default: weights_only=False
            load_bytes_weights_only(self, read_item, value)

    return SafeReader, SafePlanner


def load(state: dict[str, Any], path: Path, single_process: bool = False) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    reader, planner = _safe_reader_and_planner()
    try:
        dcp.load(state, storage_reader=reader(path), planner=planner(), no_dist=single_process)
    except CheckpointException as error:  # a BaseException: no `except Exception` (nor the one-line report) sees it
        # failures: rank -> (exception, traceback)
        causes = [f"rank {rank}: {first_line(failure[0])}" for rank, failure in sorted(error.failures.items())]
        raise CheckpointLoadError(f"{path} could not be loaded ({'; '.join(causes) or error})") from None


def _saved_tensors(path: FilePath, prefix: str) -> dict[str, Any]:
    """The index's entry (``size``, ``properties``) of each saved tensor whose key starts with ``prefix``."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    return {
        key: meta
        for key, meta in check_complete(path).state_dict_metadata.items()
        if key.startswith(prefix) and isinstance(meta, TensorStorageMetadata)
    }


def check_same_network(path: Path, model: torch.nn.Module) -> None:
    """Raises ``CheckpointLoadError`` naming each weight whose full shape differs or that only one side has."""
    saved = {
        key.removeprefix("state_dict."): tuple(meta.size) for key, meta in _saved_tensors(path, "state_dict.").items()
    }
    # a sharded weight (DTensor) has its full shape, so this holds before and after fully_shard
    here = {k: tuple(v.shape) for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    missing, only = sorted(here.keys() - saved.keys()), sorted(saved.keys() - here.keys())
    check_shapes(path, saved, here, missing, only, f"add --config {path.parent.parent / 'config.yaml'}")


def full_state_dict(path: FilePath, prefix: str = "state_dict.") -> dict[str, torch.Tensor]:
    """The full tensors under ``prefix`` (``state_dict.``: the module's weights; ``optimizer_0.``: its optimizer
    state), consolidated from every rank's shard on this one process."""
    path = Path(path)
    state = {
        key: torch.empty(meta.size, dtype=meta.properties.dtype) for key, meta in _saved_tensors(path, prefix).items()
    }
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        load(state, path, single_process=True)
    return {key.removeprefix(prefix): value for key, value in state.items()}
