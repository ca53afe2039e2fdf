"""``python -m lightkeep compare A.ckpt B.ckpt`` (or ``python -m <project> compare``): how far apart two checkpoints
are, entry by entry (weights, optimizer states, loops, callbacks and the engine's record in them, hyper-parameters):
max |Δ| over tensors, equality of everything else (floating-point values within ``--atol``). Exits 0 when equal,
1 when they differ, 2 when a file cannot be read. Where each run wrote its checkpoints is no part of its state: paths
there compare relative to it, so two runs of one config in ``version_0`` and ``version_1`` compare equal.

A file holding objects outside torch's ``weights_only`` allow-list (a project's own classes, pandas objects in
``hyper_parameters``) is still read: those objects become stand-ins that run nothing and are named as left out.
``--trust`` imports their classes instead, from the working directory as ``python -m`` does.
"""

import argparse
import math
import os
import pickle
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from lightkeep.checkpoint_files import CheckpointLoadError, load_checkpoint_file
from lightkeep.config import entry

SHOWN = 5  # differing values named per entry
DESCRIPTION = (
    "How far apart two checkpoint files are, entry by entry: max |Δ| over tensors, equality of other values. Exits 0 "
    "when equal, 1 when they differ, 2 when a file cannot be read. Objects of classes outside torch's weights_only "
    "allow-list are left out (named), unless --trust."
)


class NotImported:
    """An object (or class, or a function's result) from a global that was not imported: runs nothing.

    Pickle builds it as it would the real one: a call, ``__new__``, its ``__dict__`` set, the items of a dict or list
    subclass added.
    """

    name = ""  # the global's "module.name"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setitem__(self, key: Any, value: Any) -> None:
        pass

    def append(self, item: Any) -> None:  # pickle's APPENDS falls back on it without an ``extend``
        pass


# What torch.save writes for tensors and the containers around them: built for real even from an untrusted file
# (torch's weights_only allows each). Storage types never get here: torch's own unpickler maps them first.
SAFE = {
    ("torch._utils", "_rebuild_tensor_v2"),
    ("torch._utils", "_rebuild_parameter"),
    ("torch._utils", "_rebuild_parameter_with_state"),
    ("collections", "OrderedDict"),
    ("collections", "Counter"),
    ("torch", "Size"),
    ("torch", "device"),
    ("__builtin__", "set"),  # torch.save writes protocol 2, which names builtins as Python 2 did
    ("__builtin__", "frozenset"),
    ("_codecs", "encode"),  # protocol 2's bytes
}


class _Unpickler(pickle.Unpickler):
    """``torch.load``'s unpickler (its storages read by torch) that imports only ``SAFE`` globals and stands in for
    any other; ``trust``: imports every global it can, standing in for those that do not import here."""

    trust = False

    def find_class(self, module: str, name: str) -> Any:
        constant = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype | torch.layout)
        if self.trust or constant or (module, name) in SAFE:
            try:
                return super().find_class(module, name)
            except (ImportError, AttributeError):  # a project's class, read outside that project
                pass
        return type(name, (NotImported,), {"name": f"{module}.{name}"})


class _TrustingUnpickler(_Unpickler):
    trust = True


def read(path: Path, trust: bool) -> dict[str, Any]:
    """The checkpoint, by torch's ``weights_only`` load; where that refuses a global, again with stand-ins for it."""
    try:
        return load_checkpoint_file(path)
    except CheckpointLoadError as refused:
        unpickler = _TrustingUnpickler if trust else _Unpickler
        with_stand_ins = types.SimpleNamespace(__name__=__name__, Unpickler=unpickler)  # what torch.load calls
        try:
            checkpoint = torch.load(path, map_location="cpu", weights_only=False, pickle_module=with_stand_ins)
        except Exception:
            raise refused from None  # damaged or not a checkpoint: the weights_only load said which
        if not isinstance(checkpoint, dict) or "state_dict" not in checkpoint:
            raise refused from None
        return checkpoint


def leaves(tree: Any, folders: list[str], path: tuple = ()) -> Iterator[tuple[tuple, Any]]:
    """``(path, value)`` for each tensor, plain value, stand-in or empty container in ``tree``; paths inside one of
    ``folders``, in keys and values, made relative to it."""
    if isinstance(tree, dict) and tree:
        for key, value in tree.items():
            yield from leaves(value, folders, (*path, relative(key, folders)))
    elif isinstance(tree, list | tuple) and tree:
        for i, value in enumerate(tree):
            yield from leaves(value, folders, (*path, i))
    else:
        yield path, relative(tree, folders)


def relative(value: Any, folders: list[str]) -> Any:
    for folder in folders:
        if isinstance(value, str) and (value == folder or value.startswith(folder + os.sep)):
            return "<checkpoints>" + value[len(folder) :]
    return value


def written_to(checkpoint: dict[str, Any]) -> list[str]:
    """Where the file's run wrote checkpoints (each checkpoint callback's ``dirpath``): no part of its state, so two
    runs of one config (``version_0``, ``version_1``, or files copied elsewhere) compare equal."""
    states = checkpoint.get("callbacks")
    states = states.values() if isinstance(states, dict) else []
    return [s["dirpath"] for s in states if isinstance(s, dict) and isinstance(s.get("dirpath"), str)]


def stand_in(value: Any) -> str | None:
    """The global a stand-in is for; ``None`` for a real value."""
    if isinstance(value, type) and issubclass(value, NotImported):
        return value.name
    return type(value).name if isinstance(value, NotImported) else None


def difference(a: Any, b: Any, atol: float) -> tuple[float, str | None]:
    """``(max |Δ|, why they differ)``: ``why`` is ``None`` when equal (floating-point values: within ``atol``; a
    count or an integer RNG state must be equal)."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.shape != b.shape or a.dtype != b.dtype:
            return math.inf, f"{a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}"
        same = (a == b) | (a.isnan() & b.isnan())  # in their own dtype: int64 fingerprints outgrow float64
        wide = torch.complex128 if a.is_complex() else torch.float64
        gap = (a.to(wide) - b.to(wide)).abs().nan_to_num(nan=math.inf).masked_fill(same, 0)  # inf - inf is NaN
        worst = gap.max().item() if gap.numel() else 0.0
        floating = a.is_floating_point() or a.is_complex()
        return worst, None if (worst <= atol if floating else bool(same.all())) else f"|Δ| {worst:.3g}"
    numbers = all(isinstance(v, int | float) for v in (a, b)) and any(isinstance(v, float) for v in (a, b))
    if numbers and (abs(a - b) <= atol or (a != a and b != b)):  # NaN equals NaN
        return 0.0, None
    try:
        same = type(a) is type(b) and bool(a == b)
    except Exception:  # an object of --trust whose == is no bool (a numpy array, a DataFrame): its text, then
        same = repr(a) == repr(b)
    return 0.0, None if same else f"{a!r:.40} vs {b!r:.40}"


def compare_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog=f"{entry().command} compare", description=DESCRIPTION)
    parser.add_argument("files", nargs=2, type=Path, metavar="FILE.ckpt")
    parser.add_argument("--atol", type=float, default=0.0, help="largest |Δ| of floating-point values counted equal")
    trust = "import the classes the files name: RUNS CODE FROM THE FILES (trusted files only)"
    parser.add_argument("--trust", action="store_true", help=trust)
    args = parser.parse_args(argv)
    for file in args.files:
        if not file.is_file():
            print(f"compare: no file {file}: give the path of a .ckpt file, e.g. runs/<name>/version_N/checkpoints/"
                  "last.ckpt", file=sys.stderr)  # fmt: skip
            return 2
    here = os.getcwd()  # the checkpoint's classes import from here (python -m puts it on the path; a script doesn't)
    added = here not in sys.path
    sys.path[:0] = [here] if added else []
    try:
        checkpoints = [read(file, args.trust) for file in args.files]
    except CheckpointLoadError as error:
        print(f"compare: {error}", file=sys.stderr)
        return 2
    finally:
        if added:
            sys.path.remove(here)
    trees = [dict(leaves(checkpoint, written_to(checkpoint))) for checkpoint in checkpoints]
    return report(*trees, args.files, args.atol, args.trust)


def report(a: dict, b: dict, files: list[Path], atol: float, trust: bool) -> int:
    """Prints a row per entry, then what differs and what was left out; returns 0 when equal, else 1."""
    rows: dict[str, list] = {}  # entry -> [tensors, max |Δ|, values, differing]
    named: dict[str, list[str]] = {}  # entry -> what differs in it
    left_out: dict[str, str] = {}  # path -> the global not imported
    for path in [*a, *(p for p in b if p not in a)]:
        row, shown = rows.setdefault(str(path[0]), [0, 0.0, 0, 0]), ".".join(map(str, path))
        if path not in a or path not in b:
            why = f"only in {files[path in b]}"  # files[False]: the first
        elif stand_in(a[path]) or stand_in(b[path]):
            left_out[shown] = stand_in(a[path]) or stand_in(b[path])
            continue
        else:
            worst, why = difference(a[path], b[path], atol)
            row[0 if isinstance(a[path], torch.Tensor) else 2] += 1
            row[1] = max(row[1], worst)
        if why:
            row[3] += 1
            named.setdefault(str(path[0]), []).append(f"{shown} ({why})")
    print(f"{files[0]} vs {files[1]}")
    print(f"{'entry':<28} {'tensors':>8} {'max |Δ|':>10} {'values':>8} {'differ':>8}")
    for name, (tensors, worst, values, differing) in rows.items():
        print(f"{name[:28]:<28} {tensors:>8} {f'{worst:.3g}' if tensors else '-':>10} {values:>8} {differing:>8}")
    for lines in named.values():
        more = f", and {len(lines) - SHOWN} more" if len(lines) > SHOWN else ""
        print(f"differ: {', '.join(lines[:SHOWN])}{more}")
    if left_out:
        fix = "; run in the folder they import from" if trust else "; --trust imports them, running the files' code"
        print(f"left out (classes not imported: {', '.join(sorted(set(left_out.values())))}): "
              f"{', '.join(left_out)}{fix}")  # fmt: skip
    print(f"differ in {len(named)} of {len(rows)} entries" if named else "equal")
    return 1 if named else 0
