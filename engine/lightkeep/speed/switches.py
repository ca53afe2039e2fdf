"""Speed switches that change how fast, not what is computed: the ``speed:`` settings (``Speed``;
``configs/gpu.yaml`` turns two on), named in the start line (`` | speed: ...``), each set for the run only."""

from typing import Literal

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback


class SpeedSwitch(Callback):
    """A switch the start line names (``lightkeep.guarantees.speed_switches``)."""

    def describe(self) -> str:
        raise NotImplementedError


class Compile(SpeedSwitch):
    """``torch.compile`` of each of the module's networks (its children with parameters), in place: checkpoints
    keep the same keys and load into an uncompiled module. The graph is traced at the first forward, once Lightning
    has moved the module to its device, so the first steps are slow. Pays off on GPUs for networks that run long
    enough to amortise the compile time."""

    def describe(self) -> str:
        return "networks compiled"

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        for net in pl_module.children():
            if any(True for _ in net.parameters()):  # not torchmetrics metrics
                net.compile()


class MatmulPrecision(SpeedSwitch):
    """``torch.set_float32_matmul_precision`` for the run, in every rank's process, put back at its end: ``high``
    lets Ampere+ GPUs use TF32 tensor cores for float32 matmuls (about 8x the float32 throughput, 10-bit
    mantissa). (With ``precision: bf16-mixed`` the matmuls run in bfloat16 anyway.)

    Args:
        precision: ``highest`` (PyTorch's default), ``high`` or ``medium``.
    """

    def __init__(self, precision: str = "high") -> None:
        if precision not in ("highest", "high", "medium"):
            raise ValueError(f"precision ({precision!r}) must be 'highest', 'high' or 'medium'")
        self.precision = precision
        self._before: str | None = None

    def describe(self) -> str:
        return f"float32 matmuls at {self.precision!r} precision"

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.set_for_the_run()

    def set_for_the_run(self) -> None:
        """Sets the precision, keeping the one before for ``teardown``. The engine's CLI calls this before it builds
        the Trainer: Lightning's GPU set-up, which comes before any callback's ``setup``, otherwise advises setting
        it, a line the start line (``float32 matmuls at 'high' precision``) contradicts. ``lightkeep.run_scope``
        puts it back after a run that ended in an exception, where ``teardown`` does not run."""
        if self._before is None:
            self._before = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision(self.precision)

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self._before is not None:
            torch.set_float32_matmul_precision(self._before)
            self._before = None


class Speed:
    """The speed switches of a run (the ``speed:`` section): how fast, not what is computed. Each one on is named in
    the start line (`` | speed: ...``) and set for the run only.

    Args:
        keep_freed_host_memory: CPU runs: each step reuses the host memory the last one freed (glibc's malloc
            thresholds, ~20% of a large CPU step; ``lightkeep.speed.host_memory``), put back after the run. A run on
            a GPU leaves malloc alone whatever this says.
        compile: ``torch.compile`` each of the module's networks in place (checkpoint keys unchanged): the first
            steps are slow, the rest faster on a GPU.
        matmul_precision: ``torch.set_float32_matmul_precision`` for the run: ``high`` lets Ampere+ GPUs use TF32
            tensor cores for float32 matmuls; ``null``: PyTorch's own (``highest``).
    """

    def __init__(
        self,
        keep_freed_host_memory: bool = True,
        compile: bool = False,
        matmul_precision: Literal["highest", "high", "medium"] | None = None,
    ) -> None:
        self.keep_freed_host_memory = keep_freed_host_memory
        self.compile = compile
        self.matmul_precision = matmul_precision

    def callbacks(self, given: list[Callback]) -> list[Callback]:
        """The switches this turns on, less those of a kind ``given`` already holds (a config of a copy made before
        1.0.0 lists them as callbacks)."""
        from lightkeep.speed.host_memory import KeepFreedHostMemory

        wanted: list[Callback] = [KeepFreedHostMemory()] if self.keep_freed_host_memory else []
        wanted += [Compile()] if self.compile else []
        wanted += [MatmulPrecision(self.matmul_precision)] if self.matmul_precision is not None else []
        return [c for c in wanted if not any(type(g) is type(c) for g in given)]
