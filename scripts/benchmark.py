"""The template against the blog's hand-written loop and plain Lightning: same net, data, batch size, steps, seeds.

    python scripts/benchmark.py                                  # the default config, 3 rounds
    python scripts/benchmark.py --hidden 1024 --epochs 10 --repeats 5 --profile

Every run is a fresh interpreter in a temporary folder of its own: (a) "hand", the blog's loop, written out below
in plain PyTorch; (b) "lightning", the Lightning a user would write without the template
(``scripts/benchmark_lightning.py``); (c) "template", ``python -m project fit`` with the default config and all its
callbacks, plus ``BenchmarkTimer`` (timing only), which times (b) too. Rounds alternate a b c, c b a, a b c, ... and
the ratios c/a and c/b are taken within each round, so load from other processes on a shared machine hits every
side alike. The timed span is training proper, from ``on_train_start`` to ``on_train_end`` (validation and
checkpoints included), and the same span of the hand-written loop; time to the first optimizer step and the total
are counted from the launch of the interpreter.

All sides must take the same number of optimizer steps and, as they see the same batches in the same order and
draw the same dropout masks, reach the same loss at every step; the script exits 1 otherwise. The last line of its
output is the summary as JSON.
"""

import argparse
import ast
import inspect
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmark_hand import digits_splits, hand_written  # scripts/benchmark_hand.py: side (a)
from benchmark_summary import REPO, SIDES, TARGET_ACC, print_profile, print_table, summarize

# (b) plain Lightning is scripts/benchmark_lightning.py, the Lightning a user writes without the template; (c) the
# template is the real CLI with one more callback, benchmark_timer.BenchmarkTimer (scripts/benchmark_timer.py).


def make_spec(args: argparse.Namespace) -> dict[str, Any]:
    """What every side runs, from configs/default.yaml over the classes' defaults, with the command line's changes."""
    import yaml

    from project.__main__ import BASE_CONFIGS
    from project.data import DigitsDataModule
    from project.module import Classifier
    from project.nets import MLP

    path = next((p for p in BASE_CONFIGS if p.is_file()), BASE_CONFIGS[0])
    if not path.is_file():
        looked = ", ".join(dict.fromkeys(map(str, BASE_CONFIGS)))
        raise SystemExit(f"error: no configs/default.yaml at {looked}: run this from the project folder")
    args.config = path
    config = yaml.safe_load(path.read_text())
    expected = {"model": Classifier, "data": DigitsDataModule}
    for key, cls in expected.items():
        if isinstance(config[key], str):  # the class alone (`model: project.module.Classifier`): its own defaults
            config[key] = {"class_path": config[key]}
        if config[key]["class_path"] != f"{cls.__module__}.{cls.__name__}":
            raise SystemExit(f"the hand-written side only knows {cls.__name__} as {key}: {path} changed it")
    config["model"].setdefault("init_args", {}).setdefault("net", {"class_path": "project.nets.MLP"})
    if config["model"]["init_args"]["net"]["class_path"] != "project.nets.MLP":
        raise SystemExit(f"the hand-written side only knows project.nets.MLP as the net: {path} changed it")

    def init_args(section: dict[str, Any], cls: type) -> dict[str, Any]:
        defaults = {k: p.default for k, p in inspect.signature(cls).parameters.items() if p.default is not p.empty}
        return {**defaults, **section.get("init_args", {})}

    model, data = init_args(config["model"], Classifier), init_args(config["data"], DigitsDataModule)
    net = init_args(config["model"]["init_args"]["net"], MLP)
    trainer = config.get("trainer", {})
    unsupported = {"interval": "step", "schedule_unit": "epoch", "max_schedule": None, "warmup_start_lr": None}
    for key, value in unsupported.items():
        if model[key] != value:
            raise SystemExit(f"the hand-written side supports model.{key}={value} only, the config has {model[key]}")
    seed = config.get("seed_everything")
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise SystemExit(f"seed_everything must be a fixed integer for the sides to match, not {seed!r}")
    hidden_sizes = list(net["hidden_sizes"])
    return {
        "seed": seed,
        "deterministic": bool(trainer.get("deterministic", False)),
        "epochs": args.epochs or trainer.get("max_epochs", 1000),
        "hidden_sizes": [args.hidden] * len(hidden_sizes) if args.hidden else hidden_sizes,
        "dropout": net["dropout"],
        "batch_size": args.batch_size or data["batch_size"],
        "data_seed": data["seed"],
        "val_fraction": data["val_fraction"],
        "test_fraction": data["test_fraction"],
        "lr": model["lr"],
        "weight_decay": model["weight_decay"],
        "warmup": min(model["warmup"], args.epochs or trainer.get("max_epochs", 1000)),
        "eta_min": model["eta_min"],
    }


def check_same_data(spec: dict[str, Any]) -> None:
    from project.data import DigitsDataModule

    dm = DigitsDataModule(spec["batch_size"], spec["val_fraction"], spec["test_fraction"], seed=spec["data_seed"])
    dm.setup("fit")
    mine = digits_splits(spec["data_seed"], spec["val_fraction"], spec["test_fraction"])
    for name, (x, y) in mine.items():
        theirs = dm.splits[name].tensors
        if not (x.equal(theirs[0]) and y.equal(theirs[1])):
            raise SystemExit(f"digits_splits() no longer matches DigitsDataModule.setup() on the {name} split")


def run_side(side: str, spec: dict[str, Any], workdir: Path, args: argparse.Namespace, profile: bool = False):
    workdir.mkdir(parents=True)
    out = workdir / "result.json"
    if side == "hand":
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", str(out), "--spec", json.dumps(spec)]
    elif side == "lightning":
        cmd = [sys.executable, str(Path(__file__).resolve().with_name("benchmark_lightning.py")), str(out)]
        cmd += [json.dumps(spec)]
    else:
        timer = {"class_path": "benchmark_timer.BenchmarkTimer", "init_args": {"out": str(out), "profile": profile}}
        # the config the spec came from: the run's folder is not the project's, where `project` finds it itself
        cmd = [sys.executable, "-m", "project", "fit", "--config", str(args.config)]
        cmd += ["--trainer.max_epochs", str(spec["epochs"])]
        cmd += ["--model.net.init_args.hidden_sizes", json.dumps(spec["hidden_sizes"])]
        cmd += ["--data.batch_size", str(spec["batch_size"]), "--model.init_args.warmup", str(spec["warmup"])]
        cmd += [*args.template_arg, f"--trainer.callbacks+={json.dumps(timer)}"]  # after them: never dropped
    if args.cpus:
        cmd = ["taskset", "-c", args.cpus, *cmd]
    # A PYTHONPATH given to this script comes first (e.g. a patched copy of project/), then this repository.
    path = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    path += [str(REPO), str(REPO / "scripts")]
    threads = str(args.threads)
    env = {**os.environ, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}
    if args.same_malloc:
        from lightkeep.speed.host_memory import MMAP_THRESHOLD, TRIM_THRESHOLD

        env.update(MALLOC_MMAP_THRESHOLD_=str(MMAP_THRESHOLD), MALLOC_TRIM_THRESHOLD_=str(TRIM_THRESHOLD))
    imported = workdir / "lightning_imported"
    if side != "hand":
        # Importing Lightning is the floor of any Lightning program's start-up: timed in the run's own process (a
        # sitecustomize, which Python imports at start), not in a separate one, whose page cache and load differ.
        (workdir / "preload").mkdir()
        (workdir / "preload" / "sitecustomize.py").write_text(PRELOAD)
        path.insert(0, str(workdir / "preload"))
        env["BENCHMARK_IMPORTED"] = str(imported)
    env["PYTHONPATH"] = os.pathsep.join(path)
    with open(workdir / "output.log", "w") as log:
        launched = time.time()
        proc = subprocess.run(cmd, cwd=workdir, env=env, stdout=log, stderr=subprocess.STDOUT)
        total_s = time.time() - launched
    if proc.returncode != 0 or not out.is_file():
        output = (workdir / "output.log").read_text()[-5000:]
        raise SystemExit(f"the {side} run exited {proc.returncode}: {' '.join(cmd)}\n{output}")
    result = json.loads(out.read_text())
    result["total_s"] = total_s
    result["first_step_s"] = result.pop("first_step_at") - launched
    result["phases_s"] = {phase: at - launched for phase, at in result.pop("phases").items()}
    if imported.is_file():
        at, pid = ast.literal_eval(imported.read_text())
        if pid != result["pid"]:
            raise SystemExit(
                f"the {side} run's Lightning import was timed in another process ({pid}, not {result['pid']})"
            )
        result["phases_s"]["imported"] = at - launched
    reached = [at for acc, at in result["val_acc"] if acc >= TARGET_ACC]
    result["time_to_target_s"] = reached[0] - launched if reached else None
    result["final_val_acc"] = result["val_acc"][-1][0] if result["val_acc"] else None
    result["profile"] = str(out.with_suffix(".prof")) if profile else None
    return result


PRELOAD = """# written by scripts/benchmark.py: the run imports Lightning first and notes when that was done
import os, time
path = os.environ.pop("BENCHMARK_IMPORTED", None)  # not in the processes it starts (jsonargparse starts one)
if path:
    import lightning  # noqa: F401
    with open(path, "w") as f:
        f.write(repr((time.time(), os.getpid())))
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, help="width of every hidden layer (default: the config's)")
    parser.add_argument("--batch-size", type=int, help="samples per batch (default: the config's)")
    parser.add_argument("--epochs", type=int, help="epochs of each run (default: the config's max_epochs)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds of one run per side (default: 3)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads on every side (default: 1)")
    parser.add_argument("--cpus", help="pin every side to these CPUs with taskset, e.g. 1 or 0-1")
    parser.add_argument("--profile", action="store_true", help="one more template run, under cProfile")
    parser.add_argument(
        "--same-malloc",
        action="store_true",
        help="give every side the engine's malloc thresholds (lightkeep.speed.host_memory) through the environment, "
        "to compare the rest: by default only the template sets them",
    )
    parser.add_argument(
        "--template-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra argument to the template's CLI, repeatable (e.g. --template-arg=--config=my.yaml); a change "
        "the hand-written side does not share shows up as different losses",
    )
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--spec", type=json.loads, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        hand_written(args.spec, args.worker)
        return 0
    if args.repeats < 1:
        parser.error(f"--repeats ({args.repeats}) must be >= 1")

    spec = make_spec(args)
    check_same_data(spec)
    runs: dict[str, list[dict[str, Any]]] = {side: [] for side in SIDES}
    with tempfile.TemporaryDirectory(prefix="benchmark-") as tmp:
        for i in range(args.repeats):
            for side in SIDES if i % 2 == 0 else SIDES[::-1]:
                runs[side].append(run_side(side, spec, Path(tmp) / f"{i}-{side}", args))
                print(f"round {i + 1}/{args.repeats} {side}: {runs[side][-1]['train_s']:.3f} s", file=sys.stderr)
        summary = summarize(runs, spec)
        print_table(summary)
        if args.profile:
            profiled = run_side("template", spec, Path(tmp) / "profile", args, profile=True)
            print_profile(profiled["profile"], summary["template"]["train_s"], top=15)
    print(json.dumps(summary))
    return 0 if summary["same_steps"] and summary["same_losses"] and summary["same_threads"] else 1


if __name__ == "__main__":
    sys.exit(main())
