"""State a checkpoint does not hold: what the module and the user's own callbacks keep in plain attributes. Lightning
saves parameters, buffers, optimizer and scheduler states and the ``state_dict`` of callbacks that have one; a count
the module keeps in ``self.seen`` (a warm-up of its own), or a list it fills for an epoch's mean, starts afresh on a
resume, and the run trains or logs otherwise than the uninterrupted one (1.28e-2 off with a count, measured).

The engine cannot restore them (nothing says what they mean) but it can tell: each checkpoint records them
(``record_unsaved``), and a resume names, at its first batch, each that differs from the saved run's
(``unsaved_notes``), so that ``resume verified`` never covers them in silence."""

import functools
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from torchmetrics import Metric

from lightkeep.compat_torch import unsaved_buffers
from lightkeep.module_hooks import own_hook

# Classes whose attributes are their own state to restore (Lightning's callbacks) or set by Lightning (the module's)
_LIBRARIES = ("lightning", "pytorch_lightning", "lightkeep")
_BASE_ATTRIBUTES = frozenset(vars(L.LightningModule())) | {"_current_fx_name", "_jit_is_scripting"}


def record_unsaved(trainer: L.Trainer) -> dict[str, Any]:
    """For the engine's record in a checkpoint: ``lists``, the module's lists of tensors by length; ``values``, the
    ``repr`` of the plain values of the module (key ``""``), of its submodules of the user's own classes (``self.``
    and their names) and of the user's callbacks (by state key)."""
    module = trainer.lightning_module
    lists = {
        name: len(value)
        for name, value in vars(module).items()
        if isinstance(value, list) and value and all(torch.is_tensor(item) or isinstance(item, dict) for item in value)
    }
    values = {key: said for key, part in _users_parts(trainer).items() if (said := _plain_values(part)) or not key}
    return {"lists": lists, "values": values}


def unsaved_notes(saved: dict[str, Any], trainer: L.Trainer) -> list[str]:
    """What a resume's start line names of ``saved`` (a checkpoint's ``record_unsaved``; an empty dict from engine
    1.7.0 and before, lists only from 1.8.0): call it at the first batch, once the hooks up to it have run (the
    module's ``on_load_checkpoint``, the callbacks' ``load_state_dict``, an epoch start)."""
    out = []
    module = type(trainer.lightning_module).__name__
    if saved.get("lists"):
        lists = ", ".join(f"{name} ({n} items)" for name, n in sorted(saved["lists"].items()))
        out.append(
            f"{lists} of {module}: a list the module filled in training, which no checkpoint holds: what it "
            "computes from it (an epoch's mean in on_train_epoch_end) covers the batches after this resume; "
            "self.log(..., on_epoch=True) or a torchmetrics metric keeps such a value"
        )
    parts = _users_parts(trainer)
    # one note per kind of value and per change: the same change in layers of one class (24 blocks) is said once
    alike: dict[tuple[str, str, bool], list[str]] = {}
    for key, values in sorted(saved.get("values", {}).items()):
        part = parts.get(key)
        if part is None:
            continue
        buffers = unsaved_buffers(part) if isinstance(part, torch.nn.Module) else {}
        changed = [
            (name in buffers, f"{name} ({_short(was)} saved, {_short(now)} now)")
            for name, was in sorted(values.items())
            if (now := _said(getattr(part, name, None))) != was
        ]
        for buffered in sorted({kind for kind, _ in changed}):  # the plain attributes' note first
            said = ", ".join(item for kind, item in changed if kind == buffered)
            alike.setdefault((said, type(part).__name__ if key.startswith("self.") else key, buffered), []).append(key)
    for (changed, _, buffered), keys in alike.items():
        part, key = parts[keys[0]], keys[0]
        keeps = "state_dict and load_state_dict keep"  # a callback's
        whose = type(part).__name__
        if key == "":
            keeps = "on_save_checkpoint and on_load_checkpoint keep"
        elif key.startswith("self."):
            keeps = "a buffer (register_buffer) keeps"
            whose = f"{key}{f' and {len(keys) - 1} more' if len(keys) > 1 else ''} ({whose})"
        what = "a plain attribute"
        if buffered:  # state_dict leaves it out
            what, keeps = "a buffer registered with persistent=False", "a buffer registered with persistent=True keeps"
        out.append(
            f"{changed} of {whose}: {what}, in no checkpoint, differs from the saved run's at this first "
            f"batch: a count goes on from here ({keeps} one); a cache or a clock does not matter"
        )
    return out


def _users_parts(trainer: L.Trainer) -> dict[str, Any]:
    """The module (key ``""``); its submodules whose class is (or derives from) one of the user's own, by
    ``self.`` and their names (a net's count of its calls; torch's and other libraries' layers hold settings); and each
    callback of the user's own, by state key: not Lightning's or the engine's (nor a subclass of one), nor one with a
    ``state_dict``, whose state Lightning restores."""
    parts: dict[str, Any] = {"": trainer.lightning_module}
    # the module's own package is the user's, installed or not (a project installed as a wheel into site-packages)
    package = type(trainer.lightning_module).__module__.partition(".")[0]
    package = None if package in _LIBRARIES else package  # Lightning's demo modules are not
    for name, submodule in trainer.lightning_module.named_modules():
        # a torchmetrics Metric's states the engine keeps itself (lightkeep.resume); its own counters are internals
        classes = [c for c in type(submodule).__mro__ if issubclass(c, torch.nn.Module)]  # not abc.ABC, Generic
        ones_own = any(_users_own(c) or c.__module__.partition(".")[0] == package for c in classes)
        if name and not isinstance(submodule, Metric) and ones_own:
            parts[f"self.{name}"] = submodule
    for callback in trainer.callbacks:
        roots = [c.__module__.partition(".")[0] for c in type(callback).__mro__ if c not in (Callback, object)]
        if not own_hook(callback, "state_dict", Callback) and not any(root in _LIBRARIES for root in roots):
            parts[callback.state_key] = callback
    return parts


@functools.cache
def _users_own(cls: type) -> bool:
    """Whether ``cls`` is written in the user's code: not in an installed distribution (``site-packages``: torch,
    timm, a wrapper class FSDP2 makes), nor Lightning's or the engine's."""
    where = getattr(sys.modules.get(cls.__module__), "__file__", None) or ""
    installed = {"site-packages", "dist-packages"} & set(Path(where).parts)
    return bool(where) and not installed and cls.__module__.partition(".")[0] not in _LIBRARIES


def _plain_values(part: Any) -> dict[str, str]:
    """The ``repr`` of each number, bool or small tensor ``part`` holds as a plain attribute of its own, not one
    Lightning's or torch's base classes set, or as a buffer registered with ``persistent=False``. (A tensor assigned
    to a module's attribute is plain unless registered as a parameter or buffer.) Strings are left out: a token or an
    address a callback holds would go into every checkpoint."""
    values = {**vars(part), **(unsaved_buffers(part) if isinstance(part, torch.nn.Module) else {})}
    return {name: _said(value) for name, value in values.items() if name not in _BASE_ATTRIBUTES and _plain(value)}


def _plain(value: Any) -> bool:
    if type(value) in (int, float, bool):
        return True
    # up to 16 values: a count or a running mean kept on the device; a DTensor (FSDP2), a meta or sparse tensor has
    # no values to list here
    return type(value) is torch.Tensor and value.layout == torch.strided and not value.is_meta and value.numel() <= 16


def _said(value: Any) -> str:
    if not _plain(value) and value is not None:
        return f"a {type(value).__name__}"
    try:
        return repr(value.tolist() if torch.is_tensor(value) else value)
    except RuntimeError:  # a dtype with no Python scalar (quantized, packed float4, bits8)
        return f"a {value.dtype} tensor"


def _short(said: str) -> str:
    return said if len(said) <= 40 else said[:39] + "…"
