"""Background checkpoint writes lose nothing: a file holds the state of its save, a write in flight is never what
``--ckpt_path last`` picks, removals wait for their writes, and every write is finished before fit returns or
raises, before a preemption exit; a kill during a write resumes from the previous complete file, bit-exact."""

import random
import signal
import threading

import pytest
import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO

from lightkeep.checkpoint_io import AtomicCheckpointIO
from lightkeep.host_snapshot import HostSnapshot
from lightkeep.run_checkpoints import find_last_checkpoint
from tests.faults import kill_at
from tests.helpers import QUIET, RUN_NAME, cli, cli_in_process

# 3 epochs of 6 steps; last.ckpt every 4 optimizer steps besides the default writers (epoch ends): 4, 6, 8, 12, ...
EVERY_4 = ["--trainer.callbacks+=ModelCheckpoint", "--trainer.callbacks.every_n_train_steps=4",
           "--trainer.callbacks.save_top_k=0", "--trainer.callbacks.save_last=true",
           "--trainer.callbacks.enable_version_counter=false"]  # fmt: skip
ARGS = [*QUIET, "--trainer.max_epochs", "3", "--trainer.limit_train_batches", "6", "--trainer.limit_val_batches", "1",
        "--model.warmup", "1", "--model.net.init_args.hidden_sizes", "[32]", *EVERY_4]  # fmt: skip


class HeldWriter(AtomicCheckpointIO):
    """Writes the first half of each file, then waits for ``release`` before the rest: a write caught in flight."""

    def __init__(self) -> None:
        super().__init__()
        self.release, self.writing = threading.Event(), threading.Event()

    def _write(self, checkpoint, f) -> None:
        import io

        buffer = io.BytesIO()
        torch.save(checkpoint, buffer)
        data = buffer.getvalue()
        f.write(data[: len(data) // 2])
        f.flush()
        self.writing.set()
        assert self.release.wait(30), "the test never released the write"
        f.write(data[len(data) // 2 :])


def state(step: int, seed: int) -> dict:
    generator = torch.Generator().manual_seed(seed)
    weights = {"net.w": torch.randn(64, 64, generator=generator), "net.b": torch.randn(64, generator=generator)}
    return {"state_dict": weights, "global_step": step, "epoch": 0, "loops": {"batches": step}}


def test_a_file_holds_its_save_and_a_write_in_flight_is_never_picked_by_last(tmp_path):
    seed = random.randrange(2**31)
    print(f"seed {seed}")  # shown when the test fails
    folder = tmp_path / RUN_NAME / "version_0" / "checkpoints"
    io = HeldWriter()
    io.release.set()
    first = state(10, seed)
    io.save_checkpoint(first, folder / "last.ckpt")
    io.wait()
    expected = {k: v.clone() for k, v in first["state_dict"].items()}

    io.release.clear()
    io.writing.clear()
    second = {**state(20, seed + 1), "rng": torch.tensor([0, 0, 0], dtype=torch.uint8)}
    io.save_checkpoint(second, folder / "last.ckpt")  # returns while the file is being written
    assert io.writing.wait(30)
    # Another save of the same point (ModelCheckpoint's best-k file) shares the host copy: it neither copies nor
    # waits for the write in flight (if it did, it would wait here until the writer gives up after 30 s). Dropped
    # from the top k at once, its removal is queued behind its write.
    # Like each of Lightning's dumps, it holds small tensors made anew (RNG states): copied, without waiting.
    io.save_checkpoint({**second, "rng": torch.tensor([1, 2, 3], dtype=torch.uint8)}, folder / "best.ckpt")
    io.remove_checkpoint(folder / "best.ckpt")
    wanted = {k: v.clone() for k, v in second["state_dict"].items()}
    for tensor in second["state_dict"].values():
        tensor.mul_(0.5)  # the loop's next step changes the live tensors in place during the write
    assert (folder / "last.ckpt.tmp").is_file()  # precondition: a write is in flight, half of it on disk
    found = find_last_checkpoint(tmp_path / RUN_NAME)
    assert found is not None and found[1] == 10  # the previous complete file, never the one being written
    loaded = torch.load(folder / "last.ckpt", weights_only=True)["state_dict"]
    assert all(torch.equal(loaded[k], v) for k, v in expected.items())

    io.release.set()
    io.teardown()
    assert not (folder / "best.ckpt").exists() and not list(folder.glob("*.tmp"))
    found = find_last_checkpoint(tmp_path / RUN_NAME)
    assert found is not None and found[1] == 20
    loaded = torch.load(folder / "last.ckpt", weights_only=True)["state_dict"]
    assert all(torch.equal(loaded[k], v) for k, v in wanted.items())  # the state of the save, not of later steps


def test_saves_of_one_point_share_the_weights_copy_and_wait_only_to_refill_a_buffer():
    snapshot, waits = HostSnapshot(), []

    def take(checkpoint):
        return snapshot.take(checkpoint, before_copying=lambda: waits.append(checkpoint["global_step"]))

    point = state(20, seed=0)
    first = take({**point, "rng": torch.tensor([1, 2], dtype=torch.uint8)})
    assert waits == [20]  # the first copy refills nothing yet, but waits all the same
    # The same point again, with a new small tensor, as Lightning's next dump: no wait, the weights' copy shared.
    second = take({**point, "rng": torch.tensor([3, 4], dtype=torch.uint8)})
    assert waits == [20]
    assert all(second["state_dict"][k] is first["state_dict"][k] for k in point["state_dict"])
    assert second["rng"].tolist() == [3, 4] and first["rng"].tolist() == [1, 2]  # each save holds its own
    # A large new tensor at the same point (over 1 MiB and 1% of the state): it waits for the writes first.
    take({**point, "ema": torch.zeros(512, 1024)})
    assert len(waits) == 2
    # A tensor changed in place at the same point (its version counter moved): its buffer is refilled, after a wait.
    point["state_dict"]["net.b"].add_(1.0)
    third = take(point)
    assert len(waits) == 3 and torch.equal(third["state_dict"]["net.b"], point["state_dict"]["net.b"])
    # The next point: every tensor copied again, into the same buffers.
    fourth = take({**state(30, seed=1), "state_dict": point["state_dict"]})
    assert len(waits) == 4 and fourth["state_dict"]["net.w"] is first["state_dict"]["net.w"]


def final_weights(root) -> tuple[int, dict]:
    saved = torch.load(root / RUN_NAME / "version_0" / "checkpoints" / "last.ckpt", weights_only=True)
    return saved["global_step"], {k: v for k, v in saved["state_dict"].items() if k.startswith("net.")}


def assert_same_weights(root, reference) -> None:
    (step, got), (ref_step, ref) = final_weights(root), final_weights(reference)
    assert step == ref_step == 18
    diffs = {k: (got[k] - v).abs().max().item() for k, v in ref.items()}
    assert all(torch.equal(got[k], v) for k, v in ref.items()), f"max |dw|: {diffs}"


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted run with slow background writes: fit returns only once its last writes are on disk."""
    root = tmp_path_factory.mktemp("reference")
    cli_in_process("fit", *ARGS, "--trainer.plugins", "tests.faults.SlowWriter", "--trainer.plugins.delay", "0.2",
                   root=root)  # fmt: skip
    assert not list(root.rglob("*.tmp"))
    assert final_weights(root)[0] == 18  # the end of fit waited for the last save
    return root


@pytest.mark.slow  # real fits with a reference (~11 s): make test, not test-fast
def test_a_crash_with_a_write_in_flight_leaves_it_complete_and_resumes_exactly(reference, tmp_path):
    # Writes take 1 s and steps milliseconds: step 8's save is still being written when step 10 raises.
    slow = ["--trainer.plugins", "tests.faults.SlowWriter", "--trainer.plugins.delay", "1.0"]
    with pytest.raises(RuntimeError, match="injected crash"):
        cli_in_process("fit", *ARGS, *slow, "--trainer.callbacks+=tests.faults.CrashAt", "--trainer.callbacks.step=10",
                       root=tmp_path)  # fmt: skip
    assert not list(tmp_path.rglob("*.tmp"))
    saved = torch.load(tmp_path / RUN_NAME / "version_0" / "checkpoints" / "last.ckpt", weights_only=True)
    assert saved["global_step"] == 8  # written to the end although the run raised during it
    cli_in_process("fit", *ARGS, "--ckpt_path", "last", root=tmp_path)
    assert_same_weights(tmp_path, reference)


@pytest.mark.slow
def test_sigkill_during_a_background_write_resumes_from_the_previous_file_exactly(reference, tmp_path, caplog):
    # The writer dies half-way through step 8's last.ckpt (the loop having gone on): last.ckpt is step 6's.
    kill = ["--trainer.plugins", "tests.faults.KillDuringWrite", "--trainer.plugins.step", "8"]
    # the killed run is a process; the resume runs in this one, its root the killed run's (absolute: this process's
    # working directory is not tmp_path)
    proc = cli("fit", *ARGS, *kill, "--run.root", str(tmp_path / "runs"), cwd=tmp_path, check=False)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    folder = tmp_path / "runs" / RUN_NAME / "version_0" / "checkpoints"
    assert (folder / "last.ckpt.tmp").stat().st_size > 0  # precondition: killed in the middle of the write
    with caplog.at_level("INFO"):  # the resume's line is Lightning's rank_zero_info, a log record in this process
        cli_in_process("fit", *ARGS, "--ckpt_path", "last", root=tmp_path / "runs")
    assert "(global step 6)" in caplog.text, caplog.text[-2000:]
    assert_same_weights(tmp_path / "runs", reference)


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, pytest.param(signal.SIGINT, marks=pytest.mark.long)])
def test_preemption_and_ctrl_c_with_a_write_in_flight_leave_a_complete_last_checkpoint(sig, tmp_path):
    # Writes take 1 s, steps milliseconds: step 8's save (every 4 steps) is being written when the signal comes at
    # step 9; the run stops after that batch and saves last.ckpt once the write in flight is done.
    slow = ["--trainer.plugins", "tests.faults.SlowWriter", "--trainer.plugins.delay", "1.0"]
    fault = kill_at(9, sig=sig)
    proc = cli("fit", *ARGS, *slow, *fault, "--run.root", "runs", cwd=tmp_path, check=False)
    assert proc.returncode == 128 + sig, proc.stderr[-2000:]
    folder = tmp_path / "runs" / RUN_NAME / "version_0" / "checkpoints"
    assert not list(folder.glob("*.tmp"))
    assert torch.load(folder / "last.ckpt", weights_only=True)["global_step"] in (9, 10)  # the batch in flight ends


def test_the_fast_tensor_walk_equals_lightnings_on_every_container_kind():
    """HostSnapshot walks plain dicts, lists and tuples itself: it must give what apply_to_collection gives."""
    import collections
    import dataclasses

    from lightning_utilities.core.apply_func import apply_to_collection

    from lightkeep.host_snapshot import _map_tensors

    @dataclasses.dataclass
    class Holder:
        t: torch.Tensor

    Pair = collections.namedtuple("Pair", "a b")
    checkpoint = {
        "state_dict": collections.OrderedDict(w=torch.ones(3)),
        "loops": {"progress": {"ready": 3, "done": [1, 2.5, None, "x"]}},
        "optimizer_states": [{"state": {0: {"exp_avg": torch.ones(2)}}, "param_groups": [{"lr": 0.1}]}],
        "user": (Holder(torch.ones(1)), Pair(torch.zeros(1), True), collections.defaultdict(list, k=[torch.ones(1)])),
    }
    seen: list[torch.Tensor] = []
    fast = _map_tensors(checkpoint, lambda t: seen.append(t) or t * 2)
    assert repr(fast) == repr(apply_to_collection(checkpoint, torch.Tensor, lambda t: t * 2))
    assert [type(x) for x in fast["user"]] == [Holder, Pair, collections.defaultdict]
    assert type(fast["state_dict"]) is collections.OrderedDict and len(seen) == 5


def test_saves_of_one_point_are_one_file_with_the_last_ones_state_written_when_training_moves_on(tmp_path):
    io = AtomicCheckpointIO()
    io.hold_points = True  # as OneFilePerPoint sets it during fit
    dropped = tmp_path / "best-old.ckpt"
    dropped.write_bytes(b"an older best-k file")
    point = state(20, seed=0)
    # One validation end: the best-k file (dropping its worst), then the every-2-epochs file, whose dump holds
    # both callbacks' records; a file saved, removed and saved again at this point is kept.
    io.save_checkpoint({**point, "callbacks": {"best": "best.ckpt"}}, tmp_path / "best.ckpt")
    io.remove_checkpoint(dropped)
    io.save_checkpoint({**point, "callbacks": {"best": "best.ckpt"}}, tmp_path / "again.ckpt")
    io.remove_checkpoint(tmp_path / "again.ckpt")
    last = {**point, "callbacks": {"best": "best.ckpt", "every": "epoch.ckpt"}}
    io.save_checkpoint(last, tmp_path / "epoch.ckpt")
    io.save_checkpoint(last, tmp_path / "again.ckpt")
    io.save_checkpoint(last, tmp_path / "last.ckpt")  # the time-interval refresh, due at this validation
    names = ["best.ckpt", "epoch.ckpt", "again.ckpt"]
    assert not any((tmp_path / n).exists() for n in names) and dropped.exists()  # held: the point may go on
    wanted = {k: v.clone() for k, v in point["state_dict"].items()}
    for tensor in point["state_dict"].values():
        tensor.mul_(0.5)  # training moves on, changing the live tensors in place
    io.close_point()
    io.wait()
    assert not dropped.exists() and not list(tmp_path.glob("*.tmp"))
    inodes = {(tmp_path / n).stat().st_ino for n in names}
    assert len(inodes) == 1 and (tmp_path / "best.ckpt").stat().st_nlink == 4  # one file, written once
    saved = torch.load(tmp_path / "best.ckpt", weights_only=True)
    assert saved["callbacks"] == last["callbacks"]  # the last save's: the best-k file knows the every-2 file
    assert all(torch.equal(saved["state_dict"][k], v) for k, v in wanted.items())
    # last.ckpt too: each refresh renames a new file over its name, never writing into this one
    assert (tmp_path / "last.ckpt").stat().st_ino in inodes
    (tmp_path / "last.ckpt").unlink()

    # The next point's save writes the held one first (its buffers are refilled), and is then held itself.
    io.save_checkpoint({**point, "callbacks": {"best": "b2.ckpt"}}, tmp_path / "b2.ckpt")
    io.save_checkpoint(state(30, seed=1), tmp_path / "last.ckpt")
    assert (tmp_path / "b2.ckpt").exists() and not (tmp_path / "last.ckpt").exists()
    io.teardown()  # the end of fit: written
    assert torch.load(tmp_path / "last.ckpt", weights_only=True)["global_step"] == 30


def test_last_ckpt_at_the_end_of_fit_is_the_last_validations_file_unless_training_or_the_weights_moved(tmp_path):
    """The end of fit saves last.ckpt at the step of the last validation, with the epoch counted done: no batch
    trained between them, so one file holds the end's state under both names. A batch in between (the point
    closed), or weights changed in place (a callback averaging them at the end), keep the files apart."""
    import os

    def validation_then_end(folder, between) -> tuple[dict, dict]:
        folder.mkdir()
        io = AtomicCheckpointIO()
        io.hold_points = True
        point = state(20, seed=0)
        best = {**point, "callbacks": {"best": "best.ckpt"}}
        io.save_checkpoint(best, folder / "best.ckpt")
        between(io, point)
        end = {
            **point,
            "epoch": 1,
            "loops": {"batches": 20, "epochs": 1},
            "callbacks": {"best": "best.ckpt", "last": 1},
        }
        io.save_checkpoint(end, folder / "last.ckpt")
        io.teardown()
        assert not list(folder.glob("*.tmp"))
        return {k: v.clone() for k, v in best["state_dict"].items()}, {
            k: v.clone() for k, v in end["state_dict"].items()
        }

    def load(path):
        return torch.load(path, weights_only=True)

    validation_then_end(tmp_path / "end", lambda io, point: None)
    best, last = tmp_path / "end" / "best.ckpt", tmp_path / "end" / "last.ckpt"
    assert os.path.samefile(best, last)  # one file, written once
    assert load(last)["loops"] == {"batches": 20, "epochs": 1} and load(last)["callbacks"]["last"] == 1

    validation_then_end(tmp_path / "trained", lambda io, point: io.close_point())  # a batch started in between
    best, last = tmp_path / "trained" / "best.ckpt", tmp_path / "trained" / "last.ckpt"
    assert not os.path.samefile(best, last) and load(best)["loops"] == {"batches": 20}

    validated, averaged = validation_then_end(
        tmp_path / "moved", lambda io, point: point["state_dict"]["net.w"].mul_(0.5)
    )
    best, last = tmp_path / "moved" / "best.ckpt", tmp_path / "moved" / "last.ckpt"
    assert not os.path.samefile(best, last)
    assert torch.equal(load(best)["state_dict"]["net.w"], validated["net.w"] * 2)  # the weights it was scored with
    assert torch.equal(load(last)["state_dict"]["net.w"], averaged["net.w"])


def test_last_takes_last_ckpt_of_the_names_of_one_file(tmp_path):
    """The end of fit leaves last.ckpt and the last validation's files one file, one time: ``--ckpt_path last``
    takes last.ckpt, the name whose resume continues its run, not another name in the folder's order."""
    import os

    folder = tmp_path / RUN_NAME / "version_0" / "checkpoints"
    folder.mkdir(parents=True)
    torch.save(state(18, seed=0), folder / "best-epoch002-step18.ckpt")
    others = [f"best-{i}.ckpt" for i in range(8)] + ["epoch003.ckpt"]  # the folder's order decided the tie before
    for name in [*others, "last.ckpt"]:
        os.link(folder / "best-epoch002-step18.ckpt", folder / name)
    assert find_last_checkpoint(tmp_path / RUN_NAME) == (folder / "last.ckpt", 18)


class InPlaceWriter(TorchCheckpointIO):
    """A user's own writer that rewrites a file in place (as ``shutil.move`` from a temporary folder on another
    filesystem does): the bytes of every name linked to it change with it."""

    def save_checkpoint(self, checkpoint, path, storage_options=None) -> None:
        with open(path, "wb") as f:
            torch.save(checkpoint, f)


@pytest.mark.slow  # two fits (~8 s)
def test_a_fit_with_a_writer_that_writes_in_place_first_unlinks_last_ckpt_from_the_best_k_file(tmp_path):
    import os

    args = [*QUIET, "--trainer.limit_train_batches", "3", "--trainer.limit_val_batches", "1", "--model.warmup", "0",
            "--model.net.init_args.hidden_sizes", "[32]"]  # fmt: skip
    cli_in_process("fit", *args, "--trainer.max_epochs", "1", root=tmp_path)
    folder = tmp_path / RUN_NAME / "version_0" / "checkpoints"
    (best,) = folder.glob("best-*.ckpt")
    (folder / "last.ckpt").unlink()
    os.link(best, folder / "last.ckpt")  # as the engine's writer leaves the end of a fit (one file, two names)
    before = best.read_bytes()
    plugin = ["--trainer.plugins", "tests.test_async_checkpoints.InPlaceWriter"]
    cli_in_process("fit", *args, *plugin, "--trainer.max_epochs", "2", "--ckpt_path", "last", root=tmp_path)
    assert torch.load(folder / "last.ckpt", weights_only=True)["global_step"] == 6  # rewritten in place
    assert best.read_bytes() == before and not list(folder.glob("*.tmp"))


@pytest.mark.slow
@pytest.mark.long  # CI and make test-all; a SIGKILL during a background write: the test above, make test
def test_sigkill_during_the_end_of_fits_one_write_leaves_whole_files_and_resumes_exactly(reference, tmp_path):

    # The end's last.ckpt and the last validation's best-k file are one write: killed half-way through it, no
    # name of it is there yet, every file there loads, and last.ckpt is step 16's (every 4 steps).
    kill = ["--trainer.plugins", "tests.faults.KillDuringWrite", "--trainer.plugins.step", "18"]
    proc = cli("fit", *ARGS, *kill, "--trainer.plugins.name", "best-epoch002-step18.ckpt", "--run.root", "runs",
               cwd=tmp_path, check=False)  # fmt: skip
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    folder = tmp_path / "runs" / RUN_NAME / "version_0" / "checkpoints"
    assert (folder / "best-epoch002-step18.ckpt.tmp").stat().st_size > 0  # precondition: killed in the write
    for path in folder.glob("*.ckpt"):
        torch.load(path, weights_only=True)  # whole: each loads
    assert torch.load(folder / "last.ckpt", weights_only=True)["global_step"] == 16
    cli("fit", *ARGS, "--run.root", "runs", "--ckpt_path", "last", cwd=tmp_path)
    assert_same_weights(tmp_path / "runs", reference)


def test_where_hard_links_fail_each_name_of_a_point_is_written_in_full(tmp_path, monkeypatch):
    import errno
    import os

    def no_links(src, dst):
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(os, "link", no_links)
    io = AtomicCheckpointIO()
    io.hold_points = True
    point = state(20, seed=0)
    io.save_checkpoint(point, tmp_path / "best.ckpt")
    io.save_checkpoint(point, tmp_path / "epoch.ckpt")
    io.teardown()
    best, epoch = tmp_path / "best.ckpt", tmp_path / "epoch.ckpt"
    assert not os.path.samefile(best, epoch) and best.read_bytes() == epoch.read_bytes()
    assert not list(tmp_path.glob("*.tmp"))


def test_outside_a_fit_every_save_is_written_at_once(tmp_path):
    io = AtomicCheckpointIO()  # hold_points off: no callback will say when training moves on
    point = state(20, seed=0)
    io.save_checkpoint(point, tmp_path / "a.ckpt")
    io.save_checkpoint(point, tmp_path / "b.ckpt")
    io._queued[-1].result(timeout=30)  # queued at once, without waiting for a point to close
    assert (tmp_path / "a.ckpt").exists() and (tmp_path / "b.ckpt").exists()
    io.teardown()


def _same(a, b, path: str = "") -> list[str]:
    """Where two checkpoints differ (tensors compared exactly, run roots in strings ignored)."""
    if isinstance(a, torch.Tensor):
        return [] if isinstance(b, torch.Tensor) and torch.equal(a, b) else [path]
    if isinstance(a, dict):
        if not isinstance(b, dict) or a.keys() != b.keys():
            return [path]
        return [d for k in a for d in _same(a[k], b[k], f"{path}/{k}")]
    if isinstance(a, list | tuple):
        if type(a) is not type(b) or len(a) != len(b):
            return [path]
        return [d for i, (x, y) in enumerate(zip(a, b, strict=True)) for d in _same(x, y, f"{path}/{i}")]
    return [] if a == b else [path]


@pytest.mark.slow  # two 4-epoch fits (~10 s)
def test_a_validations_files_are_one_file_equal_to_the_last_one_synchronous_saves_write(tmp_path):
    """The oracle: the same fit with synchronous saves, where Lightning writes each file of a validation in turn,
    in the order of its checkpoint callbacks, and the file written second holds both callbacks' records."""
    import os

    args = [*QUIET, "--trainer.max_epochs", "4", "--trainer.limit_train_batches", "3", "--trainer.limit_val_batches",
            "2", "--model.net.init_args.hidden_sizes", "[32]", "--model.warmup", "1"]  # fmt: skip
    cli_in_process("fit", *args, root=tmp_path / "bg")
    sync_cli = cli_in_process("fit", *args, "--checkpoints.background", "false", root=tmp_path / "sync")
    # Which of the two linked files Lightning writes second: the later of the best-k callback (run.monitor's) and
    # the every-2-epochs one in the trainer's checkpoint callbacks.
    savers = [c for c in sync_cli.trainer.checkpoint_callbacks if type(c).__name__ == "ModelCheckpoint"]
    (best_k,) = [i for i, c in enumerate(savers) if c.monitor]
    (every_2,) = [i for i, c in enumerate(savers) if c.every_n_epochs == 2]
    best_second = best_k > every_2
    bg, sync = (tmp_path / r / RUN_NAME / "version_0" / "checkpoints" for r in ("bg", "sync"))
    names = sorted(p.name for p in bg.glob("*.ckpt"))
    assert names == sorted(p.name for p in sync.glob("*.ckpt"))

    def load(folder, name):
        text = repr  # run roots differ between the two runs: compare paths relative to them
        saved = torch.load(folder / name, weights_only=True)
        saved["callbacks"] = text(saved["callbacks"]).replace(str(folder.parents[2]), "<root>")
        return saved

    linked = [(b, e) for b in names for e in names if b.startswith("best-epoch") and e == b[5:13] + ".ckpt"]
    assert len(linked) == 2, names  # epochs 1 and 3: each saved by the best-3 and the every-2-epochs callback
    (best, every), end = linked
    assert os.path.samefile(bg / best, bg / every)
    second, first = (best, every) if best_second else (every, best)
    assert _same(load(bg, best), load(sync, second)) == []  # the state after both saves
    assert _same(load(bg, best), load(sync, first)) == ["/callbacks"]  # Lightning's first file lacks the second
    # The last validation's files and the end's last.ckpt (no batch trained between them): one file, the state at
    # the end of fit, equal to Lightning's last.ckpt, written after them
    assert all(os.path.samefile(bg / name, bg / "last.ckpt") for name in end)
    assert _same(load(bg, "last.ckpt"), load(sync, "last.ckpt")) == []
    for name in names:  # the others: each its own file, equal to Lightning's
        if not any(name in pair for pair in linked) and name != "last.ckpt":
            assert (bg / name).stat().st_nlink == 1 and _same(load(bg, name), load(sync, name)) == [], name


@pytest.mark.slow  # two 4-epoch fits (~10 s)
def test_two_callbacks_with_one_file_name_keep_their_files_apart_as_with_synchronous_saves(tmp_path):
    """Two ModelCheckpoints with Lightning's default file name, one keeping the best by val/loss, one every epoch:
    at each validation both name the same file. The oracle is the synchronous run, where the second finds the
    first's file on disk and writes ``-v1``; a held or in-flight write must count as on disk, or the first one's
    top k deletes the files the second keeps."""
    same_name = ["--trainer.callbacks+=ModelCheckpoint", "--trainer.callbacks.monitor=val/loss",
                 "--trainer.callbacks.save_top_k=1", "--trainer.callbacks+=ModelCheckpoint",
                 "--trainer.callbacks.every_n_epochs=1", "--trainer.callbacks.save_top_k=-1"]  # fmt: skip
    args = [*QUIET, "--trainer.max_epochs", "4", "--trainer.limit_train_batches", "3", "--trainer.limit_val_batches",
            "2", "--model.net.init_args.hidden_sizes", "[32]", "--model.warmup", "1", *same_name]  # fmt: skip
    cli_in_process("fit", *args, root=tmp_path / "bg")
    cli_in_process("fit", *args, "--checkpoints.background", "false", root=tmp_path / "sync")
    bg, sync = (tmp_path / r / RUN_NAME / "version_0" / "checkpoints" for r in ("bg", "sync"))
    names = sorted(p.name for p in bg.glob("*.ckpt"))
    kept = [f"epoch={e}-step={3 * (e + 1)}-v1.ckpt" for e in range(4)]  # the every-epoch callback's
    assert set(kept) <= set(names) and names == sorted(p.name for p in sync.glob("*.ckpt"))
    for name in names:
        steps = [torch.load(d / name, weights_only=True)["global_step"] for d in (bg, sync)]
        assert steps[0] == steps[1], name


@pytest.mark.parametrize("crc32", [False, True])
def test_crc32_is_left_out_unless_asked_for_and_torchs_setting_is_left_as_it_was(tmp_path, crc32):
    import zipfile

    from lightkeep.compat_torch import crc32_setting_is_per_thread

    io = AtomicCheckpointIO(crc32=crc32)
    point = state(20, seed=0)
    io.save_checkpoint(point, tmp_path / "a.ckpt")
    io.teardown()
    assert torch.serialization.get_crc32_options() is True  # the process-wide default, for everyone else's saves
    damaged = zipfile.ZipFile(tmp_path / "a.ckpt").testzip()  # the first record whose checksum does not match
    assert (damaged is None) == (crc32 or not crc32_setting_is_per_thread())  # torch < 2.13: kept (compat_torch)
    loaded = torch.load(tmp_path / "a.ckpt", weights_only=True)  # torch never checks it
    assert all(torch.equal(loaded["state_dict"][k], v) for k, v in point["state_dict"].items())


def test_a_weights_only_save_at_the_point_is_a_file_of_its_own_and_a_failed_fit_stops_holding(tmp_path):
    io = AtomicCheckpointIO()
    io.hold_points = True
    full = {**state(20, seed=0), "optimizer_states": [{"step": torch.tensor(20.0)}], "callbacks": {"best": "b"}}
    weights = {k: v for k, v in full.items() if k not in ("optimizer_states", "callbacks")}  # save_weights_only
    io.save_checkpoint(full, tmp_path / "best.ckpt")
    io.save_checkpoint(weights, tmp_path / "weights.ckpt")
    io.save_checkpoint(full, tmp_path / "epoch.ckpt")
    io.teardown()  # Lightning runs it after a failed fit too, without the callbacks' teardown
    assert not io.hold_points
    best, only, epoch = (
        torch.load(tmp_path / n, weights_only=True) for n in ("best.ckpt", "weights.ckpt", "epoch.ckpt")
    )
    assert "optimizer_states" in best and "optimizer_states" in epoch and "optimizer_states" not in only
    io.save_checkpoint(full, tmp_path / "later.ckpt")  # no callback will close a point now: written at once
    io._queued[-1].result(timeout=30)
    assert (tmp_path / "later.ckpt").exists()
    io.teardown()


def test_a_tmp_file_left_linked_to_a_finished_checkpoint_is_replaced_not_written_into(tmp_path):
    import os

    finished = tmp_path / "epoch001.ckpt"
    torch.save(state(20, seed=0), finished)
    before = finished.read_bytes()
    os.link(finished, tmp_path / "best.ckpt.tmp")  # a kill between the renames of one point's names
    io = AtomicCheckpointIO()
    io.save_checkpoint(state(30, seed=1), tmp_path / "best.ckpt")
    io.teardown()
    assert finished.read_bytes() == before
    assert torch.load(tmp_path / "best.ckpt", weights_only=True)["global_step"] == 30


def test_a_name_counts_as_taken_while_its_save_is_held_or_being_written(tmp_path, monkeypatch):
    """What ModelCheckpoint's version counter asks (``claims``), against the file on disk as the oracle: taken
    from the save on, whether held or in the writer's hands, and free again once removed."""
    io = AtomicCheckpointIO()
    gate, write = threading.Event(), io._write
    monkeypatch.setattr(io, "_write", lambda checkpoint, f: (gate.wait(30), write(checkpoint, f)))
    written, held = tmp_path / "written.ckpt", tmp_path / "held.ckpt"
    io.save_checkpoint(state(20, seed=0), written)  # not holding: straight to the writer, which waits
    assert io.claims(written) and not written.exists()
    gate.set()
    io.wait()
    assert written.exists() and not io.claims(written)  # on disk now: Lightning's own check sees it
    io.hold_points = True
    io.save_checkpoint(state(30, seed=1), held)
    assert io.claims(held) and not held.exists() and not io.claims(tmp_path / "other.ckpt")
    io.remove_checkpoint(held)  # dropped from the top k before it was written
    assert not io.claims(held)
    io.teardown()


@pytest.mark.slow  # two real fits, the resume in a subprocess (its PYTHONWARNINGS is read at its start)
def test_last_names_each_file_it_skips_and_why_in_a_line_that_ignored_warnings_do_not_hide(tmp_path):
    import os

    args = [*QUIET, "--trainer.limit_train_batches", "3", "--trainer.limit_val_batches", "1", "--model.warmup", "0",
            "--model.net.init_args.hidden_sizes", "[32]"]  # fmt: skip
    cli_in_process("fit", *args, "--trainer.max_epochs", "1", root=tmp_path / "runs")  # the run to resume
    folder = tmp_path / "runs" / RUN_NAME / "version_0" / "checkpoints"
    last = folder / "last.ckpt"
    cut = folder / "newer.ckpt"  # a copy cut short (a full disk, a copy killed half-way), newer than last.ckpt
    cut.write_bytes(last.read_bytes()[: last.stat().st_size // 2])
    os.utime(cut, (last.stat().st_mtime + 10,) * 2)
    (folder / "gone.ckpt").symlink_to("deleted.ckpt")  # a link to a file since deleted
    ignored = {"PYTHONWARNINGS": "ignore"}  # as in many launch scripts and containers
    proc = cli("fit", *args, "--trainer.max_epochs", "2", "--ckpt_path", "last", cwd=tmp_path, env=ignored)
    out = proc.stdout + proc.stderr
    relative = f"runs/{RUN_NAME}/version_0/checkpoints"
    damaged = f"Skipping a checkpoint that does not load: {relative}/newer.ckpt is not a readable checkpoint: it is"
    assert f"{damaged} not a zip archive" in out, out[-3000:]
    assert f"Skipping a link to nothing: {relative}/gone.ckpt -> deleted.ckpt" in out, out[-3000:]
    assert f"--ckpt_path last: resuming from {relative}/last.ckpt (global step 3)" in out, out[-3000:]
