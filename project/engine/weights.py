"""A network in one ``.safetensors`` file: its weights, and in the metadata the recipe to build it.

Readable with torch and safetensors alone (no Lightning, no pickle, so no code runs on load)::

    from project.engine.weights import load_net
    net = load_net("export/model.safetensors")  # eval mode, on the CPU

The metadata holds ``class_path`` (``"project.nets.MLP"``) and ``init_args`` (JSON), as in the run's config.
"""

import importlib
import json
from pathlib import Path
from typing import Any

from torch import nn


def instantiate(class_path: str, init_args: dict[str, Any]) -> Any:
    """``class_path(**init_args)``; init_args must be plain values (a nested ``class_path`` is not built here)."""
    module_name, _, class_name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError, ValueError) as error:
        raise ValueError(f"cannot import the class {class_path!r} ({error})") from None
    nested = [key for key, value in init_args.items() if isinstance(value, dict) and "class_path" in value]
    if nested:
        raise ValueError(f"{class_path} takes objects built from a class_path ({', '.join(nested)}); build it yourself")
    return cls(**init_args)


def save_net(net: nn.Module, class_path: str, init_args: dict[str, Any], path: str | Path) -> Path:
    """Writes ``net``'s parameters and buffers; tensors that share memory (tied weights) are stored once."""
    from safetensors.torch import save_model  # the export extra; only exporting and loading need it

    path = Path(path)
    metadata = {"class_path": class_path, "init_args": json.dumps(init_args)}
    save_model(net, str(path), metadata=metadata)
    return path


def load_net(path: str | Path, device: str = "cpu") -> nn.Module:
    """Builds the network named in ``path``'s metadata and loads its weights (strictly), in eval mode."""
    from safetensors.torch import load_model, safe_open

    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata() or {}
    if "class_path" not in metadata:
        raise ValueError(f"{path} has no class_path in its metadata: it was not written by save_net")
    net = instantiate(metadata["class_path"], json.loads(metadata.get("init_args", "{}")))
    load_model(net, str(path), strict=True, device=device)
    return net.eval()
