"""How long a checkpoint save blocks training, synchronous against background writes (``AtomicCheckpointIO``).

    python scripts/benchmark_checkpoint.py                        # stalls at ~1 MB and ~100 MB, then the fit
    python scripts/benchmark_checkpoint.py --gb --repeats 5       # also ~1 GB (needs ~3 GB of free memory)
    python scripts/benchmark_checkpoint.py --no-fit               # stalls only
    python scripts/benchmark_checkpoint.py --no-stall --checkouts . ../old   # the fit, two checkouts side by side

1. **Stall per save.** A stack of square ``nn.Linear`` layers with its AdamW state (weights + 2 moments: the
   checkpoint is 3x the weights) is saved through the template's checkpoint IO, synchronous (write, fsync, rename
   while the loop waits) and in the background (the loop waits for the copy to host memory only), alternating
   sync/async in pairs. Between saves one optimizer step changes every tensor, so each background save copies the
   whole state again; the background write is then waited for, untimed, so that each save starts with the writer
   idle, as saves minutes apart do. The first save of each kind (allocating the host buffers) is not timed.
2. **A short fit** of the MLP with hidden sizes 4096 x3 (~400 MB checkpoint) on the digits, with the default
   checkpoint policy against ``--trainer.enable_checkpointing false``, in alternating fresh processes; the time
   is the in-process ``fit`` call (data setup to the end of teardown, which waits for the last writes), not the
   interpreter's start.

Both run on ``--threads`` torch threads (1 by default, as ``scripts/benchmark.py``). ``--checkouts A B ...`` runs
the fits of each checkout (another commit's ``git worktree``) with this script, their pairs interleaved round by
round, so that the machine's load hits every checkout alike; the figures are printed side by side.

Medians of the per-pair ratios; the machine is shared, so only paired, interleaved numbers are compared. The last
line is the summary as JSON.
"""

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SIZES_MB = {"1 MB": 1, "100 MB": 100, "1 GB": 1000}
FIT_ARGS = ["--model.net.init_args.hidden_sizes", "[4096, 4096, 4096]", "--trainer.enable_progress_bar", "false",
            "--trainer.enable_model_summary", "false", "--trainer.logger", "false"]  # fmt: skip


def stall_pairs(megabytes: float, repeats: int, folder: Path) -> dict:
    import torch

    from lightkeep.checkpoint_io import AtomicCheckpointIO

    width = int((megabytes * 1e6 / (4 * 3 * 4)) ** 0.5)  # 4 layers of width^2 float32 weights, 3 copies each
    torch.manual_seed(0)
    net = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(4)])
    optimizer = torch.optim.AdamW(net.parameters())

    def step(i: int) -> dict:
        for p in net.parameters():
            p.grad = torch.full_like(p, 1e-3 * (i + 1))
        optimizer.step()  # every weight and moment changes: nothing of the previous copy can be reused
        loops = {"fit_loop": {"batches": i}}
        return {"state_dict": net.state_dict(), "optimizer_states": [optimizer.state_dict()], "global_step": i,
                "epoch": 0, "loops": loops}  # fmt: skip

    sync, background = AtomicCheckpointIO(background=False), AtomicCheckpointIO(background=True)
    sync.save_checkpoint(step(0), folder / "sync.ckpt")
    background.save_checkpoint(step(1), folder / "async.ckpt")
    background.wait()
    size = (folder / "sync.ckpt").stat().st_size
    pairs, i = [], 2
    for r in range(repeats):
        timed = {}
        for name in ("sync", "async") if r % 2 == 0 else ("async", "sync"):
            checkpoint, i = step(i), i + 1
            start = time.perf_counter()
            (sync if name == "sync" else background).save_checkpoint(checkpoint, folder / f"{name}.ckpt")
            timed[name] = time.perf_counter() - start
            start = time.perf_counter()
            background.wait()
            timed[f"{name}_write"] = time.perf_counter() - start
        pairs.append(timed)
    background.teardown()
    return {
        "bytes": size,
        "sync_s": statistics.median(p["sync"] for p in pairs),
        "async_s": statistics.median(p["async"] for p in pairs),
        "async_write_after_s": statistics.median(p["async_write"] for p in pairs),
        "ratio": statistics.median(p["async"] / p["sync"] for p in pairs),
        "ratios": [round(p["async"] / p["sync"], 4) for p in pairs],
    }


def fit_once(args: list[str], out: Path) -> None:
    """Worker: one in-process fit, its duration written to ``out``."""
    import project.__main__ as entry  # python -m project: its base config

    cli_main = getattr(entry, "main", None) or entry.cli_main  # a checkout from before the engine was lightkeep

    start, cpu, faults = time.perf_counter(), time.process_time(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    cli = cli_main(["fit", *args])
    took = {"fit_s": time.perf_counter() - start, "cpu_s": time.process_time() - cpu, "steps": cli.trainer.global_step}
    took["page_faults"] = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    out.write_text(json.dumps(took))


def fit_pairs(repeats: int, epochs: int, threads: int, folder: Path, checkouts: list[Path]) -> dict:
    """Per checkout: ``repeats`` pairs (default checkpoints, checkpointing off), each side a fresh process; round
    ``r`` runs every checkout's pair, the order of the sides and of the checkouts reversed every other round."""
    sides = {"default": [], "off": ["--trainer.enable_checkpointing", "false"]}
    runs: dict[Path, dict[str, list[dict]]] = {c: {side: [] for side in sides} for c in checkouts}
    for r in range(repeats):
        order = [(c, side) for c in checkouts for side in (sides if r % 2 == 0 else list(sides)[::-1])]
        for checkout, side in order if r % 2 == 0 else order[::-1]:
            # the checkout's own engine, not the one installed (a worktree of a commit since the engine's move)
            paths = [str(checkout), *([str(checkout / "engine")] if (checkout / "engine").is_dir() else [])]
            env = {**os.environ, "PYTHONPATH": os.pathsep.join([*paths, os.environ.get("PYTHONPATH", "")]),
                   "OMP_NUM_THREADS": str(threads), "PYTHONWARNINGS": "ignore"}  # fmt: skip
            work = folder / f"{r}-{checkouts.index(checkout)}-{side}"
            work.mkdir()
            args = [*FIT_ARGS, "--trainer.max_epochs", str(epochs), "--run.root", str(work / "runs"), *sides[side]]
            cmd = [sys.executable, __file__, "--fit-worker", str(work / "result.json"), "--", *args]
            proc = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True)
            if proc.returncode != 0:
                raise SystemExit(f"the {side} fit of {checkout} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
            runs[checkout][side].append(json.loads((work / "result.json").read_text()))
            files = list(work.rglob("*.ckpt"))
            on_disk = sum({p.stat().st_ino: p.stat().st_size for p in files}.values()) / 1e6  # links once
            took = runs[checkout][side][-1]
            print(f"fit {r + 1}/{repeats} {checkout.name} {side}: {took['fit_s']:.2f} s (CPU {took['cpu_s']:.2f} s, "
                  f"{took['page_faults']} page faults), {len(files)} files kept, "
                  f"{on_disk:.0f} MB on disk, load {os.getloadavg()[0]:.2f}", file=sys.stderr)  # fmt: skip
    out = {}
    for checkout, sided in runs.items():
        ratios = [d["fit_s"] / o["fit_s"] for d, o in zip(sided["default"], sided["off"], strict=True)]
        out[str(checkout)] = {
            "default_s": statistics.median(r["fit_s"] for r in sided["default"]),
            "off_s": statistics.median(r["fit_s"] for r in sided["off"]),
            "cpu_overhead_s": statistics.median(
                d["cpu_s"] - o["cpu_s"] for d, o in zip(sided["default"], sided["off"], strict=True)
            ),
            "steps": sided["default"][0]["steps"],
            "ratio": statistics.median(ratios),
            "ratios": [round(x, 4) for x in ratios],
        }
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5, help="pairs per measurement (default: 5)")
    parser.add_argument("--gb", action="store_true", help="also the ~1 GB checkpoint (~3 GB of memory)")
    parser.add_argument("--no-fit", action="store_true", help="stalls only, no fit")
    parser.add_argument("--no-stall", action="store_true", help="the fit only, no stalls")
    parser.add_argument("--checkouts", type=Path, nargs="+", default=[REPO], help="the fits of each (default: this)")
    parser.add_argument("--fit-repeats", type=int, default=3, help="paired fits (default: 3)")
    parser.add_argument("--epochs", type=int, default=3, help="epochs of each fit (default: 3)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads, stalls and fits (default: 1)")
    parser.add_argument("--dir", type=Path, default=Path("runs"), help="where the files go (default: runs)")
    parser.add_argument("--fit-worker", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("rest", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.fit_worker:
        fit_once(args.rest, args.fit_worker)
        return 0
    import torch

    # On a shared 2-core machine a 2-thread copy waits for the busy core: 6x slower than one thread here.
    torch.set_num_threads(args.threads)
    summary: dict = {"threads": args.threads, "stall": {}}
    args.dir = args.dir.resolve()  # the fits run in folders of their own
    args.dir.mkdir(parents=True, exist_ok=True)  # the disk runs go to (a tmpfs /tmp would make fsync free)
    with tempfile.TemporaryDirectory(prefix="benchmark-checkpoint-", dir=args.dir) as tmp:
        sizes = [s for s in SIZES_MB if (args.gb or s != "1 GB") and not args.no_stall]
        if sizes:
            print(f"{'checkpoint':>10} {'MB':>7} {'sync stall s':>13} {'async stall s':>14} {'async/sync':>11}")
        for label in sizes:
            row = summary["stall"][label] = stall_pairs(SIZES_MB[label], args.repeats, Path(tmp))
            print(f"{label:>10} {row['bytes'] / 1e6:7.1f} {row['sync_s']:13.4f} {row['async_s']:14.4f} "
                  f"{row['ratio']:11.3f}  (write after: {row['async_write_after_s']:.3f} s)")  # fmt: skip
        if not args.no_fit:
            checkouts = [c.resolve() for c in args.checkouts]
            summary["fit"] = fit_pairs(args.fit_repeats, args.epochs, args.threads, Path(tmp), checkouts)
            for checkout, fit in summary["fit"].items():
                print(
                    f"fit of {checkout}, MLP 4096 x3, {fit['steps']} steps: default checkpoints "
                    f"{fit['default_s']:.2f} s, checkpointing off {fit['off_s']:.2f} s, ratio {fit['ratio']:.3f} "
                    f"(pairs {fit['ratios']}); CPU time of the checkpoints {fit['cpu_overhead_s']:.2f} s"
                )
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
