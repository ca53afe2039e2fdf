"""Plot a run's loss, learning rate and accuracy curves from its TensorBoard events into one PNG.

    python scripts/plot_run.py runs/digits/version_0                 # writes runs/digits/version_0/curves.png
    python scripts/plot_run.py runs/digits/version_0 --out fig.png --dpi 300

Needs matplotlib: pip install -e ".[plot]". The x axis is the optimizer step, TensorBoard's; per-epoch values
sit at each epoch's last step. A resumed run's repeated steps keep their latest value.
"""

import argparse
import sys
from pathlib import Path

# (panel title, y label, [(tag, legend label, drawn with markers)]): what Classifier and LearningRateMonitor log.
PANELS = [
    ("Loss", "cross-entropy", [("train/loss", "train (step)", False), ("val/loss", "val (epoch)", True)]),
    ("Learning rate", "lr", [("lr", "lr (step)", False)]),
    ("Accuracy", "accuracy", [("train/acc", "train (epoch)", True), ("val/acc", "val (epoch)", True)]),
]


def load_curves(run_dir: Path) -> dict[str, tuple[list[int], list[float]]]:
    """Every scalar of the run as ``{tag: (steps, values)}``, sorted by step, one value per step."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    if not any(run_dir.glob("events.out.tfevents.*")):
        raise FileNotFoundError(f"no TensorBoard events in {run_dir}; give a run folder like runs/<name>/version_0")
    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})  # 0: keep every point
    acc.Reload()
    curves = {}
    for tag in acc.Tags()["scalars"]:
        by_step = {e.step: e.value for e in sorted(acc.Scalars(tag), key=lambda e: e.wall_time)}
        steps = sorted(by_step)
        curves[tag] = (steps, [by_step[s] for s in steps])
    return curves


def plot(curves: dict[str, tuple[list[int], list[float]]], out: Path, title: str, dpi: int = 150) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(PANELS), figsize=(5 * len(PANELS), 4), constrained_layout=True)
    for ax, (name, ylabel, series) in zip(axes, PANELS, strict=True):
        for tag, label, markers in series:
            if tag in curves:
                steps, values = curves[tag]
                ax.plot(steps, values, marker="o" if markers else None, markersize=3, label=label)
        ax.set(title=name, xlabel="optimizer step", ylabel=ylabel)
        ax.grid(alpha=0.3)
        if ax.has_data():
            ax.legend()
        else:
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes)
    if "val/acc" in curves:
        steps, values = curves["val/acc"]
        best = max(range(len(values)), key=values.__getitem__)
        point, label = (steps[best], values[best]), f"best {values[best]:.4f}"
        # Below the point: the best is usually near the top, where the panel title sits.
        axes[2].annotate(
            label, point, xytext=(0, -45), textcoords="offset points", ha="center", arrowprops={"arrowstyle": "->"}
        )
        title += f"  (best val/acc {values[best]:.4f})"
    fig.suptitle(title)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=dpi)
    plt.close(fig)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", type=Path, help="a run folder holding events.out.tfevents.* files")
    parser.add_argument("--out", type=Path, help="the PNG to write (default: RUN_DIR/curves.png)")
    parser.add_argument("--dpi", type=int, default=150)
    args = parser.parse_args()
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        sys.exit('plot_run.py needs matplotlib: pip install -e ".[plot]"')
    try:
        curves = load_curves(args.run_dir)
    except FileNotFoundError as e:
        sys.exit(str(e))
    out = plot(curves, args.out or args.run_dir / "curves.png", title=str(args.run_dir), dpi=args.dpi)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
