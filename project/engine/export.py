"""Weights export: a checkpoint's bare network ``state_dict`` (the blog's ``epoch_N.pth``), no Lightning needed."""

import json
from pathlib import Path

import torch
import yaml

from project.engine.checkpoints import load_checkpoint_file


def export_weights(ckpt_path: str | Path, out_path: str | Path, prefix: str = "net.") -> Path:
    """Writes the ``prefix``-ed weights of a Lightning checkpoint as a plain ``state_dict`` to ``out_path``.

    Next to it, ``<out>.json`` records the network's ``class_path`` and ``init_args`` from the run's
    ``config.yaml`` (the module does not keep the net in its hyperparameters), so the bare ``nn.Module`` can be
    rebuilt before ``load_state_dict``. Refuses to overwrite. Loads with ``weights_only=True``: a checkpoint that
    holds anything but tensors and plain data raises ``CheckpointLoadError`` (a ``ValueError``) unopened.
    """
    out_path = Path(out_path)
    if out_path.exists():
        raise FileExistsError(f"{out_path} exists; choose another output path (exports never overwrite)")
    ckpt = load_checkpoint_file(ckpt_path)
    weights = {k[len(prefix) :]: v for k, v in ckpt["state_dict"].items() if k.startswith(prefix)}
    if not weights:
        raise ValueError(f"{ckpt_path} holds no weights under '{prefix}'; is the network attribute named otherwise?")
    out_path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(weights, out_path)
    run_config = Path(ckpt_path).resolve().parent.parent / "config.yaml"
    if run_config.is_file():
        model = yaml.safe_load(run_config.read_text()).get("model", {})
        net_config = model.get("init_args", model).get(prefix.rstrip("."))
        if net_config is not None:
            out_path.with_suffix(".json").write_text(json.dumps(net_config, indent=2) + "\n")
    return out_path
