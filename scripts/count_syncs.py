"""Host-device syncs per optimizer step of the three sides of scripts/benchmark.py, split by where they come from.

    python scripts/count_syncs.py                     # 4 epochs of the default config, on CPU
    python scripts/count_syncs.py --epochs 10 --json out.json [--template-arg=--trainer.log_every_n_steps=1]

On a GPU every read of a device value on the host (``.item()``, ``bool(t)``, ``float(t)``, a blocking copy to the
host, an op whose output shape depends on the data) makes the CPU wait for the GPU to finish all it was given.
They are counted on any machine, CPU included, by a ``TorchDispatchMode`` that sees each op before it runs:
``aten._local_scalar_dense`` (what ``.item()``, ``bool()`` and ``float()`` end in), ``aten.is_nonzero``,
``aten.equal``, the ops of data-dependent shape (``nonzero``, ``masked_select``, ``unique``...), and copies from a
non-CPU device to the CPU. The Python stack at the op names its source (innermost frame that is not torch's own).
On a GPU, CUDA's own count is shown beside it: ``torch.cuda.set_sync_debug_mode("warn")`` reports each call that
synchronizes with the device ("n/a" on a machine without CUDA).

Counted: the main thread, from ``on_train_start`` to ``on_train_end`` (the hand loop: its whole loop), while the
model is in training mode, so validation is left out; per optimizer step. The steps (each batch, with the logging
and bar updates after it) are split by source; the epoch ends (epoch metrics, checkpoint decisions after
validation), one burst an epoch whatever the step count, are one figure apart. Reads of tensors that live on the host
on a GPU as well are not syncs and are shown apart, not counted: the optimizer's ``step`` counters
(``torch/optim``, AdamW without ``capturable``/``fused``) and the samplers' random draws (``torch/utils/data``).

Each side runs in a fresh interpreter (``--worker``), as in scripts/benchmark.py: (a) the hand-written loop, (b)
plain Lightning (scripts/benchmark_lightning.py), (c) ``python -m project fit`` with the default config. The last
line of the output is the table as JSON.
"""

import argparse
import inspect
import json
import os
import subprocess
import sys
import tempfile
import unittest.mock
from pathlib import Path
from typing import Any

import torch
from count_syncs_counter import HOST_ONLY, REPO, SyncCounter, write_counts  # scripts/count_syncs_counter.py

SIDES = ("hand", "lightning", "template")


def worker(side: str, out: Path, spec: dict[str, Any], template_args: list[str]) -> None:
    sys.path.insert(0, str(REPO / "scripts"))
    if spec.get("fused"):  # every side's AdamW fused, as `torch.optim.AdamW(..., fused=True)` in its code would be
        adamw = torch.optim.AdamW
        torch.optim.AdamW = lambda *args, **kwargs: adamw(*args, **{**kwargs, "fused": True})  # type: ignore[misc]
    if side == "hand":
        import benchmark_hand

        from project import nets

        built: list[torch.nn.Module] = []

        class RecordedMLP(nets.MLP):  # the hand loop's net, to tell its training from its validation (eval mode)
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                super().__init__(*args, **kwargs)
                built.append(self)

        result = out.with_name("hand_result.json")
        lines, first = inspect.getsourcelines(benchmark_hand.hand_written)
        loop = next(first + i for i, line in enumerate(lines) if "enumerate(tqdm(train_loader" in line)
        end = next(first + i for i, line in enumerate(lines) if '"train/loss_epoch"' in line)

        def phase() -> str:  # the batch loop's lines are the steps; after it, the epoch's end
            frame = sys._getframe(1)
            while frame is not None and frame.f_code is not benchmark_hand.hand_written.__code__:
                frame = frame.f_back
            return "step" if frame is not None and loop <= frame.f_lineno < end else "epoch end"

        with unittest.mock.patch.object(nets, "MLP", RecordedMLP):
            mode = SyncCounter(lambda: bool(built) and built[0].training, phase)
            with mode:
                benchmark_hand.hand_written(spec, result)
        write_counts(out, mode, json.loads(result.read_text())["steps"])
        return
    counter = {"class_path": "count_syncs_callback.CountSyncs", "init_args": {"out": str(out)}}
    if side == "lightning":
        import benchmark_lightning
        import count_syncs_callback

        trainer_class = benchmark_lightning.L.Trainer

        def with_counter(*args: Any, callbacks: list, **kwargs: Any) -> Any:
            return trainer_class(*args, callbacks=[*callbacks, count_syncs_callback.CountSyncs(str(out))], **kwargs)

        with unittest.mock.patch.object(benchmark_lightning.L, "Trainer", with_counter):
            benchmark_lightning.main(out.with_name("timer.json"), spec)
        return
    from project.engine.cli import cli_main

    args = ["fit", "--trainer.max_epochs", str(spec["epochs"]), "--run.root", str(out.parent / "runs")]
    cli_main([*args, *template_args, f"--trainer.callbacks+={json.dumps(counter)}"])


def run_side(side: str, spec: dict[str, Any], workdir: Path, template_args: list[str]) -> dict[str, Any]:
    workdir.mkdir(parents=True)
    out = workdir / "syncs.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", side, str(out), json.dumps(spec)]
    cmd += [f"--template-arg={a}" for a in template_args]
    path = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p] + [str(REPO), str(REPO / "scripts")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path), "PYTHONWARNINGS": "ignore"}
    with open(workdir / "output.log", "w") as log:
        proc = subprocess.run(cmd, cwd=workdir, env=env, stdout=log, stderr=subprocess.STDOUT)
    if proc.returncode != 0 or not out.is_file():
        tail = (workdir / "output.log").read_text()[-5000:]
        raise SystemExit(f"the {side} run exited {proc.returncode}: {' '.join(cmd)}\n{tail}")
    return json.loads(out.read_text())


def table(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Per optimizer step, by source; the host-only reads apart."""
    rows: dict[str, Any] = {}
    for side, r in results.items():
        steps = r["steps"]
        syncs = {s: n / steps for s, n in r["by_source"].items() if s not in HOST_ONLY}
        host = {s: n / steps for s, n in r["by_source"].items() if s in HOST_ONLY}
        total = sum(syncs.values())
        rows[side] = {"steps": steps, "syncs_per_step": total, "stalls_per_step": r["stalls"] / steps}
        rows[side]["epoch_end_per_step"] = r["epoch_end"] / steps
        cuda = r.get("cuda_syncs")  # None without CUDA
        rows[side]["cuda_syncs_per_step"] = None if cuda is None else cuda / steps
        where = {w: n / steps for w, n in sorted(r["where"].items(), key=lambda kv: -kv[1])}
        rows[side]["where"] = where
        rows[side] |= {
            "steps_per_sync": steps / sum(n for s, n in r["by_source"].items() if s not in HOST_ONLY)
            if total
            else None,
            "by_source": syncs,
            "host_only": host,
        }
    return rows


def print_table(rows: dict[str, Any], spec: dict[str, Any]) -> None:
    sources = sorted({s for r in rows.values() for s in r["by_source"]})
    print(
        f"\nHost-device syncs per optimizer step, training only (MLP {spec['hidden_sizes']}, {spec['epochs']} epochs)"
    )
    labels = {"hand": "(a) hand", "lightning": "(b) lightning", "template": "(c) template"}
    print(f"{'':<32}" + "".join(f"{labels[s]:>15}" for s in rows))
    for source in sources:
        print(f"{'  ' + source:<32}" + "".join(f"{r['by_source'].get(source, 0):>15.3f}" for r in rows.values()))
    print(f"{'total syncs / step':<32}" + "".join(f"{r['syncs_per_step']:>15.3f}" for r in rows.values()))
    every = [f"{r['steps_per_sync']:.1f}" if r["steps_per_sync"] else "never" for r in rows.values()]
    print(f"{'optimizer steps per sync':<32}" + "".join(f"{e:>15}" for e in every))
    cuda = [f"{r['cuda_syncs_per_step']:.3f}" if r["cuda_syncs_per_step"] is not None else "n/a" for r in rows.values()]
    print(f"{'CUDA syncs / step (debug mode)':<32}" + "".join(f"{c:>15}" for c in cuda))
    print(f"{'stalls / step (1st of a burst)':<32}" + "".join(f"{r['stalls_per_step']:>15.3f}" for r in rows.values()))
    ends = "".join(f"{r['epoch_end_per_step']:>15.3f}" for r in rows.values())
    print(f"{'epoch ends, per step (apart)':<32}" + ends)
    print(f"{'optimizer steps counted':<32}" + "".join(f"{r['steps']:>15}" for r in rows.values()))
    host = sorted({s for r in rows.values() for s in r["host_only"]})
    for source in host:
        print(
            f"{'  not a sync: ' + source[6:]:<32}"
            + "".join(f"{r['host_only'].get(source, 0):>15.3f}" for r in rows.values())
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=4, help="epochs of each run (default: 4)")
    parser.add_argument("--hidden", type=int, help="width of every hidden layer (default: the config's)")
    parser.add_argument("--sides", default=",".join(SIDES), help="which sides, comma-separated (default: all)")
    parser.add_argument(
        "--fused",
        action="store_true",
        help="every side's AdamW fused (skips a step on the device: the NaN guard's "
        "host read then comes every 50 steps)",
    )
    parser.add_argument("--where", action="store_true", help="also list the lines that read each value")
    parser.add_argument("--json", type=Path, help="also write the table to this file")
    parser.add_argument(
        "--template-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra argument to the template's CLI, repeatable",
    )
    parser.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        side, out, spec = args.worker
        worker(side, Path(out), json.loads(spec), args.template_arg)
        return 0
    sys.path.insert(0, str(REPO / "scripts"))
    import benchmark

    spec = benchmark.make_spec(argparse.Namespace(epochs=args.epochs, hidden=args.hidden, batch_size=None))
    spec["fused"] = args.fused
    results = {}
    with tempfile.TemporaryDirectory(prefix="count-syncs-") as tmp:
        for side in args.sides.split(","):
            results[side] = run_side(side, spec, Path(tmp) / side, args.template_arg)
    rows = table(results)
    print_table(rows, spec)
    if args.where:
        for side, row in rows.items():
            print(f"\n{side}: per optimizer step, by the line that read the value")
            for where, n in row["where"].items():
                print(f"  {n:8.3f}  {where}")
    summary = {"spec": spec, "template_args": args.template_arg, "sides": rows}
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
