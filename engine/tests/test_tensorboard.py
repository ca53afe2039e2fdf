"""A real TensorBoard server on a finished run, read through its HTTP API as the browser reads it."""

import json
import subprocess
import sys
import time
import urllib.parse
import urllib.request

import pytest
import torch
import yaml

from tests.helpers import QUIET, cli_in_process, free_port, run_dirs
from tests.test_summary import SUMMARY

pytestmark = pytest.mark.slow  # a real fit (the CLI in this process) and a TensorBoard server in a subprocess

EPOCHS, BATCHES = 2, 4
# every step logged (the default logs every 50th: fewer host syncs), as a user wanting per-step curves asks
TINY = [
    *("--trainer.max_epochs", str(EPOCHS), "--trainer.limit_train_batches", str(BATCHES)),
    *("--trainer.log_every_n_steps", "1"),
]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A tiny finished run, and the base URL of a TensorBoard serving its runs/ folder (as `make tensorboard`)."""
    cwd = tmp_path_factory.mktemp("tb")
    cli_in_process(
        "fit", *QUIET, *TINY, "--trainer.limit_val_batches", "2", *SUMMARY, root=cwd / "runs"
    )  # the real CLI, in-process
    (run,) = run_dirs(cwd)
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "tensorboard.main", "--logdir", "runs", "--host", "127.0.0.1", "--port", str(port)],
        cwd=cwd,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    base = f"http://127.0.0.1:{port}"
    name = run.relative_to(cwd / "runs").as_posix()  # TensorBoard's name for the run: blobs/version_0
    try:
        deadline = time.monotonic() + 90
        while True:  # up, and done loading the run's scalars
            try:
                if {"train/loss", "lr", "val/acc"} <= get(base, "/data/plugin/scalars/tags").get(name, {}).keys():
                    break
            except OSError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                server.kill()
                raise AssertionError(f"TensorBoard never served {name}:\n{server.communicate()[1][-3000:]}")
            time.sleep(0.5)
        yield base, name, run
    finally:
        server.terminate()
        server.wait(timeout=30)


def get(base: str, path: str, **query: str):
    url = f"{base}{path}?{urllib.parse.urlencode(query)}" if query else f"{base}{path}"
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.load(response)


def post(base: str, path: str, body: dict):
    request = urllib.request.Request(
        f"{base}{path}", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.load(response)


def scalar_points(base: str, run: str, tag: str) -> list[tuple[int, float]]:
    return [(step, value) for _wall_time, step, value in get(base, "/data/plugin/scalars/scalars", run=run, tag=tag)]


def test_curves_have_one_point_per_step_and_per_epoch(served):
    base, name, run = served
    steps = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["global_step"]
    assert steps == EPOCHS * BATCHES
    for per_step in ("train/loss", "lr"):
        assert [step for step, _ in scalar_points(base, name, per_step)] == list(range(steps))
    val_acc = scalar_points(base, name, "val/acc")
    assert [step for step, _ in val_acc] == [(e + 1) * BATCHES - 1 for e in range(EPOCHS)]  # each epoch's last step
    assert all(0 <= acc <= 1 for _, acc in val_acc)
    lr = [value for _, value in scalar_points(base, name, "lr")]
    assert max(lr) == pytest.approx(yaml.safe_load((run / "config.yaml").read_text())["model"]["init_args"]["lr"])


def test_hparams_view_lists_the_run_with_its_hyperparameters_and_best_score(served):
    base, name, run = served
    experiment = post(base, "/data/plugin/hparams/experiment", {"experimentName": ""})
    assert {"lr", "weight_decay", "warmup", "batch_size", "seed"} <= {h["name"] for h in experiment["hparamInfos"]}
    assert [m["name"]["tag"] for m in experiment["metricInfos"]] == ["best/val/acc"]
    statuses = ["STATUS_UNKNOWN", "STATUS_SUCCESS", "STATUS_FAILURE", "STATUS_RUNNING"]
    query = {"experimentName": "", "allowedStatuses": statuses, "colParams": [], "startIndex": 0, "sliceSize": 10}
    (group,) = post(base, "/data/plugin/hparams/session_groups", query)["sessionGroups"]
    assert group["name"] == name
    config = yaml.safe_load((run / "config.yaml").read_text())  # what the run was given, as the oracle
    model, data = config["model"]["init_args"], config["data"]["init_args"]
    assert group["hparams"]["lr"] == pytest.approx(model["lr"]) and group["hparams"]["warmup"] == model["warmup"]
    assert group["hparams"]["batch_size"] == data["batch_size"]
    (metric,) = group["metricValues"]
    best = max(value for _, value in scalar_points(base, name, "val/acc"))
    assert metric["value"] == pytest.approx(best)
    assert "hp_metric" not in get(base, "/data/plugin/scalars/tags")[name]  # no -1 placeholder curve
