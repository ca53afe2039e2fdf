"""The one line a run starts with: where it writes, what it resumed from, and which guarantee user code opted out of."""

from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint, SpikeDetection, StochasticWeightAveraging
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger, WandbLogger
from lightning.pytorch.loggers.logger import DummyLogger
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.utilities import CombinedLoader

from lightkeep.checkpoint_policy import CheckpointPolicy
from lightkeep.compat_torch import crc32_setting_is_per_thread
from lightkeep.elastic import data_parallel_world
from lightkeep.loaders import ResumableDataLoader, ResumableSampler
from lightkeep.own_orders import ReplaysOwnOrder
from lightkeep.resume import ExactResume
from lightkeep.runs import RunPlan
from lightkeep.speed.switches import SpeedSwitch
from lightkeep.stream_resume import StreamLoader, StreamResume, saves_its_state
from lightkeep.tuners import TunersOnceARun
from lightkeep.user_loaders import UserLoaders


class Guarantees(Callback):
    """Rank 0 prints the start line (what it says: docs/engine.md, 'The start line') when training starts; a resumed
    fit at its first batch, having compared that batch with the checkpoint's record of its next one
    (``lightkeep.next_batch``)."""

    def __init__(
        self,
        plan: RunPlan,
        unknown_loggers: list[str],
        policy: CheckpointPolicy,
        streams: StreamResume | None = None,
        resume: ExactResume | None = None,
        loaders: UserLoaders | None = None,
        switches: list[SpeedSwitch] | None = None,
    ) -> None:
        self.plan, self.unknown_loggers, self.policy, self.streams = plan, unknown_loggers, policy, streams
        self.resume, self.loaders = resume, loaders  # what verifies a resume; what says what each loader gives up
        self.switches = list(switches or [])  # the speed switches on (``speed.Speed``'s and the config's)
        self.tuners: TunersOnceARun | None = None  # what a fit's tuners do (a resume leaves them out)
        self._to_print = False

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._to_print = True
        if trainer.ckpt_path is None:  # a resume waits for its first batch, to say what it verified
            self._print(trainer, None)

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, i: int) -> None:
        if self._to_print:
            resume = self.resume
            self._print(trainer, resume.verify(trainer) if resume is not None else None)  # every rank: it gathers

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._to_print:  # a resumed fit that had no batch left to run
            self._print(trainer, ("unverified", "not verified: the resumed fit ran no training batch"))

    def _print(self, trainer: L.Trainer, verdict: tuple[str, str] | None) -> None:
        self._to_print = False
        if trainer.is_global_zero:
            print(self.line(trainer, verdict), flush=True)

    # validate/test/predict: where their results go and which weights they evaluate, in one line too, e.g.
    # ``Run runs/digits/version_4 (test of runs/digits/version_3/checkpoints/last.ckpt, step 50) | 1 x cpu | logs: ...``
    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.state.fn == "validate":
            self._evaluation_line(trainer)

    def _evaluation_line(self, trainer: L.Trainer, *_: Any) -> None:
        if not trainer.is_global_zero:
            return
        stage = trainer.state.fn.value  # "validate", "test" or "predict"
        plan, path = self.plan, trainer.ckpt_path  # the file this evaluation loaded: --ckpt_path, or test after fit's
        if path is not None and plan.resumed_from is not None and Path(path) == Path(plan.resumed_from):
            weights = f"{path}, step {plan.global_step}"
        elif path is not None:
            weights = str(path)
        elif trainer.global_step:  # test after a fit that kept no best checkpoint
            weights = f"the weights fit ended with, step {trainer.global_step}"
        else:
            weights = "untrained weights"
        split = "val" if stage == "validate" else stage
        notes = self._loader_notes().get(split, []) + (limit_notes(trainer, split) if split != "predict" else [])
        print(
            f"Run {trainer.default_root_dir} ({stage} of {weights}) | {self._ranks(trainer)} | logs: "
            f"{self._logs(trainer)}" + (" | opts out: " + "; ".join(notes) if notes else ""),
            flush=True,
        )

    on_test_start = on_predict_start = _evaluation_line

    @staticmethod
    def _ranks(trainer: L.Trainer) -> str:
        return f"{trainer.world_size} x {trainer.strategy.root_device.type}"  # Lightning's "GPU available" line

    def _logs(self, trainer: L.Trainer) -> str:
        loggers = [logger for logger in trainer.loggers if not isinstance(logger, DummyLogger)]  # fast_dev_run's
        logs = ", ".join(type(logger).__name__ for logger in loggers) or "none"
        held = [type(lg).__name__ for lg in loggers if not isinstance(lg, (TensorBoardLogger, CSVLogger))]
        if held:
            # W&B's own process writes what it is handed later: measured (wandb 0.31, offline, killed at step 28 of
            # a run whose values up to step 25 were handed over), the killed run's file held none of them
            wandb = any(isinstance(lg, WandbLogger) for lg in loggers)
            lost = "; W&B writes them from its own process later: a kill -9 can lose them" if wandb else ""
            logs += f" ({', '.join(held)}: values handed over at each checkpoint{lost})"
        return logs

    def line(self, trainer: L.Trainer, verdict: tuple[str, str] | None = None) -> str:
        plan = self.plan
        if plan.continues:
            start = f"continues from step {plan.global_step} of {plan.resumed_from}"
        elif plan.resumed_from is not None:
            start = f"new version, from {plan.resumed_from} (step {plan.global_step})"
        else:
            start = "fresh"
        out: list[str] = []
        if not any(isinstance(c, ModelCheckpoint) for c in trainer.checkpoint_callbacks):
            out.append("checkpointing is off: nothing to resume from")
        loaders = CombinedLoader(trainer.train_dataloader).flattened if trainer.train_dataloader is not None else []
        notes = self._loader_notes()
        out += notes.get("train", [])
        out += self.streams.notes(trainer) if self.streams is not None else []
        kept = [dl for dl in loaders if saves_its_state(dl) or isinstance(dl, StreamLoader | ReplaysOwnOrder)]
        if len(kept) < len(loaders) and not notes.get("train"):
            out.append("a train loader not from a hook (given to fit): a mid-epoch resume restarts that epoch's data")
        elif any(isinstance(dl, ResumableDataLoader) and type(dl.sampler) is not ResumableSampler for dl in loaders):
            out.append("overfit_batches: a mid-epoch resume loads the consumed batches again to skip them")
        out += notes.get("val", [])  # built by now unless the sanity check is off
        out += limit_notes(trainer, "val") if trainer.enable_validation else []
        resume = self.resume
        out += resume.notes(trainer, trainer.lightning_module) if resume is not None else []
        if not torch.are_deterministic_algorithms_enabled() and trainer.strategy.root_device.type == "cuda":
            out.append("deterministic is off: nondeterministic CUDA kernels, so a resume is close, not bitwise equal")
        elif torch.is_deterministic_algorithms_warn_only_enabled() and trainer.strategy.root_device.type == "cuda":
            out.append(
                "deterministic: warn: ops with no deterministic CUDA kernel (each named once in a warning) run "
                "nondeterministically, so a resume through them is close, not bitwise equal"
            )
        if any(isinstance(callback, StochasticWeightAveraging) for callback in trainer.callbacks):  # the user's own
            out.append(SWA)
        if any(isinstance(callback, SpikeDetection) for callback in trainer.callbacks):
            out.append(SPIKES)
        if isinstance(trainer.strategy, ModelParallelStrategy) and trainer.world_size > 1:
            out.append("sharded: each rank evaluates a padded share, so a few validation samples count twice")
        out += [
            f"logger {name}: unknown to the engine, a resume starts a new run in it" for name in self.unknown_loggers
        ]
        out += [
            f"{name}: not run on this resume (nor at a later epoch, for a subclass that searches there), which "
            "continues with the rate and batch size the checkpoint holds (its search would leave the checkpoint's "
            "optimizer, schedule and step unrestored)"
            for name in (self.tuners.not_run_again if self.tuners is not None else [])
        ]
        if verdict is not None:  # a resume: what its first batch showed
            exact = verdict[1] + ("; see opts out" if out else "")
        else:  # a promise: checked when kept
            exact = "see opts out" if out else "yes, also mid-epoch (each resume checks its first batch)"
        elastic = f" | elastic: {resume.batches.note}" if resume is not None and resume.batches.note else ""
        streams = self.streams.describe() if self.streams is not None else []
        elastic += " | streams: " + "; ".join(streams) if streams else ""  # what resuming each one costs
        line = (
            f"Run {trainer.default_root_dir} ({start}) | {self._ranks(trainer)} | exact resume: {exact}{elastic}"
            f" | logs: {self._logs(trainer)}"
        )
        off, moved = self.policy.off(trainer), self.policy.notes()
        line += " | opts out: " + "; ".join(out) if out else ""
        line += " | " + "; ".join(moved) if moved else ""
        return line + (" | off: " + "; ".join(off) if off else "") + speed_switches(trainer, self.switches)

    def _loader_notes(self) -> dict[str, list[str]]:
        """Per split, the guarantees the loaders that ``UserLoaders`` left alone give up."""
        return self.loaders.notes if self.loaders is not None else {}


# Lightning's callback sets up its SWALR scheduler and its count of models averaged in ``on_train_epoch_start``, which a
# resume mid-epoch skips, and ``on_fit_start`` clears the restored schedulers: measured, the resumed run's SWALR one
# step behind and its final average different. Its ``EMAWeightAveraging``/``WeightAveraging`` resume exactly.
SWA = (
    "StochasticWeightAveraging: Lightning's callback starts its SWALR schedule and its average at an epoch's start, "
    "so a resume mid-epoch continues them inexactly (a resume at an epoch's end is exact)"
)


# Its state_dict holds its torchmetrics window without the values (their states are not persistent): measured, the
# resumed run's window empty, the weights bit-equal.
SPIKES = (
    "SpikeDetection: its window of recent losses is in no checkpoint (Lightning saves none of it), so after a resume "
    "it judges spikes against a window that starts empty"
)


def limit_notes(trainer: L.Trainer, split: str) -> list[str]:
    """``limit_val_batches``/``limit_test_batches``, or an evaluation loader's ``drop_last``, on more than one
    data-parallel rank, in the start line's words: Lightning cuts each rank's own batches (to the limit; its short
    last one), while the engine gives each evaluation sample to exactly one rank, so the ranks may evaluate other
    samples than one process would. Counted from the engine's split where a loader has it (named only where the
    samples differ), else a limit is named as possible."""
    name, stage = f"limit_{split}_batches", {"val": "validation", "test": "test"}[split]
    limit = getattr(trainer, name)
    limited = bool(limit) and not (isinstance(limit, float) and limit >= 1.0)
    world = data_parallel_world(trainer)
    if world < 2:
        return []
    loaders = getattr(trainer, f"{split}_dataloaders")
    flat = CombinedLoader(loaders).flattened if loaders is not None else [None]  # None: not built yet
    notes = []
    for i, loader in enumerate(flat):
        where = f"{split} loader {i}: " if len(flat) > 1 else ""
        sampler, size = getattr(loader, "sampler", None), getattr(loader, "batch_size", None)
        if limited:
            what, cut_at = f"{name} {limit}", limit
        elif getattr(loader, "drop_last", False):  # each rank drops its own short last batch, one process one
            what, cut_at = "drop_last", 1.0
        else:
            continue
        if not isinstance(sampler, ResumableSampler) or not size:
            notes.append(
                f"{where}{what} applies per rank: each of the {world} ranks cuts its own share of the "
                f"{stage} samples, so its values may not be one process's"
            )
            continue
        shares = _shares(sampler)
        cut = per_rank_limit(cut_at, shares, sampler.total, size, bool(loader.drop_last))
        if cut is not None:
            (batches, samples), (one_batches, one_samples) = cut
            than = f"where one process evaluates {one_batches} ({one_samples})"
            than = than if samples != one_samples else f"not the {one_samples} one process evaluates"
            notes.append(
                f"{where}{what} applies per rank: {len(shares)} ranks evaluate {batches} batches "
                f"({samples} samples) a {stage} {than}, so its values are not one process's"
            )
    return notes


def per_rank_limit(
    limit: int | float, shares: list[int], total: int, batch_size: int, drop_last: bool
) -> tuple[tuple[int, int], tuple[int, int]] | None:
    """What Lightning's ``limit_*_batches`` (an int: batches; a float: a fraction of them, rounded down), applied to
    each rank's own batches, leaves of an evaluation of ``total`` samples whose order the engine splits as rank ``r``
    of ``W = len(shares)`` taking its positions ``r, r + W, ...`` (``shares[r]`` of them): ``((batches, samples) of
    the W ranks, (batches, samples) of one process)``, or ``None`` where the W ranks evaluate the very samples one
    process does (the first ones of the order)."""

    def cut(samples: int) -> tuple[int, int]:
        batches = samples // batch_size if drop_last else -(-samples // batch_size)
        kept = min(batches, limit) if isinstance(limit, int) else int(batches * limit)  # Lightning's rule
        return kept, min(kept * batch_size, samples)

    world, ranks, one = len(shares), [cut(share) for share in shares], cut(total)
    # the first one[1] positions, each on exactly one rank: rank r's are those r + W * j below one[1]
    if all(samples == len(range(r, one[1], world)) for r, (_, samples) in enumerate(ranks)):
        return None
    return (sum(batches for batches, _ in ranks), sum(samples for _, samples in ranks)), one


def _shares(sampler: ResumableSampler) -> list[int]:
    """The samples of each rank's share, as ``ResumableSampler`` splits its order."""
    world = sampler.num_replicas
    if sampler.drop_last:
        return [sampler.total // world] * world
    if sampler.pad:
        return [sampler.num_samples] * world
    return [len(range(r, sampler.total, world)) for r in range(world)]


def speed_switches(trainer: L.Trainer, switches: list[SpeedSwitch]) -> str:
    """`` | speed: ...``, the speed switches on in this run that change more than the loop (each set for the run and
    undone after: ``lightkeep.run_scope``, ``host_memory``); empty when none is."""
    from lightkeep import run_scope
    from lightkeep.checkpoint_io import AtomicCheckpointIO
    from lightkeep.compat_logging import moves_skipped
    from lightkeep.speed import host_memory

    on = ["malloc keeps freed memory"] if host_memory.in_force else []
    on += ["heap frozen (gc)"] if run_scope.heap_frozen() else []
    on += ["self.log skips moves"] if moves_skipped() else []
    io = trainer.strategy.checkpoint_io
    if isinstance(io, AtomicCheckpointIO):
        on += ["saves in the background"] if io.background else []
        on += ["no CRC-32 in checkpoints"] if not io.crc32 and crc32_setting_is_per_thread() else []
    on += [switch.describe() for switch in switches]
    return " | speed: " + ", ".join(on) if on else ""
