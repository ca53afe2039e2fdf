"""Export a checkpoint's network in the formats people deploy: ``export(ckpt, out_dir, formats)``.

The network is rebuilt from the run's ``config.yaml`` (``model.init_args.net``: ``class_path`` and ``init_args``,
since the module does not keep the net in its hyperparameters) and the checkpoint's ``net.`` weights, in eval mode.

A sharded checkpoint (a folder, from ``configs/fsdp.yaml``) is consolidated on this one process first.

- ``safetensors``: weights, with ``class_path``/``init_args`` in the metadata; ``weights.load_net`` reads it back.
- ``onnx``: torch's exporter (``torch.onnx.export``, dynamo), input ``input`` and output ``output``, batch dynamic.
- ``pt2``: a ``torch.export`` program (``torch.export.save``; ``torch.export.load(f).module()`` runs it), batch
  dynamic.
- ``pth``: the bare ``state_dict`` (the blog's ``epoch_N.pth``) and a ``.json`` with the net's config.

``onnx`` and ``pt2`` trace ``forward`` on an example batch: it must map a tensor batch to a tensor batch, with no
Python branch on a tensor's value. A net that cannot be exported raises ``ValueError`` naming the format and the
reason; outputs are never overwritten.
"""

import json
import re
from pathlib import Path
from typing import Any

import torch
import yaml
from torch import nn

from project.engine.checkpoints import load_checkpoint_file
from project.engine.sharded import full_state_dict
from project.engine.weights import instantiate, save_net

FORMATS = ("safetensors", "onnx", "pt2", "pth")


def export_weights(ckpt_path: str | Path, out_path: str | Path, prefix: str = "net.") -> Path:
    """Writes the ``prefix``-ed weights of a Lightning checkpoint as a plain ``state_dict`` to ``out_path``.

    Next to it, ``<out>.json`` records the network's ``class_path`` and ``init_args`` from the run's
    ``config.yaml``, so the bare ``nn.Module`` can be rebuilt before ``load_state_dict``. Refuses to overwrite.
    Loads with ``weights_only=True``: a checkpoint that holds anything but tensors and plain data raises
    ``CheckpointLoadError`` (a ``ValueError``) unopened.
    """
    out_path = Path(out_path)
    if out_path.exists():
        raise FileExistsError(f"{out_path} exists; choose another output path (exports never overwrite)")
    weights = _net_weights(ckpt_path, prefix)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(weights, out_path)
    run_config = _run_config_path(ckpt_path)
    if run_config.is_file():
        net_config = _net_config(yaml.safe_load(run_config.read_text()), prefix)
        if net_config is not None:
            out_path.with_suffix(".json").write_text(json.dumps(net_config, indent=2) + "\n")
    return out_path


def _run_config_path(ckpt_path: str | Path) -> Path:
    return Path(ckpt_path).resolve().parent.parent / "config.yaml"  # <run>/checkpoints/<file>.ckpt


def _net_config(config: dict[str, Any], prefix: str) -> dict[str, Any] | None:
    model = config.get("model") or {}
    return (model.get("init_args") or model).get(prefix.rstrip("."))


def _net_weights(ckpt_path: str | Path, prefix: str) -> dict[str, torch.Tensor]:
    if Path(ckpt_path).is_dir():  # a sharded checkpoint: its shards consolidated here, on one process
        state_dict = full_state_dict(ckpt_path)
    else:
        state_dict = load_checkpoint_file(ckpt_path)["state_dict"]
    weights = {k[len(prefix) :]: v for k, v in state_dict.items() if k.startswith(prefix)}
    if not weights:
        raise ValueError(f"{ckpt_path} holds no weights under '{prefix}'; is the network attribute named otherwise?")
    return weights


def load_checkpoint_net(ckpt_path: str | Path, prefix: str = "net.") -> tuple[nn.Module, dict[str, Any]]:
    """The network of a run's checkpoint, in eval mode, and its config (``class_path``, ``init_args``)."""
    run_config = _run_config_path(ckpt_path)
    if not run_config.is_file():
        raise ValueError(f"no {run_config}: the run's config names the network to rebuild (checkpoints/ sits in it)")
    net_config = _net_config(yaml.safe_load(run_config.read_text()), prefix)
    if not isinstance(net_config, dict) or "class_path" not in net_config:
        raise ValueError(f"{run_config} has no model.init_args.{prefix.rstrip('.')}.class_path")
    net_config = {"class_path": net_config["class_path"], "init_args": net_config.get("init_args") or {}}
    net = instantiate(net_config["class_path"], net_config["init_args"])
    net.load_state_dict(_net_weights(ckpt_path, prefix))
    return net.eval(), net_config


def example_input(ckpt_path: str | Path) -> torch.Tensor:
    """Two samples of the run's predict data (``config.yaml``'s ``data``), the inputs ``forward`` is traced on.

    Two, not one: a traced batch of 1 would be fixed to 1. Assumes the DataModule's batches are ``x`` or
    ``(x, ...)``, as ``Classifier.predict_step`` does.
    """
    data = yaml.safe_load(_run_config_path(ckpt_path).read_text()).get("data") or {}
    if "class_path" not in data:
        raise ValueError("the run's config.yaml names no data class_path; give the input shape (--input_shape)")
    datamodule = instantiate(data["class_path"], data.get("init_args") or {})
    datamodule.setup("predict")
    batch = next(iter(datamodule.predict_dataloader()))
    x = batch[0] if isinstance(batch, (tuple, list)) else batch
    return x[:2] if len(x) >= 2 else torch.cat([x, x])


def _reason(error: BaseException) -> str:
    """One line: the innermost cause (torch's exporters wrap it in pages of advice)."""
    while error.__cause__ is not None:
        error = error.__cause__
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(error)).strip()
    line = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
    if "data-dependent" in line:
        return f"forward branches on a tensor's value ({line}); use torch.where or torch.cond"
    return f"{type(error).__name__}: {line[:300]}"


def _check_traceable(net: nn.Module, x: torch.Tensor, fmt: str, class_path: str) -> None:
    with torch.no_grad():
        try:
            y = net(x)
        except Exception as error:
            raise ValueError(f"{fmt} export of {class_path} failed: forward raised {_reason(error)}") from None
    if not isinstance(y, torch.Tensor) or y.dim() == 0 or len(y) != len(x):
        what = f"a {type(y).__name__}" if not isinstance(y, torch.Tensor) else f"shape {list(y.shape)}"
        raise ValueError(
            f"{fmt} export of {class_path} failed: forward returns {what}; it must return one tensor "
            f"with the batch first ({len(x)} here)"
        )


def _dynamic_batch() -> tuple[dict[int, Any]]:
    return ({0: torch.export.Dim("batch", min=1)},)


def _export_program(net: nn.Module, x: torch.Tensor, path: Path) -> None:
    torch.export.save(torch.export.export(net, (x,), dynamic_shapes=_dynamic_batch()), path)


def _export_onnx(net: nn.Module, x: torch.Tensor, path: Path) -> None:
    torch.onnx.export(
        net,
        (x,),
        path,
        dynamo=True,
        dynamic_shapes=_dynamic_batch(),
        input_names=["input"],
        output_names=["output"],
        verbose=False,
    )


def export(
    ckpt_path: str | Path,
    out_dir: str | Path,
    formats: tuple[str, ...] = FORMATS,
    example: torch.Tensor | None = None,
    name: str = "model",
) -> list[Path]:
    """Writes ``out_dir/<name>.<format>`` for each format and returns the paths.

    ``example``: an input batch for tracing (``onnx``, ``pt2``); ``None`` takes two samples of the run's data.
    Checks every target before writing any: an existing file raises ``FileExistsError``.
    """
    unknown = [f for f in formats if f not in FORMATS]
    if unknown:
        raise ValueError(f"unknown export format {', '.join(unknown)}; choose from {', '.join(FORMATS)}")
    out_dir = Path(out_dir)
    targets = {fmt: out_dir / f"{name}.{fmt}" for fmt in formats}
    beside = [out_dir / f"{name}.json"] if "pth" in formats else []  # the .pth's config
    clashes = [p for p in [*targets.values(), *beside] if p.exists()]
    if clashes:
        raise FileExistsError(f"{clashes[0]} exists; choose another --out (exports never overwrite)")
    net, net_config = load_checkpoint_net(ckpt_path)
    class_path = net_config["class_path"]
    traced = [fmt for fmt in formats if fmt in ("onnx", "pt2")]
    if traced:
        example = example_input(ckpt_path) if example is None else example
        _check_traceable(net, example, "/".join(traced), class_path)
    out_dir.mkdir(parents=True, exist_ok=True)
    for fmt, path in targets.items():
        try:
            if fmt == "safetensors":
                save_net(net, class_path, net_config["init_args"], path)
            elif fmt == "pth":
                export_weights(ckpt_path, path)
            elif fmt == "pt2":
                _export_program(net, example, path)
            else:
                _export_onnx(net, example, path)
        except OSError:
            raise
        except Exception as error:  # torch's exporters raise many types, each with pages of advice
            path.unlink(missing_ok=True)
            raise ValueError(f"{fmt} export of {class_path} failed: {_reason(error)}") from None
    return list(targets.values())
