"""The private Lightning APIs of the trainer, CLI, callbacks, launcher and loaders the engine relies on, one function
each; those of the fit loop are in ``compat_loops``, of ``self.log`` and the loggers in ``compat_logging``, torch's in
``compat_torch``. Only these four modules use private APIs (a scan in tests/test_compat.py fails on one elsewhere), and
tests/test_compat.py tests each name. On a layout these functions do not know they raise ``LightningChanged``, one
line naming the attribute and the Lightning (or torch) version: the engine stops rather than continue inexactly.
"""

import ast
import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import lightning as L
import torch


class LightningChanged(RuntimeError):
    """A private API the engine relies on is not what it was: the engine stops rather than run inexactly."""

    def __init__(self, what: str) -> None:
        super().__init__(
            f"{what} (Lightning {L.__version__}, torch {torch.__version__}): this version changed a private API the "
            "engine relies on (engine/lightkeep/compat*.py; tests/test_compat.py names it). Install a lightning/torch "
            "that pyproject.toml allows, or update those modules"
        )


_Read = TypeVar("_Read", bound=Callable[..., Any])


def reads(message: str) -> Callable[[_Read], _Read]:
    """Makes an ``AttributeError`` raised inside the decorated accessor a ``LightningChanged`` of ``message``, where
    ``{}`` stands for the missing attribute's name. Only for an accessor that runs no user code (a hook, a module):
    the user's own ``AttributeError`` would be renamed."""

    def decorate(read: _Read) -> _Read:
        @functools.wraps(read)
        def reading(*args: Any, **kwargs: Any) -> Any:
            try:
                return read(*args, **kwargs)
            except AttributeError as error:
                raise LightningChanged(message.format(error.name)) from None

        return reading  # type: ignore[return-value]

    return decorate


def request_stop_at_batch_end(trainer: L.Trainer, stop: bool = True) -> None:
    """Every rank raises Lightning's ``SIGTERMException`` at the end of the current training batch (``stop=False``
    withdraws the request; validation also raises it after each of its batches but the last)."""
    trainer._signal_connector.received_sigterm = stop


def stop_requested(trainer: L.Trainer) -> bool:
    """Whether every rank raises Lightning's ``SIGTERMException`` at the end of this batch: its SIGTERM handler's flag
    (one process), or ``request_stop_at_batch_end``."""
    return bool(trainer._signal_connector.received_sigterm)


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


def class_args_callback_keys(cli: Any) -> list[str]:
    """The config keys of the callbacks a script added with ``parser.add_lightning_class_args`` (``"checkpoint"``),
    which Lightning appends to the Trainer's callbacks itself."""
    return list(cli._parser(cli.subcommand).callback_keys)


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
    """Sharded by ``lightkeep.sharded.strategy.shard_each_layer``."""


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


def skip_saves_at_this_step(callback: Any, trainer: L.Trainer) -> None:
    """``callback`` (a ``ModelCheckpoint``) saves no more at this global step, as after a save of its own here
    (``_should_skip_saving_checkpoint``)."""
    if not hasattr(callback, "_last_global_step_saved"):
        raise LightningChanged("ModelCheckpoint has no _last_global_step_saved")
    callback._last_global_step_saved = trainer.global_step


def rewrap_ddp(trainer: L.Trainer) -> None:
    """Wraps the module in a new ``DistributedDataParallel`` with the strategy's own arguments and comm hooks, as
    ``DDPStrategy.configure_ddp`` did before the fit; every rank calls it at the same batch (DDP's constructor
    checks the ranks' parameters and broadcasts rank 0's). The old wrapper's gradient hooks do nothing once its last
    backward has ended. DDP takes the parameters that require a gradient when it is built, and never looks again."""
    # The fix to propose upstream, on Lightning #20340 ("DDP doesn't work with BackboneFinetuning", open): the
    # strategy rebuilds its wrapper when BaseFinetuning (or any hook) changes which parameters train.
    # https://github.com/Lightning-AI/pytorch-lightning/issues/20340
    # Every rank must call it at the same batch, or those that do wait in DDP's constructor (the hang watchdog ends
    # that): the change comes from code every rank runs alike (a callback's epoch start, a resume).
    strategy = trainer.strategy
    for name in ("_setup_model", "_register_ddp_hooks"):
        if not callable(getattr(type(strategy), name, None)):
            raise LightningChanged(f"{type(strategy).__name__}.{name} is gone")
    if strategy.root_device.type == "cuda":  # DDP broadcasts rank 0's parameters on a side stream of its own
        torch.cuda.current_stream().synchronize()  # after the last optimizer step has written them
    state = getattr(strategy, "_ddp_comm_state", None)
    for memory in ("error_dict", "p_memory_dict", "q_memory_dict"):  # PowerSGD's, kept per bucket of the old DDP
        if isinstance(getattr(state, memory, None), dict):
            getattr(state, memory).clear()
    strategy.model = strategy._setup_model(strategy.lightning_module)
    strategy._register_ddp_hooks()
    if hasattr(strategy, "_pl_static_graph_delay_done"):  # manual optimization's first-iteration flush, per DDP
        strategy._pl_static_graph_delay_done = False


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


def batch_size_finders_attribute(finder: Any) -> str:
    """The attribute a ``BatchSizeFinder`` scales (its ``batch_arg_name``, kept as ``_batch_arg_name``)."""
    name = getattr(finder, "_batch_arg_name", None)
    if not isinstance(name, str):
        raise LightningChanged("BatchSizeFinder._batch_arg_name is gone")
    return name


def spike_detection_loads_its_state(callback: Any) -> None:
    """Lightning 2.6's ``SpikeDetection.load_state_dict`` loads its window into ``self.running``, an attribute it does
    not have (it is ``running_mean``): every resume of a run with one ended in a traceback. Where the class's own load
    fails so, this instance's load gives it that name for the call; a Lightning whose load works is left alone.
    Upstream: https://github.com/Lightning-AI/pytorch-lightning/pull/21752"""
    if not _spike_detections_load_fails():
        return
    own_load = callback.load_state_dict

    def load_state_dict(state_dict: dict[str, Any]) -> None:
        callback.running = callback.running_mean  # the name Lightning's load reads
        try:
            own_load(state_dict)
        finally:
            del callback.running

    callback.load_state_dict = load_state_dict


@functools.cache
def _spike_detections_load_fails() -> bool:
    from lightning.pytorch.callbacks import SpikeDetection

    try:
        SpikeDetection().load_state_dict(SpikeDetection().state_dict())
    except AttributeError as error:
        if "running" not in str(error):
            raise
        return True
    return False


def datamodule_state_in(checkpoint: dict, datamodule: Any) -> Any:
    """The data module's ``state_dict`` a checkpoint holds (under its class's ``__qualname__``, as
    ``_CheckpointConnector`` saves and restores it), or ``None``."""
    return checkpoint.get(type(datamodule).__qualname__) if datamodule is not None else None


def launched_children(trainer: L.Trainer) -> list[Any]:
    """The other ranks' processes, when Lightning's ``ddp`` launcher started them from this one (else ``[]``)."""
    return list(getattr(trainer.strategy.launcher, "procs", None) or [])


def child_observer_waits(trainer: L.Trainer, wait: Callable[[list[int | None]], object]) -> Callable[[], None]:
    """Lightning's ``ddp`` launcher starts a thread, ``_ChildProcessObserver``, whose ``_run`` polls the ranks it
    started every 5 s and, when one has exited with a code other than 0, logs so and SIGKILLs every rank and this
    process too, whatever this process is doing: printing the engine's report of that failure, or finishing a stop
    every rank makes on purpose (exit code 143) after a rank that finished first. From now on, when a rank has
    exited so, it first calls ``wait(exit codes of the ranks it started)``. Returns what undoes it (the instance's own
    method again; the class is untouched)."""
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
            codes = [proc.poll() for proc in procs]
            if any(codes):  # a non-zero exit code
                wait(codes)
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
    ``self.hparams`` additions are not arguments). A mixin of ``lightkeep.cli.CLI``, before ``LightningCLI``.
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
        from lightkeep.config import its_arguments

        own = its_arguments(model.class_path, hparams)
        if own:
            update = {subcommand: {"model": {"class_path": model.class_path, "init_args": own}}}
            self.config = self.parser.parse_object(update, config)  # type: ignore[attr-defined]
        return None
