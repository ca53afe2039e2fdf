"""The comparison of scripts/benchmark.py's three sides: per-side medians, within-round ratios, the check that
every side took the same steps to the same losses, and the printed table, start-up phases and profile.
"""

import statistics
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
SIDES = ("hand", "lightning", "template")  # (a), (b), (c)
LOSS_RTOL, LOSS_ATOL = 1e-4, 1e-6
TARGET_ACC = 0.97


# Start-up phases the timer records, in order: (key, what happened by then)
PHASES = (
    ("imported", "import lightning done (in the run's process)"),
    ("built", "command line parsed, config read, objects built"),
    ("set_up", "strategy, data and model set up"),
    ("sanity_end", "sanity-check validation done"),
    ("train_start", "training loop started"),
)


def side_summary(runs: list[dict[str, Any]], epochs: int) -> dict[str, Any]:
    def med(key: str) -> float:
        return statistics.median(r[key] for r in runs)

    saves = [s for r in runs for s in r["ckpt_s"]]
    epoch_s = med("train_s") / epochs
    save_s = statistics.median(saves) if saves else 0.0
    to_target = [r["time_to_target_s"] for r in runs if r["time_to_target_s"] is not None]
    return {
        "steps": runs[0]["steps"],
        "steps_per_s": statistics.median(r["steps"] / r["train_s"] for r in runs),
        "train_s": med("train_s"),
        "train_cpu_s": med("train_cpu_s"),
        "step_s": med("step_s"),
        "val_s": med("val_s"),
        "ckpt_s": statistics.median(sum(r["ckpt_s"]) for r in runs),
        "saves_per_epoch": len(runs[0]["ckpt_s"]) / epochs,
        "save_s": save_s,
        "save_over_epoch": save_s / epoch_s,
        "first_step_s": med("first_step_s"),
        "phases_s": {
            key: statistics.median(r["phases_s"][key] for r in runs)
            for key, _ in PHASES
            if all(key in r.get("phases_s", {}) for r in runs)
        },
        "own_startup_s": spread([r["first_step_s"] - r["phases_s"]["imported"] for r in runs])
        if all("imported" in r["phases_s"] for r in runs)
        else None,
        "total_s": med("total_s"),
        "time_to_target_s": statistics.median(to_target) if len(to_target) == len(runs) else None,
        "final_val_acc": runs[0]["final_val_acc"],
        "threads": runs[0]["threads"],
    }


def spread(values: list[float]) -> dict[str, Any]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "pairs": values}


def summarize(runs: dict[str, list[dict[str, Any]]], spec: dict[str, Any]) -> dict[str, Any]:
    rounds = [dict(zip(SIDES, r, strict=True)) for r in zip(*(runs[side] for side in SIDES), strict=True)]

    def ratio(key: str, base: str) -> dict[str, Any]:  # template / base, within each round
        return spread([r["template"][key] / r[base][key] for r in rounds])

    def extra_us(base: str, key: str, per: str | None = None) -> dict[str, Any]:  # template - base, in us
        return spread([1e6 * (r["template"][key] - r[base][key]) / (r["template"][per] if per else 1) for r in rounds])

    def loss_diffs(side: str) -> tuple[float, float]:
        """Beyond the tolerance, and absolute: ``side``'s losses against the hand-written loop's, the oracle."""
        pairs = [(a, b) for r in rounds for a, b in zip(r["hand"]["losses"], r[side]["losses"], strict=False)]
        beyond = max((abs(a - b) - LOSS_RTOL * abs(a) for a, b in pairs), default=0.0)
        return beyond, max((abs(a - b) for a, b in pairs), default=0.0)

    same_steps = all(len({n for s in r.values() for n in (s["steps"], len(s["losses"]))}) == 1 for r in rounds)
    diffs = {side: loss_diffs(side) for side in SIDES[1:]}
    return {
        "spec": spec,
        **{side: side_summary(runs[side], spec["epochs"]) for side in SIDES},
        "ratio": ratio("train_s", "hand"),
        "cpu_ratio": ratio("train_cpu_s", "hand"),
        "ratio_vs_lightning": ratio("train_s", "lightning"),
        "cpu_ratio_vs_lightning": ratio("train_cpu_s", "lightning"),
        "extra_us_per_step": {f"vs_{base}": extra_us(base, "train_s", per="steps") for base in ("hand", "lightning")},
        "step_ratio": ratio("step_s", "hand"),
        "step_ratio_vs_lightning": ratio("step_s", "lightning"),
        "extra_us_per_median_step": {f"vs_{base}": extra_us(base, "step_s") for base in ("hand", "lightning")},
        "same_steps": same_steps,
        "same_threads": all(len({s["threads"] for s in r.values()}) == 1 for r in rounds),
        "max_loss_abs_diff": max(d[1] for d in diffs.values()),
        "loss_abs_diff_vs_hand": {side: d[1] for side, d in diffs.items()},
        "same_losses": same_steps and all(d[0] <= LOSS_ATOL for d in diffs.values()),
    }


def print_table(s: dict[str, Any]) -> None:
    h, b, t, spec = s["hand"], s["lightning"], s["template"], s["spec"]

    def row(label: str, *cells: float | None, fmt: str = "{:.3f}", ratio: bool = True) -> None:
        shown = [fmt.format(v) if v is not None else "-" for v in cells]
        ratios = [f"{cells[2] / base:.3f}" if ratio and base and cells[2] is not None else "" for base in cells[:2]]
        print(f"{label:<34}" + "".join(f"{c:>15}" for c in shown) + "".join(f"{r:>9}" for r in ratios))

    print(
        f"\nMLP {spec['hidden_sizes']}, batch {spec['batch_size']}, {spec['epochs']} epochs, "
        f"{h['steps']} optimizer steps, {h['threads']} thread(s), {len(s['ratio']['pairs'])} round(s)"
    )
    print(f"{'(medians)':<34}{'(a) hand':>15}{'(b) lightning':>15}{'(c) template':>15}{'c / a':>9}{'c / b':>9}")
    row("steps/s over the training span", h["steps_per_s"], b["steps_per_s"], t["steps_per_s"], fmt="{:.1f}")
    for label, key in (
        ("training span s", "train_s"),
        ("training span, CPU time s", "train_cpu_s"),
        ("  one step (median) s", "step_s"),
        ("  of which validation s", "val_s"),
        ("  of which checkpoint saves s", "ckpt_s"),
    ):
        row(label, h[key], b[key], t[key])
    row("checkpoint saves per epoch", h["saves_per_epoch"], b["saves_per_epoch"], t["saves_per_epoch"], ratio=False)
    row("one save ms", h["save_s"] * 1e3, b["save_s"] * 1e3, t["save_s"] * 1e3, fmt="{:.2f}")
    pct = [x["save_over_epoch"] * 100 for x in (h, b, t)]
    row("one save / one epoch %", *pct, fmt="{:.1f}", ratio=False)
    row("launch to first optimizer step s", h["first_step_s"], b["first_step_s"], t["first_step_s"], fmt="{:.2f}")
    to_target = (h["time_to_target_s"], b["time_to_target_s"], t["time_to_target_s"])
    row(f"launch to val/acc >= {TARGET_ACC} s", *to_target, fmt="{:.2f}")
    row("launch to exit s", h["total_s"], b["total_s"], t["total_s"], fmt="{:.2f}")
    row("final val/acc", h["final_val_acc"], b["final_val_acc"], t["final_val_acc"], fmt="{:.4f}", ratio=False)
    print()
    for key, what in (
        ("ratio", "template / hand-written, training span, wall time"),
        ("cpu_ratio", "template / hand-written, training span, CPU time"),
        ("ratio_vs_lightning", "template / plain Lightning, training span, wall time"),
        ("cpu_ratio_vs_lightning", "template / plain Lightning, training span, CPU time"),
    ):
        r = s[key]
        pairs = ", ".join(f"{x:.3f}" for x in r["pairs"])
        print(f"{what}: median {r['median']:.3f} (min {r['min']:.3f}, max {r['max']:.3f}; rounds {pairs})")
    for base, what in (("vs_hand", "the hand-written loop"), ("vs_lightning", "plain Lightning")):
        r = s["extra_us_per_step"][base]
        print(
            f"template's extra wall time per optimizer step over {what}: median {r['median']:.0f} us "
            f"(min {r['min']:.0f}, max {r['max']:.0f})"
        )
    for key, base, what in (
        ("step_ratio", "vs_hand", "hand-written"),
        ("step_ratio_vs_lightning", "vs_lightning", "plain Lightning"),
    ):
        r, us = s[key], s["extra_us_per_median_step"][base]
        pairs = ", ".join(f"{x:.3f}" for x in r["pairs"])
        print(
            f"template / {what}, median step (validation and epoch-end saves apart): median {r['median']:.3f} "
            f"(min {r['min']:.3f}, max {r['max']:.3f}; rounds {pairs}); {us['median']:+.0f} us a step"
        )
    print_startup(s)
    diffs = ", ".join(f"{side} {d:.2e}" for side, d in s["loss_abs_diff_vs_hand"].items())
    print(
        f"same optimizer steps: {s['same_steps']}; same loss at every step: {s['same_losses']} "
        f"(max |difference| from the hand-written loop's: {diffs}); same threads: {s['same_threads']}"
    )


def print_startup(s: dict[str, Any]) -> None:
    """Launch to first optimizer step of (b) and (c), phase by phase, from importing Lightning on."""
    b, t = s["lightning"], s["template"]
    print(f"\nStart-up, s after launch (medians){'(b) lightning':>22}{'(c) template':>15}{'c - b':>9}")
    for key, what in PHASES:
        if key in b["phases_s"] and key in t["phases_s"]:
            pb, pt = b["phases_s"][key], t["phases_s"][key]
            print(f"{'  ' + what:<49}{pb:>15.2f}{pt:>15.2f}{pt - pb:>+9.2f}")
    pb, pt = b["first_step_s"], t["first_step_s"]
    print(f"{'  first optimizer step done':<49}{pb:>15.2f}{pt:>15.2f}{pt - pb:>+9.2f}")
    own_b, own_t = b["own_startup_s"], t["own_startup_s"]
    print(
        f"own start-up (first step - import lightning done, in each run's process; median, range): template "
        f"{own_t['median']:.2f} s ({own_t['min']:.2f}-{own_t['max']:.2f}), plain Lightning {own_b['median']:.2f} s "
        f"({own_b['min']:.2f}-{own_b['max']:.2f})"
    )


def print_profile(path: str, train_s: float, top: int) -> None:
    """Self time of the profiled training span, by package (torch's C++ ops apart) and by function."""
    import pstats

    stats = pstats.Stats(path).stats  # type: ignore[attr-defined]
    groups: dict[str, float] = {}
    total = 0.0
    for (filename, _, name), (_, _, tottime, _, _) in stats.items():
        total += tottime
        if filename == "~":
            group = "torch C++ ops" if "torch" in name or "_C." in name else "Python builtins"
        else:
            parts = Path(filename).parts
            if "site-packages" in parts:
                parts = parts[parts.index("site-packages") + 1 :]
                depth = {"lightning": 3, "torch": 2}.get(parts[0], 1)
                group = "/".join(p.removesuffix(".py") for p in parts[:depth])
            elif str(REPO) in filename:
                group = "/".join(Path(filename).relative_to(REPO).parts[:1])
            else:
                group = "stdlib"
        groups[group] = groups.get(group, 0.0) + tottime
    print(f"\nProfile of one template run's training span ({train_s:.2f} s unprofiled; {total:.2f} s under cProfile)")
    print("self time by package:")
    for group, seconds in sorted(groups.items(), key=lambda kv: -kv[1])[:top]:
        print(f"  {100 * seconds / total:5.1f}%  {seconds:7.3f} s  {group}")
    print("functions by self time:")
    ranked = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    for (filename, line, name), (_, calls, tottime, _, _) in ranked:
        where = name if filename == "~" else f"{name}  {Path(filename).name}:{line}"
        print(f"  {100 * tottime / total:5.1f}%  {tottime:7.3f} s  {calls:>8} calls  {where}")
