"""What a bit-exact resume needs beyond Lightning's checkpoint: every rank's RNG states, the states of the module's
metrics mid-epoch, a fixed number of compute threads, logs flushed at saves."""

import dataclasses
import math
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, GradientAccumulationScheduler, ModelCheckpoint
from torchmetrics import Metric

from lightkeep.compat import datamodule_state_in
from lightkeep.compat_logging import continue_epoch_accumulators, epoch_accumulators, stop_continuing_epoch_accumulators
from lightkeep.compat_loops import (
    batch_under_way,
    batches_accumulated,
    lightning_skips_the_epoch_start,
    load_the_loader_states_lightning_left,
    reopen_an_epoch_stopped_mid_way,
    rescale_batch_progress,
    start_the_epoch_after_an_ended_one,
    start_the_epoch_lightning_skipped,
    start_the_epoch_loop_afresh,
)
from lightkeep.distributed import every_rank
from lightkeep.elastic import GlobalBatch, Shape, epoch_note, has_batch_norm
from lightkeep.module_hooks import own_hook
from lightkeep.next_batch import record, verdict, watch
from lightkeep.plain_state import record_unsaved, unsaved_notes
from lightkeep.sample_seeds import generator_states, set_generator_states
from lightkeep.sharded.strategy import ShardedStrategy


class ExactResume(Callback):
    """Puts in each checkpoint what Lightning leaves out and a bit-exact resume needs.

    - Every rank's torch, CUDA, numpy and Python RNG states, restored on resume.
    - Every rank's states of the module's torchmetrics ``Metric``s that training has updated (an epoch's
      ``train/acc`` so far), set again when the resumed run continues that epoch mid-way, so the epoch's value is
      the uninterrupted run's. Kept beside the module's ``state_dict``, which stays the weights alone. Under more
      than one rank a metric with list states (e.g. ``AUROC``'s) is not kept: its epoch value after a mid-epoch
      resume covers the resumed part only.
    - The number of CPU compute threads, fixed for the run and checked on resume. A CPU matmul splits its sums
      over the threads it runs on, so the same step on 1 and on 2 threads differs in the last bits (here: the
      last layer's weight gradient, from the first step on). Until ``torch.set_num_threads`` is called, MKL may
      also run a call on fewer threads than asked (MKL_DYNAMIC; ``MKL_VERBOSE=1`` prints ``Dyn:1``); setting the
      count PyTorch already uses turns that off (``Dyn:0``) and changes nothing else.
    - The loggers' buffers are flushed (at each checkpoint, and once Lightning has logged that step), so no point
      logged before the checkpoint is lost if the process is killed after it (the resumed run's ``purge_step``
      drops those logged after it).

    Lightning checkpoints hold no RNG state, so dropout masks (and anything else drawn from the global
    generators) differ after a resume. ``state_dict`` runs on every rank while a checkpoint is assembled, so the
    states are gathered there; rank 0 writes them all. They are set again in ``on_train_start``: after model
    init, the sanity check and the data setup (which all draw or may draw), right before the first batch.

    It also saves the run's shape (ranks, per-device batch, accumulation; ``lightkeep.elastic``) and the samples
    of one of its epochs: a resume on another number of ranks keeps the global batch (``elastic.GlobalBatch``,
    which the train loader's builder plans), rewrites the loop's micro-batch counts here, and ``notes`` says what
    cannot follow to the start line (an epoch that ``limit_train_batches`` now ends at other samples among them).

    And a fingerprint of the batch the run trains on next (``lightkeep.next_batch``): a resumed run compares its
    first batch with it, and the start line says ``resume verified`` or names the first difference (``verify``).
    """

    def __init__(self, batches: GlobalBatch | None = None) -> None:
        self._trainer: L.Trainer | None = None
        self._to_restore: list[dict[str, torch.Tensor]] | None = None
        # the run's shape: the CLI gives the train loader's builder the same instance, which plans it
        self.batches = batches if batches is not None else GlobalBatch()
        self.judge: ModelCheckpoint | None = None  # the run's checkpoint with a monitor: named in each checkpoint
        self.saved_epoch_samples: int | None = None  # what an epoch of the checkpoint's run trained, over all ranks
        self.saved_world: int | None = None  # ranks whose RNG states the checkpoint holds
        self._flush_before_next_batch = False
        self._metrics: dict[str, Metric] = {}
        self._not_trained: dict[str, Metric] = {}  # not updated by a training step yet: validation's, or unused
        self._metrics_to_restore: list[dict[str, dict[str, Any]]] | None = None
        # each rank's running sums of the tensors training logged with on_epoch=True (compat_logging), given back
        # on a resume mid-epoch
        self._logged_to_restore: list[dict[str, dict[str, torch.Tensor]]] | None = None
        self._loaded = False  # the checkpoint resumed from held this callback's state
        self._mid_step = 0  # the batches into an accumulation the checkpoint was saved at
        self._mid_batch: list[int] | None = None  # [epoch, batch] under way when the checkpoint was saved
        self._scheduled = False  # a resumed fit's first batch sets a GradientAccumulationScheduler's accumulation
        # Lightning skipped on_train_epoch_start of the epoch this resume lands in (compat_loops): the module's is
        # called at on_train_start, callbacks of the user's own with the hook are named in the start line (``notes``)
        self._epoch_start_skipped = False
        self._next_batch: list[Any] | None = None  # the checkpoint's records of its next batch
        self._verdict: tuple[str, str] | None = None
        self._epoch_loop_afresh = False  # the checkpoint's ended epoch was counted complete (compat)
        self._threads_saved: int | None = None  # the CPU threads the checkpoint was computed on
        self._saved_lrs: list[list[float]] | None = None  # each optimizer's param groups' rates in the checkpoint
        self._lr_changed: str | None = None  # how this resume's rates differ from them when training starts
        # set by lightkeep.tuners while a fresh fit's tuners save and restore their temporary checkpoint: not a resume
        self.loads_are_a_tuners = False
        self._saved_data_state: Any = None  # the data module's state_dict in the checkpoint
        self._unsaved: dict[str, Any] = {}  # the checkpoint's record of state no checkpoint holds (plain_state)

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._trainer = trainer
        self._metrics = {name: m for name, m in pl_module.named_modules() if isinstance(m, Metric)}
        self._not_trained = dict(self._metrics)
        self._threads_saved = None
        # The count stays as it is; MKL stops choosing its own per call (mkl_set_dynamic(false)). The one setting of
        # the engine that outlives the run: PyTorch cannot turn MKL's own choice back on, and it changes no result.
        # It is process-wide: DataLoader's pin-memory thread (only with an accelerator) turns it off too when it starts,
        # at a moment that depends on the loader; set here, before the first loader, that moment changes nothing.
        torch.set_num_threads(torch.get_num_threads())

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        _flush_loggers(trainer, each_save=True)
        self._flush_before_next_batch = True
        reopen_an_epoch_stopped_mid_way(checkpoint)

    def on_load_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        if self.loads_are_a_tuners:
            return
        # Under max_steps Lightning ends an epoch-end checkpoint's epoch again: the next epoch would draw the order of
        # the one after it (any monitored or every-N-epochs checkpoint; plain Lightning's too)
        if trainer.state.fn == "fit" and start_the_epoch_after_an_ended_one(checkpoint, trainer.max_steps):
            self._epoch_loop_afresh = True
        self._saved_lrs = _param_group_lrs(checkpoint.get("optimizer_states"))
        self._saved_data_state = datamodule_state_in(checkpoint, trainer.datamodule)

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, idx: int) -> None:
        if self._scheduled:  # before the batch: Lightning reads the accumulation as it runs it
            self._scheduled = False
            _set_the_scheduled_accumulation(trainer)
        metrics, self._metrics_to_restore = self._metrics_to_restore, None
        if metrics is not None and idx > 0:  # mid-epoch; a resume at an epoch's start begins it afresh
            _set_metric_states(self._metrics, metrics[trainer.global_rank])
        logged, self._logged_to_restore = self._logged_to_restore, None
        if logged is not None and idx > 0:
            continue_epoch_accumulators(trainer, logged[trainer.global_rank])
        # Lightning hands a step's values (and an epoch's, train/acc ...) to the loggers after the batch-end and
        # epoch-end hooks where checkpoints are saved, and a resume from that checkpoint does not log them again:
        # each went out as it came (flush_each_save), as a kill may come before this hook (while the next batch
        # loads, or in an earlier callback's hook); out here at the latest.
        if self._flush_before_next_batch:
            _flush_loggers(trainer, each_save=False)
            self._flush_before_next_batch = False

    def on_train_batch_end(self, *_: Any) -> None:
        # Validation's metrics are reset once it ends, before this hook: what is updated here, training updated.
        # (Empty after the first steps of most modules: a few property reads per step.)
        for name in [name for name, metric in self._not_trained.items() if metric.update_called]:
            del self._not_trained[name]

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        stop_continuing_epoch_accumulators(trainer)  # a key the resumed epoch did not log again

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        stop_continuing_epoch_accumulators(trainer)

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        stop_continuing_epoch_accumulators(trainer)  # Lightning skips teardown after some exceptions

    def state_dict(self) -> dict[str, Any]:
        trainer = self._trainer
        threads = torch.get_num_threads()
        shape = self.batches.shape
        more: dict[str, Any] = {"shape": dataclasses.asdict(shape)} if shape is not None else {}
        if shape is not None and trainer is not None and trainer.num_training_batches < math.inf:
            # limit_train_batches counts micro-batches: what an epoch was in samples, for a resume on another shape
            more["epoch_samples"] = int(_epoch_samples(trainer, shape))
        if trainer is not None and trainer.lightning_module is not None:
            more.update(record_unsaved(trainer))
        if self.judge is not None:  # what ranks the run's files (lightkeep.judge), not parsed back from a state key
            more["judge"] = {"monitor": self.judge.monitor, "mode": self.judge.mode, "state_key": self.judge.state_key}
        trained = {name: m for name, m in self._metrics.items() if name not in self._not_trained}
        if trainer is not None and trainer.state.fn == "fit" and trainer.train_dataloader is not None:
            more["next_batch"] = record(trainer)  # leaves the generators as they were
            # a save in the middle of an optimizer step's batches (a ModelCheckpoint's of the user's on a timer, at a
            # validation within a step): their gradients are in no checkpoint, which the resume says
            more["mid_step"] = batches_accumulated(trainer)
            # a save from an exception (OnExceptionCheckpoint's) while a batch was fetched and not trained: the
            # position and the record count that batch as trained
            under_way = batch_under_way(trainer)
            more["mid_batch"] = [trainer.current_epoch, under_way] if under_way is not None else None
        # this rank's running sums of values logged on_epoch: a few scalars, on the CPU
        logged = epoch_accumulators(trainer) if trainer is not None and trainer.state.fn == "fit" else {}
        if trainer is None or trainer.world_size == 1:
            return {"ranks": [generator_states()], "metrics": [_metric_states(trained)], "logged": [logged],
                    "threads": threads, **more}  # fmt: skip
        # the same metrics on every rank, so that every rank runs the same gathers
        flags = torch.tensor([name not in self._not_trained for name in self._metrics], dtype=torch.uint8)
        device = trainer.strategy.root_device  # NCCL gathers only device tensors
        anywhere = trainer.strategy.all_gather(flags.to(device)).cpu().amax(0).bool().tolist()
        trained = {name: m for (name, m), keep in zip(self._metrics.items(), anywhere, strict=True) if keep}
        trained = {name: m for name, m in trained.items() if all(map(torch.is_tensor, m.metric_state.values()))}
        states = {f"metric:{name}/{k}": v.detach() for name, m in trained.items() for k, v in m.metric_state.items()}
        mine = {**generator_states(), **states}
        gathered = {k: trainer.strategy.all_gather(v.to(device)).cpu() for k, v in mine.items()}
        # clone: a view would be saved with (and set_rng_state would read from) the start of the whole storage
        ranks = [{k: v[r].clone() for k, v in gathered.items()} for r in range(trainer.world_size)]
        rng = [{k: v for k, v in rank.items() if not k.startswith("metric:")} for rank in ranks]
        metrics = [
            _nest({k[len("metric:") :]: v for k, v in rank.items() if k.startswith("metric:")}) for rank in ranks
        ]
        # each its own keys: what a rank logs may differ
        return {"ranks": rng, "metrics": metrics, "logged": every_rank(logged), "threads": threads, **more}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.loads_are_a_tuners:  # its shape would be taken for a checkpoint's run to keep the global batch of
            return
        self._loaded = True
        self._to_restore = state_dict["ranks"]
        self._metrics_to_restore = state_dict.get("metrics")  # absent from checkpoints of earlier versions
        self._logged_to_restore = state_dict.get("logged")  # absent from those of engine 1.7.0 and before
        self.saved_world = len(state_dict["ranks"])
        self.batches.saved = Shape(**state_dict["shape"]) if "shape" in state_dict else None
        self.saved_epoch_samples = state_dict.get("epoch_samples")
        self._threads_saved = state_dict.get("threads")  # absent from checkpoints written before it was saved
        self._next_batch = state_dict.get("next_batch")  # absent from those written before it was recorded
        self._mid_step = state_dict.get("mid_step", 0)
        self._mid_batch = state_dict.get("mid_batch")
        self._unsaved = {key: state_dict[key] for key in ("lists", "values") if key in state_dict}

    def verify(self, trainer: L.Trainer) -> tuple[str, str]:
        """``("verified" | "differs" | "unverified", words)`` for the start line: the resumed run's first batch
        against the checkpoint's record. Call it on every rank at the first training batch (it gathers once)."""
        if self._verdict is None:
            self._verdict = verdict(trainer, self._next_batch, resumed_from_lightning=not self._loaded)
            differs, no = self._verdict[0] == "differs", None
            if self._mid_batch is not None:
                epoch, batch = self._mid_batch
                no = (
                    f"the checkpoint was saved while training batch {batch} of epoch {epoch} was under way (an "
                    "exception's save, as OnExceptionCheckpoint's): the resume goes on after that batch, which was "
                    "never trained, with the random streams as they were at the exception"
                )
            elif self._lr_changed is not None and not differs:
                no = self._lr_changed
            elif not differs and (changed := _data_state_change(self._saved_data_state, trainer)):
                no = changed
            elif self._mid_step:
                no = (
                    f"the checkpoint was saved {self._mid_step} batch(es) into optimizer step "
                    f"{trainer.global_step + 1}'s gradient accumulation, whose gradients no checkpoint holds: that "
                    "step is taken on its remaining batches only (the engine's own saves wait for the step)"
                )
            if no is not None:
                self._verdict = ("differs", f"no: {no}")
        return self._verdict

    def notes(self, trainer: L.Trainer, pl_module: L.LightningModule) -> list[str]:
        """What of the original run this resume cannot continue exactly, for the start line: a plain Lightning
        checkpoint, other CPU threads or ranks, list-state metrics under DDP, another epoch length, counts no
        checkpoint holds, epoch-start hooks Lightning skips, a resized batch."""
        out = []
        if trainer.ckpt_path is not None and not self._loaded:
            out.append(
                "the checkpoint holds no resume state of the engine's (plain Lightning wrote it): the random streams, "
                "the data position within the epoch and the epoch's metric states start afresh; weights, optimizer, "
                "LR schedule and step counters continue"
            )
        saved = self._threads_saved
        if saved is not None and saved != torch.get_num_threads() and trainer.strategy.root_device.type == "cpu":
            out.append(
                f"the checkpoint was computed on {saved} CPU thread(s), this run on {torch.get_num_threads()}: a CPU "
                f"matmul sums in another order, so results differ in the last bits (OMP_NUM_THREADS={saved} on a "
                "machine with that many cores resumes bit-exact)"
            )
        listed = sorted(n for n, m in self._metrics.items() if not all(map(torch.is_tensor, m.metric_state.values())))
        if listed and trainer.world_size > 1:  # their states are gathered across ranks as tensors of one shape
            out.append(
                f"torchmetrics with list states ({', '.join(listed[:3])}{', ...' if len(listed) > 3 else ''}) are not "
                "kept in checkpoints under DDP: if training updates them, their epoch value after a mid-epoch resume "
                "covers only the batches after it"
            )
        # (under sharding its "Resharded ... from N ranks to M" line says so already)
        resharded = isinstance(trainer.strategy, ShardedStrategy)
        if self.saved_world is not None and self.saved_world != trainer.world_size and not resharded:
            out.append(
                f"the checkpoint holds the random streams of {self.saved_world} rank(s), this run has "
                f"{trainer.world_size}: draws from a rank's generators (dropout, augmentation) differ from the "
                "original run from here on; randomness seeded per sample from (seed, epoch, index) follows; a resume "
                "mid-epoch logs this epoch's training values over the batches after it"
            )
        shape, resized = self.batches.shape, self.batches.resized
        if self.saved_epoch_samples is not None and shape is not None and self.batches.saved != shape:
            samples = _epoch_samples(trainer, shape)
            note = epoch_note(trainer.limit_train_batches, samples, self.saved_epoch_samples, shape)
            out += [note] if note is not None else []
        out += unsaved_notes(self._unsaved, trainer) if trainer.ckpt_path is not None else []
        if self._epoch_start_skipped:
            skipped = [type(c).__name__ for c in trainer.callbacks if own_hook(c, "on_train_epoch_start", Callback)]
            if skipped:
                out.append(
                    f"on_train_epoch_start of {', '.join(skipped)}: Lightning does not call a callback's epoch start "
                    "on a resume inside an epoch, so what it sets for the epoch is as this process built it until the "
                    "next epoch"
                )
            if own_hook(pl_module, "on_train_epoch_start", L.LightningModule):
                module = type(pl_module).__name__
                out.append(
                    f"on_train_epoch_start of {module}: called again on this resume inside an epoch (Lightning skips "
                    "it): what it sets from the epoch continues exactly, what it adds to (a list or count the "
                    "checkpoint holds) gets this epoch twice"
                )
        resized_now = resized is not None and resized[0] != resized[1]
        if resized_now and any(isinstance(c, GradientAccumulationScheduler) for c in trainer.callbacks):
            out.append(
                "GradientAccumulationScheduler: its accumulation counts this run's micro-batches, so from its next "
                "change on the global batch is not the checkpoint's run's"
            )
        if resized_now and has_batch_norm(pl_module):
            before, after = resized
            out.append(
                f"BatchNorm: its statistics now come from micro-batches of {after} samples over all ranks "
                f"({before} before), so the run continues close to, not equal to, the original"
            )
        return out

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._epoch_loop_afresh:  # the next epoch starts as a fresh one, as Lightning does without max_steps
            start_the_epoch_loop_afresh(trainer)
            self._epoch_loop_afresh = False
        if trainer.ckpt_path is not None:
            resized = self.batches.resized
            self._scheduled = resized is None or resized[0] == resized[1]
            load_the_loader_states_lightning_left(trainer)  # after estimated_stepping_batches (Lightning #20550)
            watch(trainer)  # its first batch, for ``verify``
            # after FitScheduleToRun's on_train_start (listed before this callback): an LR schedule fitted to the run
            # (a plateau schedule's step pending at the save is taken at this start: lightkeep.monitored_values)
            plateaus = {id(c.scheduler.optimizer) for c in trainer.lr_scheduler_configs if c.reduce_on_plateau}
            self._lr_changed = _lr_change(self._saved_lrs, trainer.optimizers, plateaus)
            if lightning_skips_the_epoch_start(trainer):
                # before the epoch's iterator fetches a batch (a curriculum stage set on the dataset reaches it) and
                # before the random streams are set (draws it makes are the uninterrupted run's, made before its save)
                start_the_epoch_lightning_skipped(trainer, pl_module)
                self._epoch_start_skipped = True
        resized = self.batches.resized
        if resized is not None and resized[0] != resized[1]:
            rescale_batch_progress(trainer, *resized)
        ranks, self._to_restore = self._to_restore, None
        if ranks is None:
            return
        if len(ranks) != trainer.world_size:  # another number of ranks: the start line says what does not follow
            self._metrics_to_restore = None  # each rank's share of an epoch's metrics belongs to its old data split
            self._logged_to_restore = None
            return
        set_generator_states(ranks[trainer.global_rank])


def _data_state_change(saved: Any, trainer: L.Trainer) -> str | None:
    """Where the data module's ``state_dict`` at a resumed fit's first batch is not the checkpoint's, which it is in
    the uninterrupted run at that point: said, else ``None``."""
    datamodule = trainer.datamodule
    if saved is None or datamodule is None:
        return None
    now = datamodule.state_dict()
    where = _first_difference(saved, now, "")
    if where is None:
        return None
    return (
        f"{type(datamodule).__name__}.state_dict(){where} at this resume's first batch is not the checkpoint's: "
        "a hook ran again on the resume and changed it (train_dataloader, which Lightning calls again for the epoch "
        "a resume lands in), so the data from here on may not be the uninterrupted run's"
    )


def _first_difference(a: Any, b: Any, path: str) -> str | None:
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b), key=str):
            if key not in a or key not in b:
                return f"{path}[{key!r}]"
            found = _first_difference(a[key], b[key], f"{path}[{key!r}]")
            if found is not None:
                return found
        return None
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        if len(a) != len(b):
            return path
        pairs = enumerate(zip(a, b, strict=True))
        return next((found for i, (x, y) in pairs if (found := _first_difference(x, y, f"{path}[{i}]"))), None)
    if torch.is_tensor(a) or torch.is_tensor(b):
        same = torch.is_tensor(a) and torch.is_tensor(b) and a.shape == b.shape and torch.equal(a.cpu(), b.cpu())
        return None if same else path
    try:
        return None if a == b else f"{path} ({b!r} where the checkpoint held {a!r})"  # a: saved, b: now
    except Exception:  # a value that cannot be compared: not a difference found
        return None


def _param_group_lrs(states: Any) -> list[list[float]] | None:
    """The learning rate of each param group of each optimizer in a checkpoint's ``optimizer_states`` (``None``
    where it holds none in that form: a weights-only save, a sharded one)."""
    try:
        return [[float(group["lr"]) for group in state["param_groups"]] for state in states]
    except (KeyError, TypeError, ValueError):
        return None


def _lr_change(saved: list[list[float]] | None, optimizers: list[Any], skipped: set[int]) -> str | None:
    """The first param group whose rate at the start of a resumed fit is not the one the checkpoint holds, which
    is the rate its run would have used next (Lightning restores both the optimizer and the schedule): said, else
    ``None``. Optimizers whose ``id`` is in ``skipped`` are not compared."""
    now = [[float(group["lr"]) for group in optimizer.param_groups] for optimizer in optimizers]
    if saved is None or [len(groups) for groups in saved] != [len(groups) for groups in now]:
        return None
    for i, (before, after) in enumerate(zip(saved, now, strict=True)):
        if id(optimizers[i]) in skipped:
            continue
        for j, (was, rate) in enumerate(zip(before, after, strict=True)):
            if was != rate:
                return (
                    f"optimizer {i}'s param group {j} resumes at learning rate {rate:.6g}, where the checkpoint's run "
                    f"would have trained on at {was:.6g}: something set it again on this resume (an LR schedule "
                    "fitted to another length of run, a changed setting, a callback's on_train_start)"
                )
    return None


def _set_the_scheduled_accumulation(trainer: L.Trainer) -> None:
    """A ``GradientAccumulationScheduler`` sets the epoch's accumulation in ``on_train_epoch_start``, which Lightning
    does not call on a resume mid-epoch or from an epoch's last batch end: the resumed run accumulated as configured
    (measured: 20 optimizer steps where the uninterrupted run took 18). Its value is a function of the epoch."""
    for callback in trainer.callbacks:  # the user's own: Lightning's callback, found as the start line finds SWA
        if isinstance(callback, GradientAccumulationScheduler):
            trainer.accumulate_grad_batches = callback.get_accumulate_grad_batches(trainer.current_epoch)


def _epoch_samples(trainer: L.Trainer, shape: Shape) -> float:
    """Samples over all ranks of one training epoch, after ``limit_train_batches`` (``math.inf``: no length)."""
    return trainer.num_training_batches * shape.world * shape.batch_size


def _flush_loggers(trainer: L.Trainer, each_save: bool) -> None:
    """Every logger's values out; ``each_save``: a ``ThrottledTensorBoardLogger`` hands over each value as it comes
    until the next batch (``flush_each_save``)."""
    for logger in trainer.loggers:
        if hasattr(logger, "flush"):  # ThrottledTensorBoardLogger: the values it holds back
            logger.flush()
        else:
            logger.save()
            # Lightning's Logger has no ``experiment``: a logger written from its docs may not have one
            flush = getattr(getattr(logger, "experiment", None), "flush", None)
            if callable(flush):
                flush()
        if hasattr(logger, "flush_each_save"):
            logger.flush_each_save = each_save


def _metric_states(metrics: dict[str, Metric]) -> dict[str, dict[str, Any]]:
    """``{metric name: {state name: tensor, or list of tensors}}``, detached copies on the CPU."""

    def copy(value: Any) -> Any:
        return [copy(v) for v in value] if isinstance(value, list) else value.detach().cpu().clone()

    return {name: {k: copy(v) for k, v in metric.metric_state.items()} for name, metric in metrics.items()}


def _nest(flat: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    nested: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in flat.items():
        name, _, state = key.rpartition("/")
        nested.setdefault(name, {})[state] = value
    return nested


def _set_metric_states(metrics: dict[str, Metric], saved: dict[str, dict[str, Any]]) -> None:
    for name, states in saved.items():
        metric = metrics.get(name)
        if metric is None:  # a module whose metrics changed since the save: it starts them afresh
            continue
        for key, value in states.items():
            moved = [v.to(metric.device) for v in value] if isinstance(value, list) else value.to(metric.device)
            setattr(metric, key, moved)
