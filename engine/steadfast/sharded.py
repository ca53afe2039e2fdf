"""Sharded training (FSDP2) and its checkpoints: ``--config configs/fsdp.yaml``.

``ShardedStrategy`` is Lightning's ``ModelParallelStrategy`` (FSDP2's ``fully_shard``, applied in the module's
``configure_model``, or by the strategy to each layer of a module without one: ``shard_each_layer``) with the
engine's checkpoint guarantees for the folders it writes (torch's distributed checkpoint, DCP: each rank writes its
own shard, no rank gathers the whole model):

- **Atomic**: the shards go into ``<name>.tmp/``; once every rank has written, rank 0 renames it to ``<name>``. A
  folder without ``.metadata`` (DCP's index, written last) and ``meta.pt`` (Lightning's loops, callbacks, RNG
  states) is never resumed from: ``--ckpt_path last`` passes over it and an explicit path is refused in one line.
- **No code in a checkpoint**: DCP reads its index with ``pickle`` and non-tensor values with
  ``torch.load(weights_only=False)``; here the index is read by an unpickler that knows only DCP's metadata classes,
  and everything else with ``weights_only=True``.
- **Same network**: each saved tensor's full shape is compared with the configured model's before anything loads.
- **Another number of ranks**: DCP reshards the weights and optimizer state exactly; one line says that the random
  draws and the order of the rest of the interrupted epoch then differ from the original run.

``full_state_dict`` consolidates a folder into one state dict on one process (for export), without a process group.
"""

import functools
import importlib
import io
import os
import pickle
import shutil
import warnings
from pathlib import Path
from typing import Any, Literal

# torch.distributed.checkpoint is imported in the functions that use it: every run imports this module (the CLI
# checks for the strategy, --ckpt_path last looks for folders), and DCP costs ~30 ms of each start-up.
import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import nn

from steadfast.checkpoint_files import CheckpointLoadError, FilePath
from steadfast.compat import configure_model_counted_as_overridden, shard_over_all_ranks
from steadfast.compat_torch import index_for_reader, load_bytes_weights_only

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
    """DCP's index (``Metadata``) of a folder whose save finished: ``meta.pt`` and the index are there, and every
    shard file the index names holds the bytes it points at. Raises ``CheckpointLoadError`` naming what is missing
    (a shard lost after the save, e.g. a copy cut short, would otherwise load as a traceback from every rank)."""
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
        first_line = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise CheckpointLoadError(f"{path}/{META} is not readable ({first_line})") from None


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


def read_index(path: FilePath) -> Any:
    """DCP's ``Metadata`` of a complete folder (``check_complete``), read by ``_IndexUnpickler``; raises
    ``CheckpointLoadError``."""
    return check_complete(path)


@functools.cache
def _safe_reader_and_planner() -> tuple[type, type]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    class SafeReader(dcp.FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            return index_for_reader(self, read_index(self.path))

    class SafePlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:  # the default: weights_only=False
            load_bytes_weights_only(self, read_item, value)

    return SafeReader, SafePlanner


def _load(state: dict[str, Any], path: Path, single_process: bool = False) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    reader, planner = _safe_reader_and_planner()
    try:
        dcp.load(state, storage_reader=reader(path), planner=planner(), no_dist=single_process)
    except CheckpointException as error:  # a BaseException: no `except Exception` (nor the one-line report) sees it
        # failures: rank -> (exception, traceback)
        causes = [f"rank {rank}: {_first_line(failure[0])}" for rank, failure in sorted(error.failures.items())]
        raise CheckpointLoadError(f"{path} could not be loaded ({'; '.join(causes) or error})") from None


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0]}" if text else type(error).__name__


def _saved_tensors(path: FilePath, prefix: str) -> dict[str, Any]:
    """The index's entry (``size``, ``properties``) of each saved tensor whose key starts with ``prefix``."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    return {
        key: meta
        for key, meta in read_index(path).state_dict_metadata.items()
        if key.startswith(prefix) and isinstance(meta, TensorStorageMetadata)
    }


def check_same_network(path: Path, model: torch.nn.Module) -> None:
    """Raises ``CheckpointLoadError`` naming each weight whose full shape differs or that only one side has."""
    saved = {
        key.removeprefix("state_dict."): tuple(meta.size) for key, meta in _saved_tensors(path, "state_dict.").items()
    }
    # a sharded weight (DTensor) has its full shape, so this holds before and after fully_shard
    here = {k: tuple(v.shape) for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    problems = [
        f"{k} is {list(saved[k])} in the checkpoint, {list(v)} here"
        for k, v in here.items()
        if k in saved and saved[k] != v
    ]
    problems += [f"{k} is missing from the checkpoint" for k in sorted(here.keys() - saved.keys())]
    problems += [f"{k} is in the checkpoint only" for k in sorted(saved.keys() - here.keys())]
    if problems:
        shown = "; ".join(problems[:10]) + (f"; and {len(problems) - 10} more" if len(problems) > 10 else "")
        raise CheckpointLoadError(
            f"{path} holds a different network from the one configured: {shown}. Build the network the checkpoint "
            f"was saved from: add --config {path.parent.parent / 'config.yaml'}"
        )


class ShardedStrategy(ModelParallelStrategy):
    """FSDP2 over all ranks, with atomic, code-free sharded checkpoints (see the module docstring).

    Args:
        data_parallel_size: Ranks that hold different data. ``auto``: all ranks divided by ``tensor_parallel_size``.
        tensor_parallel_size: Ranks that split each layer's matmuls (1: sharded data parallelism only).
        process_group_backend: ``nccl`` on GPUs and ``gloo`` on CPUs when ``None``.
    """

    def __init__(
        self,
        data_parallel_size: int | Literal["auto"] = "auto",
        tensor_parallel_size: int = 1,
        process_group_backend: str | None = None,
    ) -> None:
        super().__init__(data_parallel_size, tensor_parallel_size, True, process_group_backend)

    def setup_environment(self) -> None:
        shard_over_all_ranks(self)  # Lightning's auto is one data-parallel group per node; here every rank shards
        super().setup_environment()

    def setup(self, trainer: Any) -> None:
        module = self.lightning_module
        if is_overridden("configure_model", module):  # the user's own sharding, already applied by Lightning
            super().setup(trainer)
            return
        shard_each_layer(module, self.device_mesh["data_parallel"])
        with configure_model_counted_as_overridden(module):
            super().setup(trainer)

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: FilePath, storage_options: Any | None = None
    ) -> None:
        path = Path(self.broadcast(str(filepath)))
        tmp = path.with_name(f"{path.name}.tmp")
        if self.global_rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # a save cut short earlier
        self.barrier()
        checkpoint[WORLD_SIZE] = self.world_size
        super().save_checkpoint(checkpoint, tmp)  # each rank its shard, then rank 0 writes meta.pt
        self._publish(tmp, path)

    def _publish(self, tmp: Path, path: Path) -> None:
        """Renames the written folder to its name once every rank is done (tests.faults.KillBeforePublish)."""
        self.barrier()  # rank 0 has written meta.pt, every rank its shard
        if self.global_rank == 0:
            old = path.with_name(f"{path.name}.old")
            if path.is_dir():  # a folder cannot be renamed over one that is not empty
                os.replace(path, old)
            elif path.exists():
                path.unlink()
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        self.barrier()

    def remove_checkpoint(self, filepath: FilePath) -> None:
        if self.global_rank == 0:
            shutil.rmtree(filepath, ignore_errors=True) if Path(filepath).is_dir() else Path(filepath).unlink(True)

    def load_checkpoint(self, checkpoint_path: FilePath, weights_only: bool | None = None) -> dict[str, Any]:
        path = Path(self.broadcast(str(checkpoint_path)))
        if not path.is_dir():
            raise CheckpointLoadError(
                f"{path} is a single-file checkpoint; the sharded strategy resumes from sharded folders only. "
                "Resume it without --config configs/fsdp.yaml"
            )
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        assert self.model is not None and self.lightning_module is not None
        meta = read_meta(path)
        check_same_network(path, self.model)
        model_state = get_model_state_dict(self.model)
        _load({"state_dict": model_state}, path)
        set_model_state_dict(
            self.model, model_state, options=StateDictOptions(strict=self.lightning_module.strict_loading)
        )
        for i, optimizer in enumerate(self.optimizers):
            key = f"optimizer_{i}"
            state = {key: get_optimizer_state_dict(self.model, optimizer)}
            _load(state, path)
            set_optimizer_state_dict(self.model, optimizer, state[key], options=StateDictOptions(cpu_offload=True))
        saved_ranks = meta.pop(WORLD_SIZE, self.world_size)
        if saved_ranks != self.world_size:
            rank_zero_info(
                f"Resharded {path.name} from {saved_ranks} ranks to {self.world_size}: weights and optimizer state "
                "are exact; random draws from a rank's generators (dropout) differ from the original run"
            )
        return meta


def shard_each_layer(module: nn.Module, mesh: Any) -> None:
    """FSDP2 as Lightning's docs apply it in ``configure_model``: ``fully_shard`` on each layer that holds
    parameters of its own, then on each of the module's networks (its children with parameters), so that each
    layer's weights are gathered only for its own forward and backward."""
    from torch.distributed.fsdp import fully_shard

    own = [name for name, _ in module.named_parameters(recurse=False)]
    if own:  # unsharded, FSDP would neither gather nor reduce them: wrong gradients, silently
        raise ValueError(
            f"{type(module).__name__} holds parameters outside its submodules ({', '.join(own)}), which the "
            "sharded strategy does not shard: shard them in the module's configure_model"
        )
    for net in module.children():
        if not any(True for _ in net.parameters()):  # e.g. torchmetrics metrics: buffers only
            continue
        for layer in net.modules():
            if layer is not net and any(True for _ in layer.parameters(recurse=False)):
                fully_shard(layer, mesh=mesh)
        fully_shard(net, mesh=mesh)


def full_state_dict(path: FilePath, prefix: str = "state_dict.") -> dict[str, torch.Tensor]:
    """The full tensors under ``prefix`` (``state_dict.``: the module's weights; ``optimizer_0.``: its optimizer
    state), consolidated from every rank's shard on this one process."""
    path = Path(path)
    state = {
        key: torch.empty(meta.size, dtype=meta.properties.dtype) for key, meta in _saved_tensors(path, prefix).items()
    }
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        _load(state, path, single_process=True)
    return {key.removeprefix(prefix): value for key, value in state.items()}
