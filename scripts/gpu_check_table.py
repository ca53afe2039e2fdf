"""scripts/gpu_check.sh's one table: every figure its steps wrote to OUT_DIR, as Markdown, to OUT_DIR/table.md and
stdout. A figure whose step failed or did not run reads "n/a (...)".

    python scripts/gpu_check_table.py OUT_DIR [--cpu] [--tokens N] [--peak-flops F]
"""

import argparse
import json
import sys
from pathlib import Path
from typing import Any

SIDES = (("hand", "(a) hand loop"), ("lightning", "(b) plain Lightning"), ("template", "(c) template"))


def load(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def last_json_line(path: Path) -> Any:
    """The last line of a log that parses as a JSON object (benchmark.py prints its summary last)."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                continue
    return None


def fmt(value: float | None, spec: str = "{:.3f}") -> str:
    return "n/a" if value is None else spec.format(value)


def build(out: Path, cpu: bool, tokens: int, peak_flops: float) -> list[str]:
    rows = ["| figure | value |", "|---|---|"]

    def row(name: str, value: str) -> None:
        rows.append(f"| {name} | {value} |")

    syncs = load(out / "syncs.json")
    for side, label in SIDES:
        r = (syncs or {}).get("sides", {}).get(side)
        row(f"syncs / optimizer step, {label}", fmt(r["syncs_per_step"]) if r else "n/a (see count_syncs.log)")
    for side, label in SIDES:
        r = (syncs or {}).get("sides", {}).get(side)
        row(f"steps with a wait / optimizer step, {label}", fmt(r["waits_per_step"]) if r else "n/a")
    ranks = (syncs or {}).get("ranks", {}).get("2")
    on = "GPUs, NCCL" if (syncs or {}).get("ddp_accelerator") == "gpu" else "CPU, gloo"
    for side, label in SIDES:  # each rank of a 2-rank DDP run; the hand loop's on the CPU
        pair = [(ranks or {}).get(f"{side} r{rank}") for rank in (0, 1)]
        name = f"2 DDP ranks ({'CPU, gloo' if side == 'hand' else on}), rank 0 / rank 1, {label}"
        if not all(pair):
            row(f"syncs / optimizer step, {name}", "n/a (see count_syncs.log)")
            continue
        row(f"syncs / optimizer step, {name}", " / ".join(fmt(r["syncs_per_step"]) for r in pair))
        row(f"blocking collectives / step, {name}", " / ".join(fmt(sum(r["collectives"].values())) for r in pair))
        row(f"steps with a wait / step, {name}", " / ".join(fmt(r["waits_per_step"]) for r in pair))
    for side, label in SIDES:  # CUDA's own count, torch.cuda.set_sync_debug_mode("warn"): none on the CPU
        r = (syncs or {}).get("sides", {}).get(side) or {}
        cuda = r.get("cuda_syncs_per_step")
        row(f"CUDA syncs / optimizer step (sync debug mode), {label}", "n/a (no CUDA)" if cuda is None else fmt(cuda))

    bench = last_json_line(out / "benchmark.log")
    batch = bench["spec"]["batch_size"] if bench else None
    for side, label in SIDES:
        r = (bench or {}).get(side)
        if r:
            row(f"median step time, {label}", f"{1e3 * r['step_s']:.3f} ms")
            row(f"samples / s (training span), {label}", f"{r['steps_per_s'] * batch:.0f}")
        else:
            row(f"step time / samples per s, {label}", "n/a (see benchmark.log)")
    if bench:
        row("benchmark: same losses on every side", str(bench["same_losses"]))

    for mode in ("compile", "eager"):
        switch = "on" if mode == "compile" else "off"
        label = f"transformer (tests.gpu_nets.TinyTransformer, bf16), torch.compile {switch}"
        r = load(out / "transformer" / mode / "rank0.json")
        if not r or not r["steps_per_s"]:
            row(label, "n/a (skipped on CPU)" if cpu and mode == "compile" else f"n/a (see transformer_{mode}.log)")
            continue
        params = r["param_mb"] * 2**20 / 4  # float32 weights
        step_s = 1 / r["steps_per_s"]
        flops = 6 * params * tokens  # per optimizer step
        mfu = "n/a on CPU" if cpu else f"{100 * flops / step_s / peak_flops:.1f} %"
        row(
            label,
            f"{params / 1e6:.1f} M params, {tokens} tokens/step, step {1e3 * step_s:.1f} ms, "
            f"{tokens / step_s:.0f} tokens/s, MFU {mfu}",
        )

    for kind in ("ddp", "sharded"):
        for f in sorted((out / "mem" / kind).glob("rank*.json")):
            r = load(f)
            row(
                f"memory per rank, {kind} rank {r['rank']} ({r['strategy']})",
                f"params {r['param_mb']:.1f} MB, optimizer {r['optimizer_mb']:.1f} MB, peak RSS "
                f"{r['peak_rss_mb']:.0f} MB, peak CUDA {r['peak_cuda_mb']:.0f} MB, {r['steps_per_s']:.2f} steps/s",
            )
        if not any((out / "mem" / kind).glob("rank*.json")):
            row(f"memory per rank, {kind}", f"n/a (see memory_{kind}.log)")

    try:
        exact = [ln for ln in (out / "sharded_exact_resume.log").read_text().splitlines() if ln.startswith("exact")]
    except OSError:
        exact = []
    row("sharded kill + resume", exact[-1].split(":", 1)[1].strip() if exact else "n/a (see sharded_exact_resume.log)")

    try:
        steps = (out / "steps.txt").read_text().splitlines()
    except OSError:
        steps = []
    for line in steps:
        status, _, rest = line.partition("  ")
        row(f"step {rest.split(' ')[0]}", f"{status} {rest.partition(' ')[2]}")
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path, help="gpu_check.sh's OUT_DIR")
    parser.add_argument("--cpu", action="store_true", help="the --cpu run: no MFU")
    parser.add_argument("--tokens", type=int, default=64 * 64, help="transformer tokens per optimizer step")
    parser.add_argument("--peak-flops", type=float, default=989e12, help="the GPU's dense bf16 FLOPS (H200: 989e12)")
    parser.add_argument("--title", default="gpu_check", help="heading of the table")
    args = parser.parse_args(argv)
    text = "\n".join([f"## {args.title}", "", *build(args.out, args.cpu, args.tokens, args.peak_flops)]) + "\n"
    (args.out / "table.md").write_text(text)
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
