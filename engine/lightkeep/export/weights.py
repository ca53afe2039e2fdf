"""A model in one ``.safetensors`` file: its weights, and in the metadata the recipe to build it.

Read with no pickle, so no code runs on load but the named class's own ``__init__``::

    from lightkeep.export.weights import load_net
    model = load_net("export/model.safetensors")  # eval mode, on the CPU

The metadata holds ``class_path`` (``"my_lab.module.Classifier"``) and ``init_args`` (JSON), as in the run's config;
``build`` makes the object of such a recipe as LightningCLI does (jsonargparse: nested ``class_path`` included).
"""

import json
from pathlib import Path
from typing import Any

from torch import nn


def build(recipe: dict[str, Any], base: type = nn.Module) -> Any:
    """The object of ``{"class_path": ..., "init_args": {...}}`` (a subclass of ``base``), its arguments typed and
    nested ``class_path`` built by jsonargparse, as LightningCLI builds a config's model; ``ValueError`` if not."""
    from jsonargparse import ArgumentParser  # LightningCLI's parser

    parser = ArgumentParser(exit_on_error=False)
    parser.add_argument("--built", type=base)
    try:
        return parser.instantiate_classes(parser.parse_object({"built": recipe})).built
    except Exception as error:
        while error.__cause__ is not None:
            error = error.__cause__
        reason = " ".join(str(error).split())[:500]
        raise ValueError(f"cannot build {recipe.get('class_path')!r} from the run's config ({reason})") from None


def save_net(net: nn.Module, class_path: str, init_args: dict[str, Any], path: str | Path) -> Path:
    """Writes ``net``'s parameters and buffers (a module, or a LightningModule), with its recipe in the metadata;
    tensors that share memory (tied weights) are stored once."""
    from safetensors.torch import save_model  # the export extra; only exporting and loading need it

    path = Path(path)
    metadata = {"class_path": class_path, "init_args": json.dumps(init_args)}
    save_model(net, str(path), metadata=metadata)
    return path


def load_net(path: str | Path, device: str = "cpu") -> nn.Module:
    """Builds the module named in ``path``'s metadata and loads its weights (strictly), in eval mode."""
    from safetensors.torch import load_model, safe_open

    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata() or {}
    if "class_path" not in metadata:
        raise ValueError(f"{path} has no class_path in its metadata: it was not written by save_net")
    net = build({"class_path": metadata["class_path"], "init_args": json.loads(metadata.get("init_args", "{}"))})
    load_model(net, str(path), strict=True, device=device)
    return net.eval()
