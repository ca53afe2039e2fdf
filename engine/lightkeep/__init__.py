"""lightkeep, the engine: what makes a Lightning run never lose its work. Users do not edit it; a fix here reaches
copies as a unit (a new version).

What it guarantees, and what user code does to get each guarantee:

- **Run folder** (``runs``, ``run_folder``): every invocation writes into ``<run.root>/<run.name>/version_N/``
  (``run.root``: Lightning's ``trainer.default_root_dir`` where a config gives that instead)
  (config, checkpoints, logs), never into an earlier run's; with any Lightning logger or none. Nothing to do.
- **Exact resume** (``resume``, ``user_loaders``, ``loaders``): ``fit --ckpt_path last`` continues the newest run
  bitwise equal to an uninterrupted one (weights, optimizer, LR, every rank's RNG states, the data position
  mid-epoch, the epoch's torchmetrics states so far, kept beside the weights), also under DDP (where a metric with
  list states is not kept, and the start line says so). User code: return plain ``DataLoader``s from the
  ``*_dataloader`` hooks; the engine puts in its samplers, as Lightning puts in its ``DistributedSampler``. Your own
  sampler or batch sampler is drawn again and continued (``own_orders``); an ``IterableDataset`` resumes at its
  ``state_dict`` or is fast-forwarded past the samples trained on (``stream_resume``, ``stream_positions``); a loader
  that keeps its own position resumes at it (``own_positions``); what cannot follow is named in the start line. Draw
  randomness from torch/numpy/random's global generators, or seed it per sample. A resume checks it
  (``next_batch``): each checkpoint records the batch its run trains on next, and the resumed run's start line says
  ``resume verified`` at its first batch, or names the first difference, or why it could not compare. What
  callbacks and ``ReduceLROnPlateau`` judge by (``trainer.callback_metrics``) comes back too, and the validation
  Lightning runs where a fit stops mid-epoch (``max_time``) is judged by none of them (``monitored_values``).
- **Elastic resume** (``elastic``, ``loaders``, ``resume``): ``fit --ckpt_path last --trainer.devices M`` continues
  a run of N ranks with the same samples in the same global batches, the same optimizer steps, LR and
  ``global_step``, within float-reduction noise: the epoch's order does not depend on the number of ranks (padded
  to a multiple of the global batch), and the engine keeps the global batch by ``accumulate_grad_batches``, or
  stops in one line naming the settings that would keep it; under the sharded strategy too. What cannot follow (each
  rank's random streams, BatchNorm statistics over another micro-batch, a ``limit_train_batches`` that now cuts the
  epoch at other samples, with the limit that keeps them) is named in the start line. User code: as for exact resume.
- **Same run in every logger** (``run_loggers``, ``loggers``): TensorBoard, CSV, MLflow, W&B continue the same run with
  each step once. Nothing to do; an unknown logger class is named at start.
- **Checkpoints that survive a kill** (``checkpoint_policy``, ``checkpoint_io``, ``one_file_per_point``,
  ``checkpoint_files``): ``last.ckpt`` on a timer, at the end and on a signal, the periodic files, written by
  atomic rename in the background, loaded with ``weights_only``; the files of one validation are one file under
  their names. Nothing to do: they come with any ``trainer.callbacks`` / ``trainer.plugins`` list a config gives
  (``--checkpoints.*`` are the settings; the start line names what is off), except that a ``CheckpointIO`` of your
  own in ``trainer.plugins`` writes the files in place of the engine's atomic writer (named under ``off:``).
- **Speed** (``speed/``, ``host_snapshot``, ``loggers``, ``compat_logging``): a CPU step reuses the
  memory the last one freed; saves cost the loop only a copy to host memory; ``self.log`` and the hooks' profiling
  cost next to nothing per step. Nothing to do. Each switch that changes more than the loop is named in the start
  line (``| speed: ...``) and set for the run only (``run_scope``): once ``cli_main`` returns, signal handlers,
  warning and logging filters, gc, patched classes and malloc are as they were. The ``speed:`` settings
  (``speed.switches.Speed``): ``keep_freed_host_memory`` (CPU runs only, on by default), ``compile``
  (``torch.compile`` of the module's networks in place, checkpoint keys unchanged) and ``matmul_precision`` (TF32, put
  back after), the last two on in ``configs/gpu.yaml``.
- **An LR schedule fitted to the run** (``schedule``): ``LinearWarmupCosineAnnealingLR(optimizer, warmup_epochs,
  max_epochs)`` returned with ``"interval": "step"`` is converted at the start of training to the run's real steps
  per epoch (``max_epochs=None``: the whole run, a short debug run included). Nothing to do.
- **Sharded training** (``sharded/``): ``configs/fsdp.yaml`` writes checkpoints as DCP folders, one shard per rank,
  atomically and loaded without pickle; exact resume as above, resharding to any number of ranks, export to one
  file. A module without ``configure_model`` is sharded layer by layer (``fully_shard`` on each layer with
  parameters, then each network); one with its own ``configure_model`` shards there. User code: let every rank run
  every forward (no forward on rank 0 alone).
- **Preemption, Ctrl-C, NaN** (``signals``, ``guards``): SIGTERM/SIGUSR1/Ctrl-C save ``last.ckpt`` and exit non-zero
  on every rank; NaN/inf gradients stop before the weights change.
- **Exact validation under DDP** (``user_loaders``, ``loaders``, ``compat_logging``): each validation/test/predict
  sample on exactly one rank; torchmetrics ``Metric`` objects (``self.log(name, metric)``) and tensors logged with
  ``sync_dist=True`` (epoch means weighted by each rank's true sample count) give epoch values equal to the
  single-process ones.
- **What a run is judged by, said once** (``runs``, ``judge``): ``run.monitor``/``run.mode`` make the engine's
  best-k ``ModelCheckpoint`` (and ``EarlyStopping`` with ``run.patience``), a sweep's objective and the run summary's
  score; a monitored key the module does not log stops the fit at the first validation's end, before training, in
  one line naming the keys it does log. User code: ``self.log`` the monitored metric, or set ``--run.monitor``.
- **Checkpoints by name** (``run_checkpoints``, ``judge``): ``--ckpt_path best`` / a run folder pick
  the run's best by its ``ModelCheckpoint``'s own record in each file, else its last, saying which;
  ``--run.test_after_fit`` tests a finished fit's best into the same run.
- **Bad input in one line** (``errors``, ``cli``): arguments, configs, checkpoints are checked before anything is
  written; an error every rank raises is printed once, by rank 0, and a run that failed before writing anything
  but its config leaves no folder. Raise ``ValueError`` with the reason from your constructors.
- **Your model, your data** (``config``, ``cli``, ``export/``): ``--model my.Model``/``--data my.Data`` start from
  that class's own defaults; a project's own script keeps its ``LightningCLI`` subclass (links, fixed classes) and
  its config with ``from lightkeep import LightningCLI``; ``scripts/export.py`` exports any module with a
  ``forward`` (``example_input_array``, else a batch of its data).
- **Sweeps that survive a crash** (``sweep/``): an Optuna study whose trials are ordinary ``fit`` runs with every
  guarantee above; killed and restarted, it continues each trial from its ``last.ckpt``. User code: log the metric the
  sweep monitors (``run.monitor`` unless it names another).
- **A console worth reading** (``console``, ``rank_failures``, ``hang_watchdog``): expected warnings silenced one by
  one, each run said once by rank 0; a dead DDP rank, or one that makes no progress for ``run.hang_timeout`` (300 s;
  a stopped process, a stuck collective or data loader), ends the run in one line naming it, its step, the intact
  checkpoint and the resume command. Nothing to do; ``PROJECT_VERBOSE=1`` shows every line.
- **Private Lightning APIs** live in ``compat`` (the fit loop's in ``compat_loops``, torch's in ``compat_torch``,
  ``self.log``'s in ``compat_logging``) only, each tested by name (a scan of the engine's source fails on one
  elsewhere); on a layout it does not know, the engine stops in one line naming the attribute and the version.

Optional parts a reader can skip live in subpackages: ``sweep/`` (Optuna studies), ``export/`` (deployment formats),
``sharded/`` (FSDP2 and its folders), ``speed/`` (switches that change how fast, not what is computed).
"""

__version__ = "1.13.0"  # engine/pyproject.toml's; CHANGELOG.md says what each version changes for users

# The public names (docs/engine.md), imported when first used: `import lightkeep` alone builds no CLI.
_PUBLIC = {
    "cli_main": "lightkeep.main",
    "LightningCLI": "lightkeep.cli:CLI",  # a project's own script imports it in place of Lightning's
    "LinearWarmupCosineAnnealingLR": "lightkeep.schedule",
    "ShardedStrategy": "lightkeep.sharded.strategy",
    "ThrottledTensorBoardLogger": "lightkeep.loggers",
    "load_net": "lightkeep.export.weights",
}
__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'lightkeep' has no attribute {name!r}")
    import importlib

    module, _, attribute = _PUBLIC[name].partition(":")  # "module" or "module:its name there"
    return getattr(importlib.import_module(module), attribute or name)
