"""The private Lightning APIs of the fit loop the engine relies on, each behind a function whose docstring says what it
reads and why: the loop's saved and live counters, its restart state, the batches its fetcher holds, how it combines
several train loaders, the order of its hooks. tests/test_compat.py tests each name; on a layout these functions do
not know they raise ``LightningChanged`` (``lightkeep.compat``).
"""

import lightning as L

from lightkeep.compat import LightningChanged, reads


def reopen_an_epoch_stopped_mid_way(checkpoint: dict) -> None:
    """A fit stopped mid-epoch (``max_time``, ``max_steps``, an early stop) counts that epoch as done before its
    end-of-fit save, so ``--ckpt_path last`` would start the next epoch (its data order, its epoch number) at the
    batch where this one stopped. The checkpoint is written as a save during that epoch would be: the epoch
    started and not yet processed. A weights-only save (no ``loops``) has nothing to reopen."""
    if "loops" not in checkpoint:
        return
    try:
        fit = checkpoint["loops"]["fit_loop"]
        batches, epochs = fit["epoch_loop.batch_progress"], fit["epoch_progress"]
        mid_epoch = not batches["is_last_batch"] and batches["current"]["completed"] > 0
        current, total = epochs["current"], epochs["total"]
        counted = current["completed"] == current["ready"] > 0
        for counts in (current, total):
            counts["processed"], counts["completed"]  # both there before either is changed
    except (KeyError, TypeError) as error:
        raise LightningChanged(f"the checkpoint's loops.fit_loop has no {error} where the engine expects it") from None
    if mid_epoch and counted:
        for counts in (current, total):
            counts["processed"] -= 1
            counts["completed"] -= 1
        checkpoint["epoch"] = current["completed"]


def start_the_epoch_after_an_ended_one(checkpoint: dict, max_steps: int) -> bool:
    """Lightning 2.6 (2.6.6 and before), in a fit with ``max_steps``: a checkpoint saved after an epoch's end (its
    validation and ``on_train_epoch_end``, where every monitored or every-N-epochs ``ModelCheckpoint`` saves) is
    resumed by ending that epoch once more. Its epoch counter counts the epoch twice, so the next epoch
    (``current_epoch`` 1) draws the data order of the one after it (the sampler's ``set_epoch(2)``), and
    ``max_epochs`` ends the run an epoch early. Without ``max_steps`` Lightning starts the next epoch as it should:
    its loops are not "restarting" (``FitLoop.restarting`` forces it for a fit with ``max_steps``). The fix is what
    Lightning does then: the checkpoint's epoch is counted complete here (before Lightning restores the loops: call
    it in ``on_load_checkpoint``; returns whether it did), and ``start_the_epoch_loop_afresh`` at ``on_train_start``
    has the epoch loop start its counts as on a fresh epoch (``reset_on_run``), not as a restart in which its first
    iteration trains nothing and counts a logged step. Upstream: the same restart logic of a fit with ``max_steps``
    is https://github.com/Lightning-AI/pytorch-lightning/issues/19617 (open); this case is to be reported there with
    ``tests/test_compat.py::test_lightning_ends_an_ended_epoch_again_under_max_steps``."""
    if max_steps == -1 or "loops" not in checkpoint:
        return False
    try:
        fit = checkpoint["loops"]["fit_loop"]
        epochs, batches = fit["epoch_progress"], fit["epoch_loop.batch_progress"]
        current = epochs["current"]
        ended = current["ready"] == current["started"] == current["processed"] == current["completed"] + 1 > 0
        if not ended or not batches["is_last_batch"]:
            return False
        for counts in (epochs["current"], epochs["total"]):
            counts["completed"] = counts["processed"]
    except (KeyError, TypeError) as error:
        raise LightningChanged(f"the checkpoint's loops.fit_loop has no {error} where the engine expects it") from None
    return True


@reads("fit_loop.epoch_loop has no {}")
def start_the_epoch_loop_afresh(trainer: L.Trainer) -> None:
    """The second half of ``start_the_epoch_after_an_ended_one``: the epoch loop (and its validation loop) not
    restarting, as without ``max_steps``. Call it in ``on_train_start``, after the fit loop's reset and before the
    epoch loop's."""
    loop = trainer.fit_loop.epoch_loop
    loop.restarting = False  # Lightning's setter: its child loops too
    loop.reset_restart_stage()


@reads("fit_loop has no {}")
def lightning_skips_the_plateau_step(trainer: L.Trainer) -> bool:
    """Whether ``FitLoop.on_advance_end`` will skip the ``ReduceLROnPlateau`` step of the epoch ending now: it steps
    only when the fit loop is not restarting, which it still is at the end of the epoch a mid-epoch resume lands in
    (and only when the epoch ran all its batches, ``epoch_loop._num_ready_batches_reached()``). Read in
    ``on_train_epoch_end``; the engine takes the step itself at the next epoch's start (``lightkeep.monitored_values``).
    (Lightning #18595; the fix proposed in docs/upstream.md.)"""
    loop = trainer.fit_loop
    return bool(loop.restarting) and loop.epoch_loop._num_ready_batches_reached()


@reads("fit_loop has no {}")
def plateau_step_pending(trainer: L.Trainer) -> bool:
    """Whether this point lies between an epoch's end hooks and Lightning's ``ReduceLROnPlateau`` step after them
    (``fit_loop.epoch_progress.current``: processed, not completed; ``epoch_loop._num_ready_batches_reached()``, the
    condition of that step): a checkpoint saved here (a ``ModelCheckpoint`` at ``on_train_epoch_end``, the default
    with validation every epoch) holds the plateau schedulers before their step of this epoch."""
    loop = trainer.fit_loop
    progress = loop.epoch_progress.current
    return progress.processed > progress.completed and loop.epoch_loop._num_ready_batches_reached()


def step_the_plateau_schedulers(trainer: L.Trainer, epoch: int) -> None:
    """The ``ReduceLROnPlateau`` steps of epoch ``epoch``'s end, taken later, as ``FitLoop.on_advance_end`` takes
    them there (``TrainingEpochLoop._update_learning_rates``): each epoch-interval plateau whose ``frequency``
    divides ``epoch + 1``, by ``trainer.callback_metrics[monitor]``, through the module's ``lr_scheduler_step``,
    counted in ``epoch_loop.scheduler_progress``. Lightning's own method counts by ``trainer.current_epoch``, the
    epoch after by then: a plateau stepping every 2 epochs would step at the wrong ones. A monitor not logged is
    left, as Lightning does when not ``strict`` (when ``strict``, the run stopped at an earlier epoch's end)."""
    module = trainer.lightning_module
    if not module.automatic_optimization:  # Lightning steps no scheduler then
        return
    try:
        progress = trainer.fit_loop.epoch_loop.scheduler_progress
        for config in trainer.lr_scheduler_configs:
            due = config.reduce_on_plateau and config.interval == "epoch" and (epoch + 1) % config.frequency == 0
            value = trainer.callback_metrics.get(config.monitor) if due else None
            if value is None:
                continue
            progress.increment_ready()
            module.lr_scheduler_step(config.scheduler, value)
            progress.increment_completed()
    except AttributeError as error:
        raise LightningChanged(f"fit_loop.epoch_loop has no {error.name}") from None


@reads("fit_loop.epoch_loop has no {}")
def accumulating(trainer: L.Trainer) -> bool:
    """Whether the training batch just ended took no optimizer step (``fit_loop.epoch_loop._should_accumulate``, as
    Lightning decides): the gradients of the batches since the last step are in the parameters' ``.grad``, which no
    checkpoint holds, so a save or a stop here would resume with that step's first batches left out."""
    return bool(trainer.fit_loop.epoch_loop._should_accumulate())


@reads("fit_loop.epoch_loop.batch_progress has no {}")
def batches_accumulated(trainer: L.Trainer) -> int:
    """The training batches whose gradients are summed in ``.grad`` for an optimizer step not yet taken, as of the
    batch just ended (``batch_progress.current.ready``): 0 where it stepped."""
    if not accumulating(trainer):
        return 0
    return int(trainer.fit_loop.epoch_loop.batch_progress.current.ready) % trainer.accumulate_grad_batches


@reads("fit_loop.epoch_loop.batch_progress has no {}")
def batch_under_way(trainer: L.Trainer) -> int | None:
    """The index in its epoch of the training batch fetched and not yet trained (its step not done: a save from an
    exception raised in ``on_train_batch_start`` or the step, as ``OnExceptionCheckpoint``'s), else ``None``: at a
    batch end Lightning has counted the batch processed (``batch_progress.current.processed == ready``)."""
    current = trainer.fit_loop.epoch_loop.batch_progress.current
    ready, processed = int(current.ready), int(current.processed)
    return ready - 1 if ready > processed else None


@reads("fit_loop.epoch_loop has no {}")
def stopping_mid_epoch(trainer: L.Trainer) -> bool:
    """Whether the fit stops in the middle of an epoch: ``trainer.should_stop`` set (``max_time``'s ``Timer``, an
    early stop, a callback) or ``max_steps`` reached, before the epoch's last batch
    (``fit_loop.epoch_loop.batch_progress.is_last_batch``). Lightning then runs the epoch's end hooks there, and at
    ``should_stop`` validates first (``TrainingEpochLoop._should_check_val_fx``)."""
    reached = trainer.max_steps != -1 and trainer.global_step >= trainer.max_steps
    return (trainer.should_stop or reached) and not trainer.fit_loop.epoch_loop.batch_progress.is_last_batch


@reads("fit_loop has no {}")
def validation_due_without_the_stop(trainer: L.Trainer) -> bool:
    """Whether the validation starting now is one Lightning runs without ``trainer.should_stop`` set
    (``fit_loop.epoch_loop._should_check_val_fx``, asked with it unset; it validates also when a fit stops)."""
    loop = trainer.fit_loop
    stop, trainer.should_stop = trainer.should_stop, False
    try:
        return bool(loop.epoch_loop._should_check_val_fx(loop._data_fetcher))
    finally:
        trainer.should_stop = stop


def train_loaders_cycle(trainer: L.Trainer) -> bool:
    """Whether the fit combines several train loaders in ``max_size_cycle`` mode (``fit_loop._combined_loader._mode``:
    a dict or list a hook returns, or a ``CombinedLoader`` of that mode), where a shorter loader that runs out is
    iterated again, in the same epoch's order, until the longest ends."""
    combined = getattr(trainer.fit_loop, "_combined_loader", LightningChanged)
    mode = getattr(combined, "_mode", LightningChanged) if combined is not None else None
    if combined is LightningChanged or mode is LightningChanged:
        raise LightningChanged("fit_loop._combined_loader._mode is gone")
    return mode == "max_size_cycle" and len(combined.flattened) > 1


@reads("fit_loop.epoch_loop.batch_progress.total has no {}")
def batches_begun(trainer: L.Trainer) -> int:
    """Training batches this fit has begun (``fit_loop.epoch_loop.batch_progress.total.ready``, counted before
    ``on_train_batch_start``): the same on every rank at the same point of the loop."""
    return int(trainer.fit_loop.epoch_loop.batch_progress.total.ready)


def load_the_loader_states_lightning_left(trainer: L.Trainer) -> bool:
    """Loads the train loaders' positions from the checkpoint into them if Lightning has not; returns whether it
    did. A ``configure_optimizers`` that reads ``trainer.estimated_stepping_batches`` (``OneCycleLR``'s
    ``total_steps``, as its docs show) has Lightning build the loaders before it restores the checkpoint, and its
    second ``setup_data`` returns early, so the positions it read are never loaded and the epoch restarts
    (https://github.com/Lightning-AI/pytorch-lightning/issues/20550; its fix, PR #21765, is open). Call it at
    ``on_train_start``, before the first batch is fetched from a loader with a length (its iterator is a
    generator that reads the position then)."""
    fit = trainer.fit_loop
    pending = getattr(fit, "_combined_loader_states_to_load", LightningChanged)
    combined = getattr(fit, "_combined_loader", LightningChanged)
    if pending is LightningChanged or combined is LightningChanged:
        raise LightningChanged("fit_loop._combined_loader_states_to_load / _combined_loader are gone")
    if not pending or combined is None:
        return False
    combined._load_state_dicts(pending)  # what fit_loop._load_combined_loader_states does, unless not restarting
    fit._combined_loader_states_to_load = []
    return True


def batches_fetched_ahead(trainer: L.Trainer) -> int:
    """How many batches Lightning's fetcher has taken from the train loaders and not yet handed to training: one
    during an epoch of a loader without a length (``_PrefetchDataFetcher`` fetches a batch ahead, to know the last
    one), none at its end or of a sized loader. A loader's ``state_dict()`` read at a save counts them as trained on.
    Upstream: the report to file is in the template's docs/upstream.md (related: Lightning #20550, #18135)."""
    from lightning.pytorch.loops.fetchers import _DataLoaderIterDataFetcher, _PrefetchDataFetcher

    fetcher = getattr(trainer.fit_loop, "_data_fetcher", LightningChanged)
    if fetcher is LightningChanged:
        raise LightningChanged("fit_loop._data_fetcher is gone")
    if fetcher is None or isinstance(fetcher, _DataLoaderIterDataFetcher):
        return 0  # not fetching, or training_step(dataloader_iter) takes each batch itself
    if not isinstance(fetcher, _PrefetchDataFetcher) or not isinstance(getattr(fetcher, "batches", None), list):
        raise LightningChanged(f"the fit loop's data fetcher {type(fetcher).__name__} has no list of fetched batches")
    return len(fetcher.batches)


COUNTS = ("ready", "started", "processed", "completed")


@reads("fit_loop.epoch_loop.batch_progress has no {}")
def rescale_batch_progress(trainer: L.Trainer, before: int, after: int) -> None:
    """Rewrites the fit loop's micro-batch counters, restored from a checkpoint whose micro-batches held ``before``
    samples over all ranks, to micro-batches of ``after`` samples: each rank then counts the batches it would have
    run had the run had this shape from the start (the loop decides from them where the epoch and each accumulation
    end). Offsets between the counts (a save at a batch end counts that batch ready, not completed) are kept. Call it
    after the loops are restored and before the epoch loop resets (``on_train_start``)."""
    progress = trainer.fit_loop.epoch_loop.batch_progress
    trackers = {"current": progress.current, "total": progress.total}
    counts = {name: {c: int(getattr(t, c)) for c in COUNTS} for name, t in trackers.items()}
    for name, tracker in trackers.items():
        samples = counts[name]["processed"] * before
        if samples % after:
            raise ValueError(
                f"the checkpoint was taken after {samples} samples ({name} count of the fit loop), not a whole number "
                f"of micro-batches of {after} samples over all ranks: resume it on a shape whose micro-batch divides it"
            )
        for count in COUNTS:
            setattr(tracker, count, samples // after + counts[name][count] - counts[name]["processed"])


@reads("FitLoop.restarted_mid_epoch is gone")
def lightning_skips_the_epoch_start(trainer: L.Trainer) -> bool:
    """At ``on_train_start`` of a resumed fit: whether the fit loop will start the epoch the resume lands in without
    ``on_train_epoch_start`` (``FitLoop.restarted_mid_epoch``: a checkpoint mid-epoch or of the previous epoch's last
    batch end, ``trainer.current_epoch`` the epoch that trains next)."""
    return bool(trainer.fit_loop.restarted_mid_epoch)


def start_the_epoch_lightning_skipped(trainer: L.Trainer, pl_module: L.LightningModule) -> None:
    """Lightning 2.6 starts the epoch a resume lands in without calling ``on_train_epoch_start``: mid-epoch
    (``FitLoop.restarted_mid_epoch``), and after a checkpoint taken at the previous epoch's last batch end. The
    module's epoch-start work (e.g. a loss weight set from the epoch, train metrics reset) would be skipped and the
    resumed run would differ from the uninterrupted one. The caller calls this only when the hook did not run for
    this epoch, so on a Lightning that calls it, this is never reached.

    In the second case (``FitLoop.reset`` counted the checkpoint's epoch processed: ``epoch_progress.current``'s
    ``processed == started``) Lightning also leaves the new epoch uncounted as ready and started, so every later
    checkpoint's ``epoch_progress`` was one epoch short there (7 of 8 after an 8-epoch run) and a resume from it took
    another restart path: extended to 10 epochs, it trained 7 more steps where the uninterrupted run's trained 12
    (measured, a save at the last batch end of an epoch without validation). It is counted here, as
    ``FitLoop.on_advance_start`` counts an epoch it starts."""
    try:
        progress = trainer.fit_loop.epoch_progress
        if progress.current.processed == progress.current.started:
            progress.increment_ready()
            progress.increment_started()
    except AttributeError as error:
        raise LightningChanged(f"fit_loop.epoch_progress has no {error.name}") from None
    pl_module.on_train_epoch_start()


@reads("fit_loop.epoch_loop._batches_that_stepped is gone")
def logging_step(trainer: L.Trainer) -> int:
    """The step Lightning passes to the loggers for the current training batch (not ``global_step``: with two
    optimizer steps a batch, it counts batches; incremented after each batch's logging)."""
    return int(trainer.fit_loop.epoch_loop._batches_that_stepped)


# The module hooks a checkpoint is saved after (Lightning's ModelCheckpoint saves at a training batch end and at a
# validation end; the module's hook comes after every callback's)
HOOKS_BEFORE_SAVES = ("on_train_batch_end", "on_validation_end")


class _CalledAlready:
    """Stands in for a module hook on the instance until Lightning's call of it, which it turns into a no-op."""

    def __init__(self, module: L.LightningModule, name: str) -> None:
        self.module, self.name = module, name

    def __call__(self, *_: object, **__: object) -> None:
        vars(self.module).pop(self.name, None)


def call_the_modules_hook_before_the_saves(pl_module: L.LightningModule, name: str, *args: object) -> None:
    """Calls the module's own ``name`` (one of ``HOOKS_BEFORE_SAVES``) now, from a callback listed before the
    checkpoint callbacks, and makes Lightning's own call of it for this point a no-op: Lightning runs every callback's
    hook (``call._call_callback_hooks``) and then the module's, looked up on the instance
    (``call._call_lightning_module_hook``), so a checkpoint saved at that point missed what the module changes there
    (an EMA updated at a batch end: a batch behind; weights swapped back after validation: the average saved as the
    weights). Lightning orders ``on_train_epoch_end`` so already (``FitLoop.on_advance_end`` calls the monitoring
    callbacks after the module). If the stand-in is still there at the next call, Lightning did not call the hook
    after the callbacks: ``LightningChanged``. Upstream: docs/upstream.md, "Checkpoints saved before the module's
    own on_train_batch_end and on_validation_end"."""
    if isinstance(vars(pl_module).get(name), _CalledAlready):
        del vars(pl_module)[name]
        raise LightningChanged(f"Lightning did not call the module's {name} after the callbacks' {name}")
    getattr(pl_module, name)(*args)
    vars(pl_module)[name] = _CalledAlready(pl_module, name)


def forget_the_early_calls(pl_module: L.LightningModule) -> None:
    """The module's hooks as its class has them again (after an exception between the two calls, or at the end)."""
    for name in HOOKS_BEFORE_SAVES:
        if isinstance(vars(pl_module).get(name), _CalledAlready):
            del vars(pl_module)[name]
