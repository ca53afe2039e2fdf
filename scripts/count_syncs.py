"""Host-device syncs per optimizer step of the three sides of scripts/benchmark.py, split by where they come from.

    python scripts/count_syncs.py                     # 4 epochs of the default config, on CPU: 1 process, 2 ranks
    python scripts/count_syncs.py --epochs 10 --json out.json [--template-arg=--trainer.log_every_n_steps=1]
    python scripts/count_syncs.py --ranks 2           # DDP only: 2 gloo ranks on CPU, each counted
    python scripts/count_syncs.py --ddp-accelerator gpu   # the 2 ranks of (b) and (c) on 2 GPUs (NCCL)

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

Under DDP the collectives are counted too (``c10d`` ops, seen by the same mode): a blocking one (``torch.distributed``'s
function called without ``async_op``) makes the host wait for every rank, on a GPU after it has drained its queue, so
it counts as a wait of its source; those nothing waits for (``async_op=True``, DDP's gradient buckets) are shown
apart. "Steps with a wait" counts the optimizer steps with at least one read or blocking collective: a GPU's queue
drains once at each, however many reads it holds.

Each side runs in a fresh interpreter (``--worker``), as in scripts/benchmark.py: (a) the hand-written loop, (b)
plain Lightning (scripts/benchmark_lightning.py), (c) ``python -m project fit`` with the default config. With
``--ranks 2`` each side runs as 2 gloo ranks on CPU started by ``torchrun``, and each rank is counted: (a) with its
net in ``DistributedDataParallel`` and its sampler split over the ranks, (b) with ``strategy="ddp"`` on the same
split, (c) with ``--trainer.strategy ddp --trainer.devices 2``. ``--ddp-accelerator gpu`` puts the ranks of (b) and
(c) on a GPU each (NCCL; (a), the hand loop, runs on the CPU only): NCCL refuses two ranks on one GPU, so with one GPU
the 2-rank count is the CPU's. The last line of the output is the table as JSON.
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
from count_syncs_counter import HOST_ONLY, REPO, SyncCounter, rank_file, write_counts  # scripts/count_syncs_counter.py

SIDES = ("hand", "lightning", "template")
DDP_TEMPLATE = ["--trainer.strategy", "ddp"]


def split_over_ranks(world: int, rank: int) -> Any:
    """The benchmark's ``DistributedSampler`` (one replica in its code) over ``world`` ranks: each rank its share."""
    from torch.utils import data

    class Split(data.DistributedSampler):
        def __init__(self, dataset: Any, **kwargs: Any) -> None:
            super().__init__(dataset, **{**kwargs, "num_replicas": world, "rank": rank})

    return unittest.mock.patch.object(data, "DistributedSampler", Split)


def worker(side: str, out: Path, spec: dict[str, Any], template_args: list[str], ddp_accelerator: str = "cpu") -> None:
    sys.path.insert(0, str(REPO / "scripts"))
    if spec.get("fused"):  # every side's AdamW fused, as `torch.optim.AdamW(..., fused=True)` in its code would be
        adamw = torch.optim.AdamW
        torch.optim.AdamW = lambda *args, **kwargs: adamw(*args, **{**kwargs, "fused": True})  # type: ignore[misc]
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))  # set by torchrun
    if side == "hand":
        import benchmark_hand

        from project import nets

        built: list[torch.nn.Module] = []

        class RecordedMLP(nets.MLP):  # the hand loop's net, to tell its training from its validation (eval mode)
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                super().__init__(*args, **kwargs)
                built.append(self)

        def net(*args: Any, **kwargs: Any) -> torch.nn.Module:
            mlp = RecordedMLP(*args, **kwargs)
            return mlp if world == 1 else torch.nn.parallel.DistributedDataParallel(mlp)

        result = out.with_name("hand_result.json")
        lines, first = inspect.getsourcelines(benchmark_hand.hand_written)
        loop = next(first + i for i, line in enumerate(lines) if "enumerate(tqdm(train_loader" in line)
        end = next(first + i for i, line in enumerate(lines) if '"train/loss_epoch"' in line)

        def hand_frame() -> Any:
            frame = sys._getframe(2)
            while frame is not None and frame.f_code is not benchmark_hand.hand_written.__code__:
                frame = frame.f_back
            return frame

        def phase() -> str:  # the batch loop's lines are the steps; after it, the epoch's end; before, the set-up
            frame = hand_frame()
            if frame is None or frame.f_lineno < loop:
                return "set-up"
            return "step" if frame.f_lineno < end else "epoch end"

        def counting() -> bool:  # DDP's start (a broadcast of the weights) is set-up, once
            return bool(built) and built[0].training and phase() != "set-up"

        if world > 1:
            torch.distributed.init_process_group("gloo")
            out, result = rank_file(out, rank), rank_file(result, rank)
            os.chdir(Path.cwd() / f"rank{rank}")  # its own runs/ and checkpoints/
        with unittest.mock.patch.object(nets, "MLP", net), split_over_ranks(world, rank):
            mode = SyncCounter(counting, phase, lambda: getattr(hand_frame(), "f_locals", {}).get("step", -1))
            with mode:
                benchmark_hand.hand_written(spec, result)
        write_counts(out, mode, json.loads(result.read_text())["steps"])
        if world > 1:
            torch.distributed.destroy_process_group()
        return
    counter = {"class_path": "count_syncs_callback.CountSyncs", "init_args": {"out": str(out)}}
    if side == "lightning":
        import benchmark_lightning
        import count_syncs_callback

        trainer_class = benchmark_lightning.L.Trainer
        ddp = {"devices": world, "strategy": "ddp", "accelerator": ddp_accelerator, "use_distributed_sampler": False}

        def with_counter(*args: Any, callbacks: list, **kwargs: Any) -> Any:
            kwargs |= ddp if world > 1 else {}
            return trainer_class(*args, callbacks=[*callbacks, count_syncs_callback.CountSyncs(str(out))], **kwargs)

        with unittest.mock.patch.object(benchmark_lightning.L, "Trainer", with_counter), split_over_ranks(world, rank):
            benchmark_lightning.main(rank_file(out.with_name("timer.json"), rank), spec)
        return
    from project.__main__ import main as cli_main  # python -m project: its base config

    args = ["fit", "--trainer.max_epochs", str(spec["epochs"]), "--run.root", str(out.parent / "runs")]
    args += (
        [*DDP_TEMPLATE, "--trainer.accelerator", ddp_accelerator, "--trainer.devices", str(world)] if world > 1 else []
    )
    cli_main([*args, *template_args, f"--trainer.callbacks+={json.dumps(counter)}"])


def run_side(
    side: str, spec: dict[str, Any], workdir: Path, template_args: list[str], ranks: int, ddp_accelerator: str = "cpu"
) -> dict[str, Any]:
    """One side's counts: ``{"rank0": ..., "rank1": ...}`` with ``ranks`` 2, else the one process's."""
    workdir.mkdir(parents=True)
    for rank in range(ranks if ranks > 1 else 0):
        (workdir / f"rank{rank}").mkdir()
    out = workdir / "syncs.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", side, str(out), json.dumps(spec)]
    if ranks > 1:  # torchrun starts the ranks; each is a worker, told its rank by the environment
        cmd[1:1] = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks)]
    cmd += [f"--template-arg={a}" for a in template_args] + ["--ddp-accelerator", ddp_accelerator]
    path = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p] + [str(REPO), str(REPO / "scripts")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path), "PYTHONWARNINGS": "ignore"}
    with open(workdir / "output.log", "w") as log:
        proc = subprocess.run(cmd, cwd=workdir, env=env, stdout=log, stderr=subprocess.STDOUT)
    outs = [rank_file(out, r) for r in range(ranks)] if ranks > 1 else [out]
    if proc.returncode != 0 or not all(o.is_file() for o in outs):
        tail = (workdir / "output.log").read_text()[-5000:]
        raise SystemExit(f"the {side} run exited {proc.returncode}: {' '.join(cmd)}\n{tail}")
    if ranks == 1:
        return json.loads(out.read_text())
    return {f"rank{r}": json.loads(o.read_text()) for r, o in enumerate(outs)}


def table(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Per optimizer step, by source; the host-only reads apart; the collectives; the steps with a wait."""
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
            "collectives": {s: n / steps for s, n in r["collectives"].items()},  # blocking ones
            "async_collectives_per_step": sum(r["async_collectives"].values()) / steps,
            "waits_per_step": len(r["drain_steps"]) / steps,  # steps with a read or a blocking collective
            "wait_steps": r["drain_steps"],
            # the NaN guard's read of its staged flag (a wait for that copy's event on a GPU) where the host does
            # not wait anyway
            "guard_reads_alone_per_step": len(set(r["host_steps"].get(GUARD, [])) - set(r["drain_steps"])) / steps,
        }
    return rows


LABELS = {"hand": "(a) hand", "lightning": "(b) lightning", "template": "(c) template"}
GUARD = "engine/lightkeep/guards.py (_read_staged)"


def label(column: str) -> str:
    """``(a) hand``, or ``(a) hand r1`` for rank 1 of a DDP run (column ``hand r1``)."""
    side, _, rank = column.partition(" ")
    return f"{LABELS[side]} {rank}".strip()


def print_table(rows: dict[str, Any], spec: dict[str, Any], shape: str) -> None:
    hidden, epochs = spec["hidden_sizes"], spec["epochs"]
    print(f"\nHost-device syncs per optimizer step, training only (MLP {hidden}, {epochs} epochs), {shape}")
    width = max(15, *(len(label(column)) + 2 for column in rows))
    print(f"{'':<42}" + "".join(f"{label(column):>{width}}" for column in rows))

    def line(name: str, values: Any) -> None:
        print(f"{name:<42}" + "".join(f"{v:>{width}}" for v in values))

    for source in sorted({s for r in rows.values() for s in r["by_source"]}):
        line("  " + source, (f"{r['by_source'].get(source, 0):.3f}" for r in rows.values()))
    line("total syncs / step", (f"{r['syncs_per_step']:.3f}" for r in rows.values()))
    line(
        "optimizer steps per sync",
        (f"{r['steps_per_sync']:.1f}" if r["steps_per_sync"] else "never" for r in rows.values()),
    )
    collectives = sorted({s for r in rows.values() for s in r["collectives"]})
    for source in collectives:
        line("  collective: " + source, (f"{r['collectives'].get(source, 0):.3f}" for r in rows.values()))
    if collectives:
        line("blocking collectives / step", (f"{sum(r['collectives'].values()):.3f}" for r in rows.values()))
    line("steps with a wait / step", (f"{r['waits_per_step']:.3f}" for r in rows.values()))
    line("  NaN guard's reads off them / step", (f"{r['guard_reads_alone_per_step']:.3f}" for r in rows.values()))
    cuda = (f"{r['cuda_syncs_per_step']:.3f}" if r["cuda_syncs_per_step"] is not None else "n/a" for r in rows.values())
    line("CUDA syncs / step (debug mode)", cuda)
    line("stalls / step (1st of a burst)", (f"{r['stalls_per_step']:.3f}" for r in rows.values()))
    line("epoch ends, per step (apart)", (f"{r['epoch_end_per_step']:.3f}" for r in rows.values()))
    line("optimizer steps counted", (r["steps"] for r in rows.values()))
    for source in sorted({s for r in rows.values() for s in r["host_only"]}):
        line("  not a sync: " + source[6:], (f"{r['host_only'].get(source, 0):.3f}" for r in rows.values()))
    if any(r["async_collectives_per_step"] for r in rows.values()):
        line("  not waited: async collectives", (f"{r['async_collectives_per_step']:.3f}" for r in rows.values()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=4, help="epochs of each run (default: 4)")
    parser.add_argument("--hidden", type=int, help="width of every hidden layer (default: the config's)")
    parser.add_argument("--sides", default=",".join(SIDES), help="which sides, comma-separated (default: all)")
    parser.add_argument(
        "--ranks", default="1,2", help="1 (one process), 2 (2 gloo ranks on CPU, each counted) or both (default)"
    )
    parser.add_argument(
        "--ddp-accelerator",
        choices=("cpu", "gpu"),
        default="cpu",
        help="where the 2 ranks of plain Lightning and the template run: cpu (gloo, the default) or gpu (NCCL, a GPU "
        "each: needs 2)",
    )
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
        worker(side, Path(out), json.loads(spec), args.template_arg, args.ddp_accelerator)
        return 0
    sys.path.insert(0, str(REPO / "scripts"))
    import benchmark

    spec = benchmark.make_spec(argparse.Namespace(epochs=args.epochs, hidden=args.hidden, batch_size=None))
    spec["fused"] = args.fused
    shapes: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="count-syncs-") as tmp:
        for ranks in map(int, args.ranks.split(",")):
            results = {}
            for side in args.sides.split(","):
                work = Path(tmp) / f"{ranks}" / side
                counted = run_side(side, spec, work, args.template_arg, ranks, args.ddp_accelerator)
                results |= {f"{side} r{k[4:]}": v for k, v in counted.items()} if ranks > 1 else {side: counted}
            shapes[str(ranks)] = table(results)
    for ranks, rows in shapes.items():
        on = "gloo, CPU" if args.ddp_accelerator == "cpu" else "NCCL, a GPU each; the hand loop: gloo, CPU"
        print_table(rows, spec, "1 process" if ranks == "1" else f"{ranks} DDP ranks ({on}), each")
        if args.where:
            for column, row in rows.items():
                print(f"\n{label(column)}: per optimizer step, by the line that read the value or waited")
                for where, n in row["where"].items():
                    print(f"  {n:8.3f}  {where}")
    # "sides": one process, as before; "ranks": each shape run, {"1": {side: row}, "2": {"side rR": row}}
    summary = {"spec": spec, "template_args": args.template_arg, "sides": shapes.get("1", {}), "ranks": shapes}
    summary["ddp_accelerator"] = args.ddp_accelerator
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
