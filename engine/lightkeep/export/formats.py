"""Export a checkpoint's model in the formats people deploy: ``export(ckpt, out_dir, formats)``.

The module is rebuilt from the run's ``config.yaml``, loaded strictly and exported in eval mode (a sharded checkpoint
consolidated on this one process first); the four formats and how to load each: docs/export.md. ``onnx`` and ``pt2``
trace ``forward`` on the module's ``example_input_array``, else on two samples of one batch of the run's data module,
or of the module's own loaders when the run has none (predict, else val, else train); which inputs of a batch, and
the line that names them: docs/export.md. A dict batch's entries go in as ``forward``'s parameters, positional where
they can be (else the whole dict is the one input). ONNX names one tensor input ``input`` and one tensor output
``output``. A module that cannot be exported raises ``ValueError`` naming the format and the reason; outputs are
never overwritten.
"""

import inspect
import json
import logging
import os
import re
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import yaml
from lightning.pytorch import LightningDataModule, LightningModule

from lightkeep.checkpoint_files import load_checkpoint_file
from lightkeep.compat_torch import tree_leaves, tree_map, without_compiled_wrappers
from lightkeep.config import its_arguments
from lightkeep.errors import root_cause
from lightkeep.export.weights import build, save_net
from lightkeep.sharded.folders import full_state_dict

FORMATS = ("safetensors", "onnx", "pt2", "pth")
Inputs = tuple[tuple[Any, ...], dict[str, Any]]


def _run_config(ckpt_path: Path, config_path: Path | None = None) -> dict[str, Any]:
    path = config_path or ckpt_path.resolve().parent.parent / "config.yaml"  # <run>/checkpoints/<file>.ckpt
    if not path.is_file():
        where = f"no such file: {path}" if config_path else f"no config.yaml at {path}"
        raise ValueError(
            f"{ckpt_path} is not in a run folder's checkpoints/ ({where}), and a config names the model class to "
            "rebuild: export it where fit saved it (runs/<name>/version_N/checkpoints/), or give --config FILE "
            "with model: your.Module (a checkpoint of plain Lightning)"
        )
    return yaml.safe_load(path.read_text()) or {}


def _with_checkpoint_hparams(recipe: dict[str, Any], ckpt_path: Path) -> dict[str, Any]:
    """The recipe with the arguments of a plain Lightning checkpoint's ``hyper_parameters`` that the class takes
    and the config does not set: ``save_hyperparameters()`` kept what built the saved network."""
    if ckpt_path.is_dir():
        return recipe
    hparams = load_checkpoint_file(ckpt_path, mmap=True).get("hyper_parameters")
    if not isinstance(hparams, dict) or "_class_path" in hparams:  # none, or the CLI's (config.yaml has them)
        return recipe
    given = {k: v for k, v in its_arguments(recipe["class_path"], hparams).items() if k not in recipe["init_args"]}
    return {**recipe, "init_args": {**given, **recipe["init_args"]}}


def _recipe(section: Any, what: str) -> dict[str, Any]:
    if isinstance(section, str):  # `model: my.Model`
        section = {"class_path": section}
    if not isinstance(section, dict) or "class_path" not in section:
        raise ValueError(
            f"the run's config.yaml names no {what} class_path (the config of a LightningCLI of fixed classes, "
            f"LightningCLI(Net, ...)): give --config FILE with {what}: your.Net, its arguments read from the checkpoint"
        )
    return {"class_path": section["class_path"], "init_args": section.get("init_args") or {}}


def load_checkpoint_module(
    ckpt_path: str | Path, config_path: str | Path | None = None
) -> tuple[LightningModule, dict[str, Any], dict[str, Any]]:
    """The run's ``LightningModule`` with the checkpoint's weights, in eval mode; its recipe; the run's config
    (``config_path``, else the run folder's ``config.yaml``)."""
    path = Path(ckpt_path)
    if not path.exists():
        raise ValueError(f"{ckpt_path}: no such checkpoint file or folder")
    # first: a file that is no checkpoint is said to be one, wherever it is (a sharded one consolidated here)
    state_dict = full_state_dict(path) if path.is_dir() else load_checkpoint_file(path)["state_dict"]
    config = _run_config(path, Path(config_path) if config_path is not None else None)
    recipe = _with_checkpoint_hparams(_recipe(config.get("model"), "model"), path)
    module = build(recipe, LightningModule)
    module.configure_model()  # layers a module builds there, as Lightning does before loading
    try:
        module.load_state_dict(state_dict)
    except RuntimeError as error:
        raise ValueError(f"{ckpt_path} does not fit {recipe['class_path']}: {_reason(error)}") from None
    # a layer compiled there is exported as itself: its weights keyed as the module built from the recipe has them
    # (load_net), its graph traced from the module's code
    return without_compiled_wrappers(module).eval(), recipe, config


def _two_samples(inputs: Any) -> Any:
    # Two, not one: a traced batch of 1 would be fixed to 1.
    def cut(t: Any) -> Any:
        if not isinstance(t, torch.Tensor) or t.dim() == 0:
            return t
        return t[:2] if len(t) >= 2 else torch.cat([t, t])

    return tree_map(cut, inputs)


def _forward_parameters(module: LightningModule) -> dict[str, inspect.Parameter]:
    return dict(inspect.signature(module.forward).parameters)


def example_inputs(module: LightningModule, config: dict[str, Any]) -> tuple[Inputs, str]:
    """``(args, kwargs)`` to trace ``forward`` on, and a few words on where they came from."""
    given = module.example_input_array
    if given is not None:
        if isinstance(given, Mapping):
            return ((), dict(_two_samples(dict(given)))), "the module's example_input_array, as keyword inputs"
        if isinstance(given, tuple | list):
            return (tuple(_two_samples(list(given))), {}), "the module's example_input_array, as positional inputs"
        return ((_two_samples(given),), {}), "the module's example_input_array"
    # the run's data module, else the module's own loaders (BoringModel, Lightning's demo transformer: no data module)
    data = config.get("data")
    source = module if data is None else build(_recipe(data, "data"), LightningDataModule)
    batch, loader, failed, no_file = None, None, [], False
    loaders = (("predict", "predict_dataloader"), ("validate", "val_dataloader"), ("fit", "train_dataloader"))
    for stage, loader in loaders:
        try:
            source.setup(stage)
            batch = next(iter(getattr(source, loader)()))
            break
        except Exception as error:  # no such loader (Lightning's default hook: "must be implemented"): the next one
            said = next(iter(str(error).splitlines()), "")[:200]
            if "must be implemented" not in said:
                failed.append(f"{loader}: {type(error).__name__}" + (f": {said}" if said else ""))
                no_file = no_file or isinstance(error, OSError)
    if batch is None:
        whose = "the module's own loaders" if data is None else "the run's data module"
        where = ": run export in the folder the run was trained in" if no_file else ""
        why = f" ({'; '.join(failed)}{where})" if failed else ""
        raise ValueError(
            f"no example input: the module has no example_input_array and {whose} gave no predict, val or train "
            f"batch{why}; set self.example_input_array in the module"
        )
    batch = _two_samples(batch)
    if isinstance(batch, Mapping):
        named = {k: v for k, v in batch.items() if k in _forward_parameters(module)}
        if named:  # in forward's order, positional where it can: the exported program is called like forward
            bound = inspect.signature(module.forward).bind(**named)
            return (bound.args, bound.kwargs), f"a batch of {loader}: its {', '.join(named)}, by forward's names"
        return ((dict(batch),), {}), f"a batch of {loader}: the dict as the one input"
    if isinstance(batch, tuple | list):
        # forward(x) of an (x, y) batch takes its first element; forward(inputs, target) (Lightning's demo
        # transformer) as many as it has required positional parameters
        positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        required = [p for p in _forward_parameters(module).values() if p.kind in positional and p.default is p.empty]
        n = min(max(len(required), 1), len(batch))
        what = "its first element as the input" if n == 1 else f"its first {n} elements as forward's {n} inputs"
        return (tuple(batch[:n]), {}), f"a batch of {loader}: {what}"
    return ((batch,), {}), f"a batch of {loader} as the input"


def _reason(error: BaseException) -> str:
    """One line: the innermost cause (torch's exporters wrap it in pages of advice)."""
    error = root_cause(error)
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(error)).strip()
    line = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
    # torch.export names the call in the module's code that led there (the branch may be inside torch's own layers)
    call = re.search(r"The following call raised this error:\s*File \"([^\"]+)\", line (\d+)", text)
    where = f" at {Path(call[1]).name}:{call[2]}" if call else ""
    if "data-dependent" in line:
        return f"forward branches on a tensor's value{where} ({line}); use torch.where or torch.cond"
    if "specialized it to be a constant" in text:  # torch.export's "Constraints violated (batch)!"
        return (
            f"forward fixes the batch size to the example's{where} (len() of a tensor does; x.size(0) or x.shape[0] "
            "keeps it free)"
        )
    return f"{type(error).__name__}: {line[:300]}"


def _check_traceable(module: LightningModule, inputs: Inputs, fmt: str, class_path: str) -> Any:
    args, kwargs = inputs
    with torch.no_grad():
        try:
            y = module(*args, **kwargs)
        except Exception as error:
            raise ValueError(f"{fmt} export of {class_path} failed: forward raised {_reason(error)}") from None
    odd = [leaf for leaf in tree_leaves(y) if not isinstance(leaf, torch.Tensor)]
    if odd or not tree_leaves(y):
        what = f"a {type(y).__name__}" + (f" holding a {type(odd[0]).__name__}" if odd else " of no tensor")
        raise ValueError(
            f"{fmt} export of {class_path} failed: forward returns {what}; it must return tensors (one, or a "
            "tuple or dict of them), batch first"
        )
    return y


def _dynamic_batch(module: LightningModule, inputs: Inputs) -> dict[str, Any]:
    """Dimension 0 of every input tensor is one batch size, free; keyed by ``forward``'s parameter names."""
    batch = torch.export.Dim("batch", min=1)
    bound = inspect.signature(module.forward).bind(*inputs[0], **inputs[1]).arguments
    free = lambda t: {0: batch} if isinstance(t, torch.Tensor) and t.dim() > 0 else None  # noqa: E731
    return {name: tree_map(free, value) for name, value in bound.items()}


def _export_onnx(module: LightningModule, inputs: Inputs, output: Any, path: Path) -> None:
    args, kwargs = inputs
    single_input = len(args) + len(kwargs) == 1 and isinstance([*args, *kwargs.values()][0], torch.Tensor)
    torch.onnx.export(
        module,
        args,
        path,
        kwargs=kwargs,
        dynamo=True,
        dynamic_shapes=_dynamic_batch(module, inputs),
        input_names=["input"] if single_input else None,
        output_names=["output"] if isinstance(output, torch.Tensor) else None,
        verbose=False,
    )


@contextmanager
def _quiet_exporters() -> Iterator[None]:
    """For this call only: the ONNX exporter's "torchvision is not installed. Skipping torchvision::nms" (one line
    per torchvision op it would register) and torch's LeafSpec deprecation warning, advice to their developers."""
    registration = logging.getLogger("torch.onnx._internal.exporter._registration")
    level = registration.level
    registration.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r".*LeafSpec.*")
            yield
    finally:
        registration.setLevel(level)


def export(
    ckpt_path: str | Path,
    out_dir: str | Path,
    formats: tuple[str, ...] = FORMATS,
    example: Any = None,
    name: str = "model",
    say: Callable[[str], None] = print,
    config_path: str | Path | None = None,
) -> list[Path]:
    """Writes ``out_dir/<name>.<format>`` for each format and returns the paths written (``model.onnx.data``
    too, when the ONNX exporter puts the weights there).

    ``example``: an input for tracing (``onnx``, ``pt2``) as ``example_input_array`` is given; ``None``: see the
    module docstring. ``say`` gets one line: what ``forward`` was traced on. Checks every target before writing
    any: an existing file raises ``FileExistsError``. ``config_path``: a config naming ``model`` (and ``data``), for
    a checkpoint outside a run folder (one plain Lightning wrote).
    """
    unknown = [f for f in formats if f not in FORMATS]
    if unknown:
        raise ValueError(f"unknown export format {', '.join(unknown)}; choose from {', '.join(FORMATS)}")
    out_dir = Path(out_dir)
    targets = {fmt: out_dir / f"{name}.{fmt}" for fmt in formats}
    beside = [out_dir / f"{name}.json"] if "pth" in formats else []  # the .pth's recipe
    beside += [out_dir / f"{name}.onnx.data"] if "onnx" in formats else []
    clashes = [p for p in [*targets.values(), *beside] if p.exists()]
    if clashes:
        raise FileExistsError(f"{clashes[0]} exists; choose another --out (exports never overwrite)")
    module, recipe, config = load_checkpoint_module(ckpt_path, config_path)
    class_path = recipe["class_path"]
    traced = [fmt for fmt in formats if fmt in ("onnx", "pt2")]
    inputs: Inputs = ((), {})
    output = None
    if traced:
        if example is not None:
            module.example_input_array = example
        inputs, source = example_inputs(module, config)
        say(f"Tracing forward for {'/'.join(traced)} on {source}")
        output = _check_traceable(module, inputs, "/".join(traced), class_path)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for fmt, path in targets.items():
        try:
            with _quiet_exporters():
                if fmt == "safetensors":
                    save_net(module, class_path, recipe["init_args"], path)
                    mask = os.umask(0)  # safetensors writes 0600; an export is shared like any file this user writes
                    os.umask(mask)
                    path.chmod(0o666 & ~mask)
                elif fmt == "pth":  # the state_dict, and its recipe beside it
                    torch.save(module.state_dict(), path)
                    path.with_suffix(".json").write_text(json.dumps(recipe, indent=2) + "\n")
                elif fmt == "pt2":
                    dynamic = _dynamic_batch(module, inputs)
                    torch.export.save(torch.export.export(module, *inputs, dynamic_shapes=dynamic), path)
                else:
                    _export_onnx(module, inputs, output, path)
        except OSError:
            raise
        except Exception as error:  # torch's exporters raise many types, each with pages of advice
            path.unlink(missing_ok=True)
            raise ValueError(f"{fmt} export of {class_path} failed: {_reason(error)}") from None
        written.append(path)
        if fmt == "onnx" and (data := path.with_name(f"{path.name}.data")).exists():
            written.append(data)
    return written
