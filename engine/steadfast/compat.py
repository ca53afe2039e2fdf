"""The private Lightning APIs of the trainer, CLI, callbacks, loops and loaders the engine relies on; those of
``self.log`` and the loggers are in ``compat_logging``, torch's in ``compat_torch``. Only these three modules use
private APIs (a scan in tests/test_compat.py fails on one elsewhere), and tests/test_compat.py fails, naming the
attribute, on a Lightning version where one changed.

- ``Trainer._signal_connector.received_sigterm``: set at a batch end, it makes every rank stop there through
  Lightning's own SIGTERM path (``steadfast.signals``: Ctrl-C agreed by all ranks).
- ``_TrainingEpochLoop._broadcast_sigterm_tensor`` and ``_SignalConnector._sigterm_notifier_fn``, replaced on the
  fit's own instances under DDP: the ranks agree on a SIGTERM without a collective per batch
  (``sigterm_without_a_broadcast_per_batch``, ``steadfast.signals``).
- ``LightningCLI._get``: reads the trainer section of the parsed config (``steadfast.cli``).
- ``LightningCLI._parse_ckpt_path``: overridden (``ParsesPlainLightningCheckpoints``) so that a checkpoint plain
  Lightning wrote builds the configured class from its hyperparameters (``steadfast.cli``).
- ``ModelParallelStrategy._data_parallel_size`` / ``_tensor_parallel_size``: the mesh sizes its
  ``setup_environment`` reads; ``auto`` data parallelism is set to every rank (``steadfast.sharded``).
- ``Callback._generate_state_key``'s format, ``ClassName{'monitor': ..., 'mode': ...}``: the key a checkpoint files
  each callback's state under, read back for a ``ModelCheckpoint``'s ``mode`` (``steadfast.judge``).
- ``ModelCheckpoint._should_skip_saving_checkpoint`` / ``_save_last_checkpoint`` / ``_monitor_candidates``: the
  end-of-fit refresh of ``last.ckpt`` (``steadfast.last_checkpoint``), with Lightning's own bookkeeping of
  ``last_model_path`` and its skips (``fast_dev_run``, not fitting, already saved at this step).
- ``lightning.pytorch.utilities.data._update_dataloader``: re-creates a loader (a ``DataLoader`` subclass too) from
  the arguments its ``*_dataloader`` hook gave it, with another sampler, as Lightning puts in its
  ``DistributedSampler`` (``steadfast.user_loaders``).
- ``Trainer._accelerator_connector.use_distributed_sampler``: the Trainer's ``use_distributed_sampler`` flag after
  Lightning resolved it (``steadfast.user_loaders``).
- The fit loop's saved counters (``loops.fit_loop``: ``epoch_loop.batch_progress``, ``epoch_progress``), rewritten
  when a fit stopped mid-epoch (``reopen_an_epoch_stopped_mid_way``, ``steadfast.resume``), and on loading a
  checkpoint of an epoch's end into a fit with ``max_steps`` (``start_the_epoch_after_an_ended_one``, likewise);
  then ``fit_loop.epoch_loop.restarting`` and ``reset_restart_stage`` (``start_the_epoch_loop_afresh``).
- ``fit_loop.epoch_loop.batch_progress.total.ready``: the training batches begun, where a hung rank stopped
  (``batches_begun``, ``steadfast.hang_watchdog``).
- ``fit_loop._data_fetcher.batches`` of a ``_PrefetchDataFetcher``: the batches Lightning fetched from the train
  loaders ahead of training (one, of a loader without a length), not in a checkpoint's loader positions
  (``batches_fetched_ahead``, ``steadfast.own_positions``).
- ``fit_loop._combined_loader_states_to_load`` and ``_combined_loader`` (``CombinedLoader._load_state_dicts``, what
  ``fit_loop._load_combined_loader_states`` calls): the train loaders' saved
  positions, which Lightning leaves unloaded when ``configure_optimizers`` read ``estimated_stepping_batches``
  (Lightning #20550), loaded at ``on_train_start`` (``load_the_loader_states_lightning_left``, ``steadfast.resume``).
- The fit loop's live micro-batch counters (``fit_loop.epoch_loop.batch_progress``: ``current`` and ``total``, each
  ``ready``/``started``/``processed``/``completed``), rescaled on a resume on another number of ranks
  (``rescale_batch_progress``, ``steadfast.resume``).
- ``fit_loop._combined_loader._mode``: several train loaders cycled (``max_size_cycle``), whose shorter one that ran
  out at a save trains next on its epoch's first batch again (``train_loaders_cycle``, ``steadfast.next_batch``).
- ``fit_loop.restarting``, still set at the end of the epoch a mid-epoch resume lands in, where ``FitLoop`` skips
  the ``ReduceLROnPlateau`` step (``lightning_skips_the_plateau_step``, ``steadfast.monitored_values``);
  ``epoch_progress``, ``epoch_loop._num_ready_batches_reached`` and ``epoch_loop.update_lr_schedulers``: a
  checkpoint saved at an epoch's end, before that step, and the step taken later (``plateau_step_pending``,
  ``step_the_plateau_schedulers``).
- ``on_train_epoch_start`` skipped by Lightning 2.6 on a resume from an epoch's last batch end
  (``start_the_epoch_lightning_skipped``, ``steadfast.resume``).
- ``ModelCheckpoint.file_exists`` replaced on an instance, so that a save still being written counts as a file
  (``count_pending_saves_as_files``, ``steadfast.one_file_per_point``).
- The keys LightningCLI adds to ``hparams`` (``CLI_HPARAM_KEYS``, ``steadfast.judge``).
- The ``ddp`` launcher's ``procs`` (``launched_children``, ``steadfast.rank_failures``).
- The ``ddp`` launcher's ``_ChildProcessObserver`` thread and its ``_run``, made to wait for the engine's report of a
  failed rank before it kills every rank (``child_observer_waits``, ``steadfast.rank_failures``).
- ``fit_loop.epoch_loop._batches_that_stepped``: the step Lightning gives the loggers (one per batch that stepped,
  whatever the optimizer steps in it), read to know which logged steps a checkpoint covers
  (``logging_step``, ``steadfast.run_folder``).

On a layout these functions do not know they raise ``LightningChanged``, one line naming the attribute and the
Lightning (or torch) version: the engine stops rather than continue inexactly.
"""

import ast
import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import lightning as L
import torch


class LightningChanged(RuntimeError):
    """A private API the engine relies on is not what it was: the engine stops rather than run inexactly."""

    def __init__(self, what: str) -> None:
        super().__init__(
            f"{what} (Lightning {L.__version__}, torch {torch.__version__}): this version changed a private API the "
            "engine relies on (engine/steadfast/compat*.py; tests/test_compat.py names it). Install a lightning/torch "
            "that pyproject.toml allows, or update those modules"
        )


def request_stop_at_batch_end(trainer: L.Trainer, stop: bool = True) -> None:
    """Every rank raises Lightning's ``SIGTERMException`` at the end of the current training batch (``stop=False``
    withdraws the request; validation also raises it after each of its batches but the last)."""
    trainer._signal_connector.received_sigterm = stop


def sigterm_without_a_broadcast_per_batch(trainer: L.Trainer, on_sigterm: Callable[[], None]) -> Callable[[], None]:
    """Under DDP, Lightning (since 2.5.2) starts every training batch with a broadcast of rank 0's SIGTERM flag and
    a host read of it (``_TrainingEpochLoop._broadcast_sigterm_tensor``): a blocking collective per step. Its SIGTERM
    handler (``_SignalConnector._sigterm_notifier_fn``) joins that broadcast from inside the handler, so a SIGTERM
    to a rank other than 0 sets its own flag and leaves the ranks' broadcasts out of step. For this trainer's fit:
    the per-batch broadcast does nothing, and the handler, after passing the signal on to the ranks this process
    launched (once, as Lightning does), calls ``on_sigterm()`` instead of broadcasting and setting
    ``received_sigterm``: the caller agrees with the other ranks and stops them all at one batch end
    (``request_stop_at_batch_end``). Call it before the trainer registers its signal handlers (a callback's
    ``setup``). Returns what undoes it (the instances' own methods again; the classes are untouched)."""
    # The fix to propose upstream, on Lightning issue #21487 (this per-step broadcast and host read; its open PR
    # #21640 broadcasts every N steps instead, still a blocking collective and read each time): the loop agrees
    # without waiting, an all-reduce (any rank's flag, not rank 0's) started with async_op=True at one batch and read
    # some batches later, every rank deciding at the same batch; the handler only sets the local flag, never a
    # collective inside a signal handler. https://github.com/Lightning-AI/pytorch-lightning/issues/21487
    loop, connector = trainer.fit_loop.epoch_loop, trainer._signal_connector
    for owner, name in ((loop, "_broadcast_sigterm_tensor"), (connector, "_sigterm_notifier_fn")):
        if not callable(getattr(type(owner), name, None)):
            raise LightningChanged(f"{type(owner).__name__}.{name} is gone")
    forwarded = False

    def notified(signum: int, frame: Any) -> None:
        nonlocal forwarded
        launcher = trainer.strategy.launcher
        if not forwarded and launcher is not None:
            forwarded = True
            launcher.kill(signum)
        on_sigterm()

    loop._broadcast_sigterm_tensor = lambda: None
    connector._sigterm_notifier_fn = notified

    def undo() -> None:
        vars(loop).pop("_broadcast_sigterm_tensor", None)
        vars(connector).pop("_sigterm_notifier_fn", None)

    return undo


def cli_section(cli: Any, config: Any, key: str) -> Any:
    """``config[subcommand][key]`` of a LightningCLI's parsed or instantiated config (``{}`` when absent)."""
    return cli._get(config, key, default={})


def shard_over_all_ranks(strategy: Any) -> None:
    """``data_parallel_size="auto"`` of a ``ModelParallelStrategy``: every rank divided by the tensor-parallel size
    (Lightning's ``auto`` is one group per node). Call before ``setup_environment``."""
    if strategy._data_parallel_size == "auto":
        strategy._data_parallel_size = (
            strategy.num_nodes * strategy.num_processes // int(strategy._tensor_parallel_size)
        )


@contextlib.contextmanager
def configure_model_counted_as_overridden(module: L.LightningModule) -> Iterator[None]:
    """``ModelParallelStrategy.setup`` refuses a module that does not override ``configure_model`` (it checks with
    ``is_overridden`` on the instance); ``ShardedStrategy`` shards such a module itself. For the duration, the
    instance has a ``configure_model`` of its own that does nothing; the class is untouched."""
    module.configure_model = _already_sharded  # type: ignore[method-assign]
    try:
        yield
    finally:
        vars(module).pop("configure_model", None)


def _already_sharded() -> None:
    """Sharded by ``steadfast.sharded.strategy.shard_each_layer``."""


def state_key_arguments(state_key: str) -> dict[str, Any]:
    """The arguments a callback's ``state_key`` holds (``ModelCheckpoint``: ``monitor``, ``mode``, ...); ``{}`` for a
    key of another shape."""
    _, brace, arguments = state_key.partition("{")
    try:
        parsed = ast.literal_eval(brace + arguments)
    except (ValueError, SyntaxError):
        return {}
    return parsed if isinstance(parsed, dict) else {}


def save_last_unless_saved_at_this_step(callback: Any, trainer: L.Trainer) -> None:
    """``callback`` (a ``ModelCheckpoint`` with ``save_last``) writes ``last.ckpt`` now, unless it already did at this
    global step or Lightning would not save here at all."""
    if callback.save_last and not callback._should_skip_saving_checkpoint(trainer):
        callback._save_last_checkpoint(trainer, callback._monitor_candidates(trainer))


def loader_with_sampler(loader: Any, sampler: Any) -> Any:
    """A new loader of ``loader``'s class, built from the arguments it was built with but ``sampler`` (``shuffle``
    off), as Lightning injects its ``DistributedSampler``; raises Lightning's ``MisconfigurationException`` (or a
    ``TypeError``) when the class does not expose those arguments. Call it inside a ``*_dataloader`` hook, where
    Lightning records them."""
    from lightning.pytorch.utilities.data import _update_dataloader

    return _update_dataloader(loader, sampler)


def uses_distributed_sampler(trainer: L.Trainer) -> bool:
    """The Trainer's ``use_distributed_sampler``: whether Lightning puts a ``DistributedSampler`` into loaders."""
    return bool(trainer._accelerator_connector.use_distributed_sampler)


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


def start_the_epoch_loop_afresh(trainer: L.Trainer) -> None:
    """The second half of ``start_the_epoch_after_an_ended_one``: the epoch loop (and its validation loop) not
    restarting, as without ``max_steps``. Call it in ``on_train_start``, after the fit loop's reset and before the
    epoch loop's."""
    try:
        loop = trainer.fit_loop.epoch_loop
        loop.restarting = False  # Lightning's setter: its child loops too
        loop.reset_restart_stage()
    except AttributeError as error:
        raise LightningChanged(f"fit_loop.epoch_loop has no {error.name}") from None


def lightning_skips_the_plateau_step(trainer: L.Trainer) -> bool:
    """Whether ``FitLoop.on_advance_end`` will skip the ``ReduceLROnPlateau`` step of the epoch ending now: it steps
    only when the fit loop is not restarting, which it still is at the end of the epoch a mid-epoch resume lands in
    (and only when the epoch ran all its batches, ``epoch_loop._num_ready_batches_reached()``). Read in
    ``on_train_epoch_end``; the engine takes the step itself at the next epoch's start (``steadfast.monitored_values``).
    (Lightning #18595; the fix proposed in docs/upstream.md.)"""
    try:
        loop = trainer.fit_loop
        return bool(loop.restarting) and loop.epoch_loop._num_ready_batches_reached()
    except AttributeError as error:
        raise LightningChanged(f"fit_loop has no {error.name}") from None


def plateau_step_pending(trainer: L.Trainer) -> bool:
    """Whether this point lies between an epoch's end hooks and Lightning's ``ReduceLROnPlateau`` step after them
    (``fit_loop.epoch_progress.current``: processed, not completed; ``epoch_loop._num_ready_batches_reached()``, the
    condition of that step): a checkpoint saved here (a ``ModelCheckpoint`` at ``on_train_epoch_end``, the default
    with validation every epoch) holds the plateau schedulers before their step of this epoch."""
    try:
        loop = trainer.fit_loop
        progress = loop.epoch_progress.current
        return progress.processed > progress.completed and loop.epoch_loop._num_ready_batches_reached()
    except AttributeError as error:
        raise LightningChanged(f"fit_loop has no {error.name}") from None


def step_the_plateau_schedulers(trainer: L.Trainer) -> None:
    """The ``ReduceLROnPlateau`` step of an epoch's end, as ``FitLoop.on_advance_end`` takes it
    (``epoch_loop.update_lr_schedulers("epoch", update_plateau_schedulers=True)``, by ``trainer.callback_metrics``)."""
    try:
        trainer.fit_loop.epoch_loop.update_lr_schedulers("epoch", update_plateau_schedulers=True)
    except AttributeError as error:
        raise LightningChanged(f"fit_loop.epoch_loop has no {error.name}") from None


def train_loaders_cycle(trainer: L.Trainer) -> bool:
    """Whether the fit combines several train loaders in ``max_size_cycle`` mode (``fit_loop._combined_loader._mode``:
    a dict or list a hook returns, or a ``CombinedLoader`` of that mode), where a shorter loader that runs out is
    iterated again, in the same epoch's order, until the longest ends."""
    combined = getattr(trainer.fit_loop, "_combined_loader", LightningChanged)
    mode = getattr(combined, "_mode", LightningChanged) if combined is not None else None
    if combined is LightningChanged or mode is LightningChanged:
        raise LightningChanged("fit_loop._combined_loader._mode is gone")
    return mode == "max_size_cycle" and len(combined.flattened) > 1


def batches_begun(trainer: L.Trainer) -> int:
    """Training batches this fit has begun (``fit_loop.epoch_loop.batch_progress.total.ready``, counted before
    ``on_train_batch_start``): the same on every rank at the same point of the loop."""
    try:
        return int(trainer.fit_loop.epoch_loop.batch_progress.total.ready)
    except AttributeError as error:
        raise LightningChanged(f"fit_loop.epoch_loop.batch_progress.total has no {error.name}") from None


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


def rescale_batch_progress(trainer: L.Trainer, before: int, after: int) -> None:
    """Rewrites the fit loop's micro-batch counters, restored from a checkpoint whose micro-batches held ``before``
    samples over all ranks, to micro-batches of ``after`` samples: each rank then counts the batches it would have
    run had the run had this shape from the start (the loop decides from them where the epoch and each accumulation
    end). Offsets between the counts (a save at a batch end counts that batch ready, not completed) are kept. Call it
    after the loops are restored and before the epoch loop resets (``on_train_start``)."""
    try:
        progress = trainer.fit_loop.epoch_loop.batch_progress
        trackers = {"current": progress.current, "total": progress.total}
        counts = {name: {c: int(getattr(t, c)) for c in COUNTS} for name, t in trackers.items()}
    except AttributeError as error:
        raise LightningChanged(f"fit_loop.epoch_loop.batch_progress has no {error.name}") from None
    for name, tracker in trackers.items():
        samples = counts[name]["processed"] * before
        if samples % after:
            raise ValueError(
                f"the checkpoint was taken after {samples} samples ({name} count of the fit loop), not a whole number "
                f"of micro-batches of {after} samples over all ranks: resume it on a shape whose micro-batch divides it"
            )
        for count in COUNTS:
            setattr(tracker, count, samples // after + counts[name][count] - counts[name]["processed"])


def start_the_epoch_lightning_skipped(pl_module: L.LightningModule) -> None:
    """Lightning 2.6 starts the epoch after a resume from a checkpoint taken at the previous epoch's last batch end
    without calling ``on_train_epoch_start``: the module's epoch-start work (e.g. resetting train metrics) would be
    skipped and the resumed run would differ from the uninterrupted one. The caller calls this only when the hook
    did not run for this epoch, so on a Lightning that calls it, this is never reached."""
    pl_module.on_train_epoch_start()


def count_pending_saves_as_files(callback: Any, pending: Callable[[Any, L.Trainer], bool]) -> None:
    """``callback.file_exists(path, trainer)`` (a ``ModelCheckpoint``'s, asked before it names a file ``-v1``) also
    answers yes for ``pending(path, trainer)``; ``restore_file_exists`` takes it back. Once per instance."""
    if not callable(getattr(type(callback), "file_exists", None)):
        raise LightningChanged("ModelCheckpoint.file_exists is gone")
    vars(callback).pop("file_exists", None)  # a failed fit skips teardown: never wrapped twice
    on_disk = callback.file_exists

    def file_exists(filepath: Any, trainer: L.Trainer) -> bool:
        return pending(filepath, trainer) or on_disk(filepath, trainer)

    callback.file_exists = file_exists


def restore_file_exists(callback: Any) -> None:
    vars(callback).pop("file_exists", None)


def logging_step(trainer: L.Trainer) -> int:
    """The step Lightning passes to the loggers for the current training batch (not ``global_step``: with two
    optimizer steps a batch, it counts batches; incremented after each batch's logging)."""
    try:
        return int(trainer.fit_loop.epoch_loop._batches_that_stepped)
    except AttributeError:
        raise LightningChanged("fit_loop.epoch_loop._batches_that_stepped is gone") from None


def launched_children(trainer: L.Trainer) -> list[Any]:
    """The other ranks' processes, when Lightning's ``ddp`` launcher started them from this one (else ``[]``)."""
    return list(getattr(trainer.strategy.launcher, "procs", None) or [])


def child_observer_waits(trainer: L.Trainer, wait: Callable[[], object]) -> Callable[[], None]:
    """Lightning's ``ddp`` launcher starts a thread, ``_ChildProcessObserver``, whose ``_run`` polls the ranks it
    started every 5 s and, when one has failed, logs so and SIGKILLs every rank and this process too, whatever this
    process is doing: printing the engine's report of that failure, say. From now on, when a rank has failed, it first
    calls ``wait()``. Returns what undoes it (the instance's own method again; the class is untouched)."""
    # Upstream, the observer would let the launcher process say why and end itself (a SIGTERM or a hook, then SIGKILL
    # after a grace period) rather than SIGKILL it mid-sentence: Lightning issue #16285 ("Use SIGTERM instead of
    # SIGKILL on DDP Errors", open) asks it of the kill that preceded the observer; its PR #16307 (SIGINT, then
    # SIGKILL later) was closed unmerged, and the observer (PR #18218) kept the SIGKILL.
    # https://github.com/Lightning-AI/pytorch-lightning/issues/16285
    procs = getattr(trainer.strategy.launcher, "procs", None)
    if not procs:
        return lambda: None
    try:
        from lightning.fabric.strategies.launchers.subprocess_script import _ChildProcessObserver
    except ImportError:
        raise LightningChanged("subprocess_script._ChildProcessObserver of lightning.fabric is gone") from None
    if not callable(getattr(_ChildProcessObserver, "_run", None)):
        raise LightningChanged("_ChildProcessObserver._run is gone")
    # the observer of these processes (Lightning passes it the launcher's own list); it ends once one has failed
    observers = [
        thread
        for thread in threading.enumerate()
        if isinstance(thread, _ChildProcessObserver) and getattr(thread, "_child_processes", None) is procs
    ]
    for observer in observers:
        vars(observer).pop("_run", None)
        run = observer._run

        def run_once_reported(run: Callable[[], bool] = run) -> bool:
            if any(proc.poll() for proc in procs):  # a non-zero exit code: a rank failed
                wait()
            return run()

        observer._run = run_once_reported

    def undo() -> None:
        for observer in observers:
            vars(observer).pop("_run", None)

    return undo


# Keys LightningCLI adds to a module's and a data module's hparams: bookkeeping, not hyperparameters.
CLI_HPARAM_KEYS = ("_class_path", "_instantiator")


class ParsesPlainLightningCheckpoints:
    """``LightningCLI._parse_ckpt_path``, which builds the model from a checkpoint's ``hyper_parameters``, for a
    checkpoint that plain Lightning wrote too (``Trainer.fit`` without the CLI: the module's own
    ``save_hyperparameters()``, no ``_class_path``). Lightning's reads such hyperparameters as arguments of the
    ``model`` key itself and fails ("Parsing of ckpt_path hyperparameters failed!"); here they become the
    configured class's ``init_args``, those of its signature only (``save_hyperparameters(ignore=...)`` and
    ``self.hparams`` additions are not arguments). A mixin of ``steadfast.cli.CLI``, before ``LightningCLI``.
    """

    def _parse_ckpt_path(self) -> None:
        from pathlib import Path

        from jsonargparse import Namespace

        config = self.config  # type: ignore[attr-defined]
        subcommand = config.get("subcommand")
        ckpt_path = config[subcommand].get("ckpt_path") if subcommand else None
        model = config[subcommand].get("model") if subcommand else None
        if not (ckpt_path and Path(ckpt_path).is_file() and isinstance(model, Namespace) and model.get("class_path")):
            return super()._parse_ckpt_path()  # type: ignore[misc]
        hparams = torch.load(ckpt_path, weights_only=True, map_location="cpu", mmap=True).get("hyper_parameters")
        if not isinstance(hparams, dict) or not hparams or "_class_path" in hparams or "_instantiator" in hparams:
            return super()._parse_ckpt_path()  # type: ignore[misc]  # a LightningCLI checkpoint (or none)
        from steadfast.config import its_arguments

        own = its_arguments(model.class_path, hparams)
        if own:
            update = {subcommand: {"model": {"class_path": model.class_path, "init_args": own}}}
            self.config = self.parser.parse_object(update, config)  # type: ignore[attr-defined]
        return None
