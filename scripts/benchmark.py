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
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
SIDES = ("hand", "lightning", "template")  # (a), (b), (c)
LOSS_RTOL, LOSS_ATOL = 1e-4, 1e-6
TARGET_ACC = 0.97


# ---------------------------------------------------------------------------------------------------------------
# (a) The blog's loop: DataLoader + DistributedSampler, AdamW, warmup-cosine schedule, tqdm, TensorBoard, a full
# training state saved every 2 epochs, validation after each epoch. Plain PyTorch: no Lightning is imported.
# ---------------------------------------------------------------------------------------------------------------


def digits_splits(seed: int, val_fraction: float, test_fraction: float) -> dict[str, tuple[Any, Any]]:
    """The split of ``DigitsDataModule.setup``, written out so that this side never imports Lightning."""
    import torch
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0  # (N, 1, 8, 8)
    labels = torch.tensor(digits.target, dtype=torch.long)  # (N,)
    n = len(labels)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    n_val, n_test = int(n * val_fraction), int(n * test_fraction)
    parts = {"val": order[:n_val], "test": order[n_val : n_val + n_test], "train": order[n_val + n_test :]}
    return {name: (images[idx], labels[idx]) for name, idx in parts.items()}


def digits_loaders(spec: dict[str, Any]) -> tuple[Any, Any]:
    """The blog's train and validation loaders, shared by (a) and (b): the same batches in the same order."""
    import torch
    from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, SequentialSampler, TensorDataset

    class EpochBatchSampler(BatchSampler):
        """Lightning calls ``set_epoch`` on a loader's sampler: this passes it on to the DistributedSampler inside.
        The epoch's order is padded to whole batches with its first indices, as the template pads its order to
        the global batch (so that it is the same on any number of ranks): the same batches on every side."""

        def set_epoch(self, epoch: int) -> None:
            self.sampler.set_epoch(epoch)  # type: ignore[attr-defined]

        def __iter__(self):  # type: ignore[override]
            order = list(self.sampler)
            order += order[: -len(order) % self.batch_size]
            return iter([order[i : i + self.batch_size] for i in range(0, len(order), self.batch_size)])

        def __len__(self) -> int:
            return -(-len(self.sampler) // self.batch_size)  # type: ignore[arg-type]

    splits = digits_splits(spec["data_seed"], spec["val_fraction"], spec["test_fraction"])
    train_set, val_set = TensorDataset(*splits["train"]), TensorDataset(*splits["val"])
    # The blog's DistributedSampler, one replica: the same order as the template's, a pure function of (seed, epoch).
    # The seed is the run's (seed_everything), as the engine's sampler in the template's plain DataLoader takes it
    # (PL_GLOBAL_SEED, project.engine.user_loaders), not the data module's, which seeds the split only.
    sampler = DistributedSampler(train_set, num_replicas=1, rank=0, shuffle=True, seed=spec["seed"])
    # A batch is one indexing op, train_set[list of indices], as in the template. As there too, each loader has a
    # generator of its own, so that its base seed never draws from the global RNG and dropout draws the same masks.
    bs = spec["batch_size"]
    train_batches = EpochBatchSampler(sampler, bs, drop_last=False)
    train_loader = DataLoader(train_set, sampler=train_batches, batch_size=None, generator=torch.Generator())
    val_sampler = BatchSampler(SequentialSampler(val_set), bs, drop_last=False)
    val_loader = DataLoader(val_set, sampler=val_sampler, batch_size=None, generator=torch.Generator())
    return train_loader, val_loader


def hand_written(spec: dict[str, Any], out: Path) -> None:
    import torch
    import torch.nn.functional as F
    from torch.utils.tensorboard import SummaryWriter
    from tqdm import tqdm

    from project.engine.schedule import LinearWarmupCosineAnnealingLR
    from project.nets import MLP

    torch.manual_seed(spec["seed"])
    torch.use_deterministic_algorithms(spec["deterministic"])
    net = MLP(hidden_sizes=spec["hidden_sizes"], dropout=spec["dropout"])
    train_loader, val_loader = digits_loaders(spec)
    n_val = len(val_loader.dataset)
    optimizer = torch.optim.AdamW(net.parameters(), lr=spec["lr"], weight_decay=spec["weight_decay"])
    warmup, total = spec["warmup"] * len(train_loader), spec["epochs"] * len(train_loader)
    scheduler = LinearWarmupCosineAnnealingLR(optimizer, warmup, total, spec["lr"] / max(warmup, 1), spec["eta_min"])
    writer = SummaryWriter("runs")
    os.makedirs("checkpoints")

    step, losses, val_acc, val_s, ckpt_s, first_step_at, step_ends = 0, [], [], 0.0, [], None, []
    start, start_cpu = time.perf_counter(), time.process_time()
    for epoch in range(spec["epochs"]):
        train_loader.sampler.set_epoch(epoch)
        net.train()
        loss_sum, correct, seen = torch.zeros(()), torch.zeros((), dtype=torch.long), 0
        for batch_idx, (x, y) in enumerate(tqdm(train_loader, desc=f"epoch {epoch}")):
            lr = optimizer.param_groups[0]["lr"]
            logits = net(x)  # (B, 10)
            loss = F.cross_entropy(logits, y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            scheduler.step()
            step += 1
            if first_step_at is None:
                first_step_at = time.time()
            losses.append(loss.detach())
            writer.add_scalar("train/loss", loss.item(), step)
            writer.add_scalar("lr", lr, step)
            loss_sum += loss.detach() * len(y)
            correct += (logits.argmax(-1) == y).sum()
            seen += len(y)
            step_ends.append((batch_idx, time.perf_counter()))
        writer.add_scalar("train/loss_epoch", (loss_sum / seen).item(), step)
        writer.add_scalar("train/acc", (correct / seen).item(), step)

        val_start = time.perf_counter()
        net.eval()
        loss_sum, correct = torch.zeros(()), torch.zeros((), dtype=torch.long)
        with torch.no_grad():
            for x, y in tqdm(val_loader, desc="validation", leave=False):
                logits = net(x)
                loss_sum += F.cross_entropy(logits, y, reduction="sum")
                correct += (logits.argmax(-1) == y).sum()
        acc = (correct / n_val).item()
        writer.add_scalar("val/loss", (loss_sum / n_val).item(), step)
        writer.add_scalar("val/acc", acc, step)
        val_acc.append((acc, time.time()))
        val_s += time.perf_counter() - val_start

        if (epoch + 1) % 2 == 0:
            ckpt_start = time.perf_counter()
            state = {
                "net": net.state_dict(),
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "epoch": epoch,
                "step": step,
            }
            torch.save(state, f"checkpoints/epoch{epoch:03d}.pth")
            ckpt_s.append(time.perf_counter() - ckpt_start)
    train_s, train_cpu_s = time.perf_counter() - start, time.process_time() - start_cpu
    writer.close()
    losses = torch.stack(losses).tolist()
    _write_result(out, step, train_s, train_cpu_s, val_s, ckpt_s, first_step_at, losses, val_acc, step_ends)


def _write_result(
    out: Path,
    steps,
    train_s,
    train_cpu_s,
    val_s,
    ckpt_s,
    first_step_at,
    losses,
    val_acc,
    step_ends,
    phases: dict[str, float] | None = None,
) -> None:
    import torch

    # A step's time: from one batch's end to the next's, within an epoch (the first batch of an epoch also holds
    # the previous one's validation and saves, timed apart). Unlike the total, the median is not moved by the few
    # steps that a burst of load from elsewhere on a shared machine slows down.
    step_s = [t - prev for (_, prev), (i, t) in itertools.pairwise(step_ends) if i > 0]

    result = {
        "pid": os.getpid(),
        "phases": phases or {},
        "steps": steps,
        "train_s": train_s,
        "train_cpu_s": train_cpu_s,
        "val_s": val_s,
        "ckpt_s": ckpt_s,
        "first_step_at": first_step_at,
        "losses": losses,
        "val_acc": val_acc,
        "step_s": statistics.median(step_s) if step_s else None,
        "threads": torch.get_num_threads(),
    }
    out.write_text(json.dumps(result))


# ---------------------------------------------------------------------------------------------------------------
# (b) Plain Lightning: scripts/benchmark_lightning.py, in a file of its own so that it reads as what it stands for,
# the Lightning a user writes without the template. It imports digits_loaders and BenchmarkTimer from here.
# ---------------------------------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------------------------------
# (c) The template's side: the real CLI with one more callback, given as benchmark.BenchmarkTimer. Defined only
# when the CLI (or (b), scripts/benchmark_lightning.py) imports this file as a module, so that the hand-written side
# never loads Lightning.
# ---------------------------------------------------------------------------------------------------------------

if __name__ != "__main__":
    import cProfile

    import lightning as L

    class BenchmarkTimer(L.Callback):
        """Benchmark only: times training, validation and each checkpoint save, keeps each step's loss.

        Args:
            out: Where to write the measurements as JSON, at the end of training.
            profile: Run cProfile over the training span and dump its stats next to ``out``.
        """

        def __init__(self, out: str, profile: bool = False) -> None:
            # Start-up phases, as wall-clock times: this callback is built once the command line is parsed and the
            # config read (the template's CLI instantiates it with the Trainer), before any data is touched.
            self.phases = {"built": time.time()}
            self.out, self.profile = Path(out), profile
            self.losses: list[Any] = []
            self.val_acc: list[tuple[float, float]] = []
            self.ckpt_s: list[float] = []
            self.val_s = 0.0
            self.first_step_at: float | None = None
            self.step_ends: list[tuple[int, float]] = []

        def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
            save = trainer.save_checkpoint

            def timed_save(*args: Any, **kwargs: Any) -> None:
                start = time.perf_counter()
                save(*args, **kwargs)
                self.ckpt_s.append(time.perf_counter() - start)

            trainer.save_checkpoint = timed_save  # ModelCheckpoint saves through this attribute
            self.phases["set_up"] = time.time()  # after the strategy's and the data module's setup

        def on_sanity_check_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            self.phases["sanity_start"] = time.time()

        def on_sanity_check_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            self.phases["sanity_end"] = time.time()

        def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            self.profiler = cProfile.Profile() if self.profile else None
            if self.profiler:
                self.profiler.enable()
            self.start, self.start_cpu = time.perf_counter(), time.process_time()
            self.phases["train_start"] = time.time()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # type: ignore[no-untyped-def]
            if self.first_step_at is None:
                self.first_step_at = time.time()
            self.losses.append(outputs["loss"].detach())
            self.step_ends.append((batch_idx, time.perf_counter()))

        def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            self.val_start = time.perf_counter()

        def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            # Runs before the ModelCheckpoints' hook (Lightning moves those last), so saves are not counted here.
            if not trainer.sanity_checking:
                self.val_s += time.perf_counter() - self.val_start
                if "val/acc" in trainer.callback_metrics:
                    self.val_acc.append((float(trainer.callback_metrics["val/acc"]), time.time()))

        def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            train_s, train_cpu_s = time.perf_counter() - self.start, time.process_time() - self.start_cpu
            if self.profiler:
                self.profiler.disable()
                self.profiler.dump_stats(self.out.with_suffix(".prof"))
            import torch

            losses = torch.stack(self.losses).tolist()
            timings = (train_s, train_cpu_s, self.val_s, self.ckpt_s, self.first_step_at)
            _write_result(self.out, trainer.global_step, *timings, losses, self.val_acc, self.step_ends, self.phases)


# ---------------------------------------------------------------------------------------------------------------
# The driver: one spec for all sides, interleaved rounds, checks, table and JSON.
# ---------------------------------------------------------------------------------------------------------------


def make_spec(args: argparse.Namespace) -> dict[str, Any]:
    """What every side runs, from configs/default.yaml over the classes' defaults, with the command line's changes."""
    import yaml

    from project.data import DigitsDataModule
    from project.engine.config import default_config_candidates, find_default_config
    from project.module import Classifier
    from project.nets import MLP

    path = find_default_config() or REPO / "configs" / "default.yaml"
    if not path.is_file():
        looked = ", ".join(dict.fromkeys(map(str, [*default_config_candidates(), path])))
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
        timer = {"class_path": "benchmark.BenchmarkTimer", "init_args": {"out": str(out), "profile": profile}}
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
        from project.engine.host_memory import MMAP_THRESHOLD, TRIM_THRESHOLD

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
        help="give every side the engine's malloc thresholds (project.engine.host_memory) through the environment, "
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
