"""Export a checkpoint's model in the formats people deploy: ``export(ckpt, out_dir, formats)``.

The module is rebuilt from the run's ``config.yaml``, loaded strictly and exported in eval mode (a sharded checkpoint
consolidated on this one process first); the four formats and how to load each: docs/export.md. ``onnx`` and ``pt2``
trace ``forward`` on the module's ``example_input_array``, else on exactly what the module's own step calls
``forward`` with (its ``predict_step``, else ``validation_step``, else ``training_step``; Lightning's ``predict_step``
when it has none) on two samples of one batch of the run's data module, or of the module's own loaders when the run
has none (the step's own loader first): one tensor, several, keywords, a dict. ONNX names one tensor input ``input``
and one tensor output ``output``, other inputs by ``forward``'s parameters. A module that cannot be exported raises
``ValueError`` naming the format and the reason; outputs are never overwritten.
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
from lightning.pytorch import LightningDataModule, LightningModule
from lightning.pytorch.utilities.model_helpers import is_overridden

from lightkeep.checkpoint_files import load_checkpoint_file
from lightkeep.compat_torch import tree_leaves, tree_map, without_compiled_wrappers
from lightkeep.errors import root_cause
from lightkeep.export.recipe import run_config, section_recipe, with_checkpoint_hparams
from lightkeep.export.weights import build, save_net
from lightkeep.sharded.folders import full_state_dict

FORMATS = ("safetensors", "onnx", "pt2", "pth")
Inputs = tuple[tuple[Any, ...], dict[str, Any]]


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
    config = run_config(path, Path(config_path) if config_path is not None else None)
    recipe = with_checkpoint_hparams(section_recipe(config.get("model"), "model"), path)
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


class _Called(Exception):
    """Raised on forward's first call: the step stops there (its loss, self.log and metrics need a Trainer)."""


def _forward_inputs(module: LightningModule, step: str, batch: Any, loader: str) -> Inputs:
    """What ``forward`` is called with when ``step`` runs on ``batch``, under no_grad (export has the module in eval
    mode)."""
    called: list[Inputs] = []

    def record(_: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        called.append((args, kwargs))
        raise _Called

    # on the LightningModule itself: a step's self(...) goes through its __call__, and so through this hook
    hook = module.register_forward_pre_hook(record, with_kwargs=True)
    why = "never calls forward (self(...))"
    try:
        with torch.no_grad():
            getattr(module, step)(batch, 0)
    except _Called:
        pass
    except Exception as error:  # before forward (or the step's own `except` hid _Called: then `called` holds it)
        why = f"raised {_reason(error)} before calling forward"
    finally:
        hook.remove()
    if not called:
        raise ValueError(
            f"no example input: {step} {why} on a batch of {loader}; set self.example_input_array in the module, "
            "or give --input_shape"
        )
    return called[0]


def _shown(inputs: Inputs) -> str:
    """``forward(Tensor[2, 4], mask=Tensor[2, 5])``: what forward was called with."""

    def what(value: Any) -> str:
        return f"Tensor{list(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__

    args, kwargs = inputs
    return f"forward({', '.join([*map(what, args), *(f'{k}={what(v)}' for k, v in kwargs.items())])})"


# each step, with the stage and the loader Lightning runs it on
STEPS = {
    "predict_step": ("predict", "predict_dataloader"),
    "validation_step": ("validate", "val_dataloader"),
    "training_step": ("fit", "train_dataloader"),
}


def example_inputs(module: LightningModule, config: dict[str, Any]) -> tuple[Inputs, str]:
    """``(args, kwargs)`` to trace ``forward`` on, and a few words on where they came from."""
    given = module.example_input_array
    if given is not None:
        if isinstance(given, Mapping):
            return ((), dict(_two_samples(dict(given)))), "the module's example_input_array, as keyword inputs"
        if isinstance(given, tuple | list):
            return (tuple(_two_samples(list(given))), {}), "the module's example_input_array, as positional inputs"
        return ((_two_samples(given),), {}), "the module's example_input_array"
    # the module's own step knows what its forward takes: predict_step, else validation_step, else training_step;
    # with none, Lightning's own predict_step (forward on the batch)
    step = next((s for s in STEPS if is_overridden(s, module)), "predict_step")
    # the run's data module, else the module's own loaders (BoringModel, Lightning's demo transformer: no data module)
    data = config.get("data")
    source = module if data is None else build(section_recipe(data, "data"), LightningDataModule)
    batch, loader, failed, no_file = None, None, [], False
    for stage, loader in sorted(STEPS.values(), key=lambda pair: pair != STEPS[step]):  # the step's own loader first
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
            f"batch{why}; set self.example_input_array in the module, or give --input_shape"
        )
    inputs = _forward_inputs(module, step, _two_samples(batch), loader)
    return inputs, f"what {step} gives it on a batch of {loader}: {_shown(inputs)}"


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
    per torchvision op it would register), its "axis name: batch will not be used" (inputs sharing the batch
    dimension) and torch's LeafSpec deprecation warning, advice to their developers."""
    registration = logging.getLogger("torch.onnx._internal.exporter._registration")
    level = registration.level
    registration.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r".*LeafSpec.*")
            warnings.filterwarnings("ignore", message=r".*The axis name: .* will not be used.*")
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
