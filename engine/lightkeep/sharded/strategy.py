"""Sharded training (FSDP2) and its checkpoints: ``--config configs/fsdp.yaml``.

``ShardedStrategy`` is Lightning's ``ModelParallelStrategy`` (FSDP2's ``fully_shard``, applied in the module's
``configure_model``, or by the strategy to each layer of a module without one: ``shard_each_layer``) with the
engine's checkpoint guarantees for the folders it writes (torch's distributed checkpoint, DCP: each rank writes its
own shard, no rank gathers the whole model): atomic, no code, the same network, another number of ranks (resharded
exactly; one line says that the random draws and the order of the rest of the interrupted epoch then differ from the
original run). What each means: docs/sharding.md; how a folder is read and checked: ``lightkeep.sharded.folders``.
The shards go into ``<name>.tmp/``; once every rank has written, rank 0 renames it to ``<name>``.
"""

import os
import shutil
from pathlib import Path
from typing import Any, Literal

from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import nn

from lightkeep.checkpoint_files import CheckpointLoadError, FilePath
from lightkeep.compat import configure_model_counted_as_overridden, shard_over_all_ranks
from lightkeep.sharded.folders import WORLD_SIZE, check_same_network, load, read_meta


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
        load({"state_dict": model_state}, path)
        set_model_state_dict(
            self.model, model_state, options=StateDictOptions(strict=self.lightning_module.strict_loading)
        )
        for i, optimizer in enumerate(self.optimizers):
            key = f"optimizer_{i}"
            state = {key: get_optimizer_state_dict(self.model, optimizer)}
            load(state, path)
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
