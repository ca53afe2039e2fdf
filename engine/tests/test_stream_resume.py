"""A train ``IterableDataset`` in a plain ``DataLoader`` (tests/fixtures/streams.py) resumes mid-epoch where it
stopped: killed with SIGKILL and resumed with ``fit --ckpt_path last``, each step trains on the sample ids the
uninterrupted run trained on there (none twice, none skipped) and the final weights are equal; a stream with its
own ``state_dict`` resumes at it, one without is fast-forwarded by count, per loader worker and rank."""

import contextlib
import copy
import io
import json
import random
from collections import Counter
from pathlib import Path

import pytest
import torch

from lightkeep.stream_positions import Made, Position
from tests.faults import kill_at
from tests.helpers import DDP2, QUIET, cli, cli_in_process, max_abs_diff

SAVE_EVERY = 9  # last.ckpt every 9 steps: a kill at step 30 resumes from step 27, mid-epoch


def config(tmp_path: Path) -> list[str]:
    path = tmp_path / "streams.yaml"
    path.write_text(
        "trainer:\n  callbacks:\n    - class_path: lightning.pytorch.callbacks.ModelCheckpoint\n      init_args:\n"
        "        save_top_k: 0\n        save_last: true\n        enable_version_counter: false\n"
        f"        every_n_train_steps: {SAVE_EVERY}\n"
        "model:\n  class_path: tests.fixtures.streams.NextToken\n"
        "data:\n  class_path: tests.fixtures.streams.TokenData\n"
    )
    return ["--config", str(path), *QUIET, "--run.monitor", "null", "--data.batch_size", "4"]


def record(cwd: Path) -> list[str]:
    return ["--trainer.callbacks+=tests.fixtures.streams.RecordIds", f"--trainer.callbacks.path={cwd}"]


def history(cwd: Path) -> dict[tuple[int, int], list[int]]:
    """``{(rank, global step): sample ids}`` that the run in ``cwd`` trained on; a step the killed run took after
    its last checkpoint is the resumed run's (written after it)."""
    steps = {}
    for path in sorted(cwd.glob("ids.rank*.jsonl")):
        for line in path.read_text().splitlines():
            rank, step, ids = json.loads(line)
            steps[rank, step] = ids
    return steps


def last(cwd: Path) -> dict:
    (run,) = (cwd / "runs" / "token").glob("version_*")
    return torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)


def fit(*args: str, cwd: Path) -> str:
    """``fit ARGS`` as ``cli`` runs it in ``cwd``, returning the start line. A run on one process of the fixtures' own
    data is run in this process: each subprocess spends ~3.5 s importing Lightning, and an uninterrupted run or a
    resume is the same real CLI here. A subprocess, as a user's resume is: a run on 2 ranks (Lightning's ``ddp``
    re-executes ``sys.argv``), and one of a library's loader (LitData, Hugging Face ``datasets``): run in this process
    after other runs, LitData's resume differed from its reference by 0.2 and a Hugging Face stream's loader workers
    failed to start (a local lambda could not be pickled), while a user's resume, a fresh process, is exact."""
    source = args[args.index("--data.source") + 1] if "--data.source" in args else "tokens"
    out = io.StringIO()
    if "--trainer.strategy" in args or source not in ("tokens", "map"):
        out.write(cli("fit", *args, cwd=cwd).stdout)
    else:
        with contextlib.redirect_stdout(out):
            cli_in_process("fit", *args, root=cwd / "runs")
    return next(x for x in out.getvalue().splitlines() if x.startswith("Run "))


def killed_and_resumed(tmp_path: Path, kill: int, saved: int, *flags: str, reference: Path | None = None):
    """An uninterrupted fit (unless ``reference`` holds one) and one killed at step ``kill`` and resumed from step
    ``saved``: (seen twice, skipped, steps that differ, max |delta| of the final weights and optimizer, the resumed
    run's start line, the reference's folder)."""
    resumed = tmp_path / ("resumed-" + "-".join(flags).replace("-", "").replace(".", "_"))
    resumed.mkdir()
    args = [*config(tmp_path), *flags]
    if reference is None:
        reference = tmp_path / "reference"
        reference.mkdir()
        fit(*args, *record(reference), cwd=reference)
    proc = cli("fit", *args, *record(resumed), *kill_at(kill, settle=True), cwd=resumed, check=False)
    assert proc.returncode != 0, proc.stderr[-2000:]
    loops = last(resumed)["loops"]["fit_loop"]
    assert last(resumed)["global_step"] == saved and loops["epoch_loop.batch_progress"]["current"]["completed"] > 0
    line = fit(*args, *record(resumed), "--ckpt_path", "last", cwd=resumed)
    twice, skipped, differ, diff = compared(reference, resumed)
    print(f"{flags}: seen twice {twice}, skipped {skipped}, steps that differ {differ}, max |delta| {diff}\n{line}")
    return twice, skipped, differ, diff, line, reference


def killed_twice(tmp_path: Path, *flags: str) -> tuple[int, int, int, float, str]:
    """An uninterrupted fit and one killed at step 30 (saved at step 27, epoch 1), resumed, killed again at step 40
    (saved at step 36 by the resumed run, in the epoch it resumed in) and resumed: (seen twice, skipped, steps that
    differ, max |delta| of the final weights and optimizer, the last resume's start line)."""
    args = [*config(tmp_path), *flags]
    reference, resumed = tmp_path / "reference", tmp_path / "resumed"
    reference.mkdir(), resumed.mkdir()
    fit(*args, *record(reference), cwd=reference)
    assert cli("fit", *args, *record(resumed), *kill_at(30, settle=True), cwd=resumed, check=False).returncode != 0
    assert last(resumed)["global_step"] == 27
    again = cli("fit", *args, *record(resumed), "--ckpt_path", "last", *kill_at(40, settle=True), cwd=resumed,
                check=False)  # fmt: skip
    assert again.returncode != 0 and last(resumed)["global_step"] == 36, again.stderr[-2000:]
    assert last(resumed)["loops"]["fit_loop"]["epoch_loop.batch_progress"]["current"]["completed"] > 0  # mid-epoch
    line = fit(*args, *record(resumed), "--ckpt_path", "last", cwd=resumed)
    twice, skipped, differ, diff = compared(reference, resumed)
    print(f"{flags} killed twice: seen twice {twice}, skipped {skipped}, steps that differ {differ}, max |delta| "
          f"{diff}\n{line}")  # fmt: skip
    return twice, skipped, differ, diff, line


def compared(reference: Path, resumed: Path) -> tuple[int, int, int, float]:
    """(seen twice, skipped, steps that differ, max |delta| of the final weights and optimizer) of the run in
    ``resumed`` against the uninterrupted one in ``reference``."""
    ref, got = history(reference), history(resumed)
    counts, expected = Counter(i for ids in got.values() for i in ids), Counter(i for ids in ref.values() for i in ids)
    twice, skipped = sum((counts - expected).values()), sum((expected - counts).values())
    differ = sum(got.get(key) != ids for key, ids in ref.items()) + len(got.keys() - ref.keys())
    a, b = last(reference), last(resumed)
    diff = max(max_abs_diff(a["state_dict"], b["state_dict"]), max_abs_diff(a["optimizer_states"],
                                                                         b["optimizer_states"]))  # fmt: skip
    return twice, skipped, differ, diff


@pytest.mark.slow
def test_a_killed_fit_of_a_stream_resumes_at_its_state_or_fast_forwards_without_one(tmp_path):
    # 97 samples in batches of 4: 25 steps an epoch; killed at step 30, resumed at step 27 (epoch 1, batch 2)
    *seen, line, reference = killed_and_resumed(tmp_path, 30, 27, "--trainer.max_epochs", "2")
    assert seen == [0, 0, 0, 0.0], seen
    assert (
        "exact resume: resume verified (train loader 0 (Tokens): read again past the 8 samples trained on, the "
        "stream gave the batch the checkpoint recorded last) | streams: train loader 0 (Tokens): fast-forwarded past "
        "the 8 samples of epoch 1 trained on (read again, not trained on; checked against the checkpoint's "
        "fingerprint" in line
    )
    *seen, line, _ = killed_and_resumed(tmp_path, 30, 27, "--trainer.max_epochs", "2", "--data.state", "true",
                                        reference=reference)  # fmt: skip
    assert seen == [0, 0, 0, 0.0], seen
    assert "streams: train loader 0 (PositionedTokens): resumed at its state after the 8 samples of epoch 1" in line


@pytest.mark.slow
@pytest.mark.long
@pytest.mark.parametrize("state", ["false", "true"])
def test_a_killed_fit_of_a_stream_in_two_loader_workers_resumes_in_the_uninterrupted_order(state, tmp_path):
    # workers of 49 and 48 samples: 13 and 12 batches, handed out in turn; resumed at step 36 (epoch 1, 6 batches
    # of worker 0 and 5 of worker 1 trained on), the new workers' turns start at worker 0 and the loader continues
    # with worker 1's
    flags = ["--trainer.max_epochs", "2", "--data.num_workers", "2", "--data.state", state]
    *seen, line, _ = killed_and_resumed(tmp_path, 40, 36, *flags)
    assert seen == [0, 0, 0, 0.0], seen
    assert "the 44 samples of epoch 1 trained on" in line, line


@pytest.mark.slow
@pytest.mark.long
@pytest.mark.parametrize("state", ["false", "true"])
def test_a_stream_in_two_loader_workers_killed_twice_resumes_exactly_both_times(state, tmp_path):
    """The resumed run's own checkpoint: a resume hands out its workers' batches from the checkpoint's turn (worker
    1 here), not in the order they arrive, and each batch trained on counts for the worker that made it."""
    flags = ["--trainer.max_epochs", "2", "--data.num_workers", "2", "--data.state", state]
    args = [*config(tmp_path), *flags]
    reference, resumed = tmp_path / "reference", tmp_path / "resumed"
    reference.mkdir(), resumed.mkdir()
    fit(*args, *record(reference), cwd=reference)
    assert cli("fit", *args, *record(resumed), *kill_at(40, settle=True), cwd=resumed, check=False).returncode != 0
    # resumed at step 36 (epoch 1: 6 batches of worker 0 and 5 of worker 1 trained on), killed again at step 47
    again = cli("fit", *args, *record(resumed), "--ckpt_path", "last", *kill_at(47, settle=True), cwd=resumed,
                check=False)  # fmt: skip
    assert again.returncode != 0 and last(resumed)["global_step"] == 45, again.stderr[-2000:]
    line = fit(*args, *record(resumed), "--ckpt_path", "last", cwd=resumed)
    assert list(compared(reference, resumed)) == [0, 0, 0, 0.0], line
    assert "the 80 samples of epoch 1 trained on" in line, line


@pytest.mark.slow
@pytest.mark.long
@pytest.mark.parametrize(
    "flags",
    [["--data.loader", "stateful", "--data.source", "tokens", "--data.state", "true"],
     ["--data.loader", "stateful", "--data.source", "hf"],
     ["--data.loader", "stateful", "--data.source", "map"],
     ["--data.source", "map", "--data.sampler", "counting"],
     ["--data.source", "litdata"]],
    ids=["stateful-stream", "stateful-hf", "stateful-map", "own-sampler", "litdata"],
)  # fmt: skip
def test_a_loader_killed_twice_resumes_exactly_both_times(flags, tmp_path):
    """The resumed run's own checkpoint (killed again in the epoch it resumed in) for each loader kind in 2 workers:
    a loader that keeps its own position, a map-style ``StatefulDataLoader`` (the engine's sampler), the user's own
    sampler drawn again."""
    *seen, line = killed_twice(tmp_path, "--trainer.max_epochs", "2", "--data.num_workers", "2", *flags)
    assert seen == [0, 0, 0, 0.0], seen
    assert "exact resume: resume verified" in line or "litdata" in flags, line


@pytest.mark.slow
@pytest.mark.long
@pytest.mark.parametrize(("source", "state"), [("tokens", "false"), ("tokens", "true"), ("hf", "true")])
def test_a_killed_two_rank_fit_of_a_stream_resumes_each_rank_at_its_own_position(source, state, tmp_path):
    """A stream in a plain ``DataLoader`` on 2 ranks, without state (fast-forwarded), with its own, or a Hugging Face
    stream split by node (2 of its 4 shards a rank, one a worker); a resume on 1 rank stops in one line before
    anything trains."""
    # 194 samples: 97 a rank, 49 and 48 in its two workers; each rank resumes at its own shard's position
    flags = ["--trainer.max_epochs", "2", "--data.n_train", "194", "--data.num_workers", "2", "--data.state", state,
             "--data.source", source]  # fmt: skip
    *seen, line, _ = killed_and_resumed(tmp_path, 40, 36, *flags, *DDP2)
    assert seen == [0, 0, 0, 0.0], seen
    assert "the 88 samples of epoch 1 over 2 ranks trained on" in line, line  # 44 on each rank
    name = "Tokens" if state == "false" else "PositionedTokens" if source == "tokens" else "IterableDataset"
    if state == "true":
        assert f"exact resume: resume verified (train loader 0 ({name}): its first batch on 2 ranks is the one" in line
    refused_on_one_rank(tmp_path, flags, name, restart=state == "false")  # restart keeps a stream's state


def refused_on_one_rank(tmp_path: Path, flags: list[str], name: str, restart: bool) -> None:
    """A resume on 1 rank of the 2-rank run in ``tmp_path/resumed-*`` stops in one line, nothing trained or saved."""
    resumed = next(tmp_path.glob("resumed-*"))
    step = last(resumed)["global_step"]
    proc = cli("fit", *config(tmp_path), *flags, "--trainer.max_epochs", "3", "--ckpt_path", "last", cwd=resumed,
               check=False)  # fmt: skip
    refusal = (f"error: train loader 0 ({name}): the checkpoint holds the loader positions of 2 rank(s), this run has "
               "1: each rank reads its own share of the data from its own position, so resume on 2 rank(s)"
               + (", or with --run.stream_resume restart" if restart else ""))  # fmt: skip
    (error,) = [x for x in proc.stderr.splitlines() if "the checkpoint holds the loader positions" in x]
    assert error.startswith(refusal) and (restart or "stream_resume restart" not in error), error
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert last(resumed)["global_step"] == step  # nothing trained, nothing saved


def test_a_stream_whose_order_is_not_the_same_after_a_resume_stops_before_the_first_step(tmp_path, capsys):
    """A stream shuffled from the global generator gives other samples after the fast-forward (in epoch 1 the
    generator has drawn dropout masks before it): the run stops in one line before training on them;
    ``--run.stream_resume restart`` is the user's choice to restart the epoch."""
    args = [*config(tmp_path), "--trainer.max_epochs", "2", "--data.order", "global"]
    with pytest.raises(RuntimeError, match="injected crash"):
        cli_in_process("fit", *args, "--trainer.callbacks+=tests.faults.CrashAt", "--trainer.callbacks.step=30",
                       root=tmp_path / "runs")  # fmt: skip
    assert last(tmp_path)["global_step"] == 27  # epoch 1, batch 2
    with pytest.raises(SystemExit) as stopped:
        cli_in_process("fit", *args, "--ckpt_path", "last", root=tmp_path / "runs")
    assert "train loader 0 (Tokens): after the fast-forward past the 8 samples trained on" in str(stopped.value)
    assert "Resume with --run.stream_resume restart" in str(stopped.value)
    assert last(tmp_path)["global_step"] == 27  # nothing trained, nothing saved
    capsys.readouterr()
    cli_in_process("fit", *args, "--ckpt_path", "last", "--run.stream_resume", "restart", root=tmp_path / "runs")
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("Run "))
    unverified = "exact resume: not verified: train loader 0 streams an IterableDataset (Tokens): its next batch has"
    assert (
        unverified + " no index; see opts out" in line
        and "run.stream_resume is restart: a mid-epoch resume restarts" in line
    )
    assert last(tmp_path)["global_step"] == 27 + 25  # epoch 1's 25 batches again, from step 27


def test_a_resumed_loader_hands_out_its_workers_batches_in_the_uninterrupted_order():
    """``Position.hand_out`` against the order of a ``DataLoader``'s workers' turns (the oracle: batch ``m`` of
    worker ``w`` comes before batch ``m`` of ``w + 1`` and after batch ``m - 1`` of every worker; a worker whose
    stream ended is left out), on random shard sizes, numbers of workers and resume points; and each batch taken
    counts for the worker that made it (not for the worker whose batch arrived first)."""
    rng = random.Random(0)
    for trial in range(600):
        workers, stateful = rng.randint(1, 4), trial % 2 == 1
        sizes = [rng.randint(0, 6) for _ in range(workers)]  # each worker's batches this epoch
        turns = sorted((m, w) for w in range(workers) for m in range(sizes[w]))  # the uninterrupted order
        cut = rng.randint(0, len(turns))  # batches trained on before the kill
        position = Position("s", workers, stateful, True, lambda: 0)
        saved = {"epoch": 0, "batches": [0] * workers, "samples": [0] * workers,
                 "fingerprints": [None] * workers, "states": [None] * workers, "next": 0}  # fmt: skip
        for _, w in turns[:cut]:
            saved["batches"][w] += 1
            saved["next"] = (w + 1) % workers
        position.restore = saved
        restore = position.start_epoch()
        # the resumed loader's turns start again at worker 0: each worker first drops its batches trained on
        # (a stream fast-forwarded), or starts after them (a stream resumed at its state: it arrives in another
        # order than it is handed out)
        made = [Made(None if m < restore["batches"][w] else (m, w), w, 1, None, None) for m, w in turns]
        if stateful:
            left = sorted((m - restore["batches"][w], w, m) for m, w in turns if m >= restore["batches"][w])
            made = [Made((m, w), w, 1, None, None) for _, w, m in left]
        got = []
        for batch in position.hand_out(iter(made), restore):
            got.append(batch)
            position.take(cut + len(got))  # trained on: it counts for the worker that made it
            m, w = batch
            assert position.taken["batches"][w] == m + 1 and position.taken["next"] == (w + 1) % workers, trial
        assert got == turns[cut:], (trial, sizes, cut, stateful)
        assert position.problem is None


@pytest.mark.parametrize("stateful", [True, False])
def test_a_resumed_stream_whose_first_batch_is_not_the_one_fetched_next_stops_unless_the_user_accepts(stateful):
    """A save keeps the fingerprint of the batch handed out next (Lightning's fetcher took it ahead); a resume whose
    first batch differs (a state that leaves out a shuffle buffer) is a problem, unless ``as_saved``."""
    position = Position("s", 0, stateful, True, lambda: 0)
    position.start_epoch()
    handed = position.hand_out(iter([Made(k, 0, 4, 100 + k, {"at": k}) for k in range(5)]), None)
    assert [next(handed), next(handed)] == [0, 1]  # batch 1 fetched ahead while batch 0 trains
    position.take(1)
    saved = copy.deepcopy(position.taken)
    assert saved["ahead"] == 101 and saved["batches"] == [1]
    for strict, first, problem in [(True, 101, False), (True, 999, True), (False, 999, False)]:
        resumed = Position("s", 0, stateful, True, lambda: 0, strict=strict)
        resumed.restore = copy.deepcopy(saved)
        restore = resumed.start_epoch()
        skipped = [Made(None, 0, 4, 100, None)] if not stateful else []  # a fast-forward drops batch 0
        batches = resumed.hand_out(iter([*skipped, Made("b", 0, 4, first, None)]), restore)
        assert next(batches) == "b" and resumed.first == first
        assert (resumed.problem is not None) == problem, (strict, first)
        if problem:
            assert resumed.problem.startswith("s: its first batch after the resume differs from the batch the ")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("source", "workers"),
    [
        ("tokens", "0"),
        pytest.param("tokens", "2", marks=pytest.mark.long),
        pytest.param("hf", "0", marks=pytest.mark.long),
        pytest.param("hf", "2", marks=pytest.mark.long),  # a Hugging Face stream's own state: also below
    ],
    ids=lambda x: x,
)
def test_a_killed_fit_of_a_loader_that_keeps_its_own_position_resumes_after_the_last_batch_trained_on(
    source, workers, tmp_path
):
    """torchdata's ``StatefulDataLoader`` over a stream with its own state (``PositionedTokens``, a Hugging Face
    ``datasets`` stream): Lightning saved its position a batch ahead of training (one batch lost); the engine keeps
    the state as of the batches trained on and checks the resume's first batch against the batch fetched next."""
    flags = ["--trainer.max_epochs", "2", "--data.loader", "stateful", "--data.source", source, "--data.state", "true",
             "--data.num_workers", workers]  # fmt: skip
    *seen, line, _ = killed_and_resumed(tmp_path, 30, 27, *flags)
    assert seen == [0, 0, 0, 0.0], seen
    assert "exact resume: resume verified (train loader 0 (StatefulDataLoader): its first batch is the one" in line


@pytest.mark.slow
@pytest.mark.long
@pytest.mark.parametrize("source", ["tokens", "hf", "litdata", "map"])
def test_a_killed_two_rank_fit_of_a_stateful_loader_resumes_each_rank_at_its_own_position(source, tmp_path):
    """Lightning saved rank 0's position for every rank (a ``StatefulDataLoader`` of a shuffled map-style dataset:
    600 samples twice, 600 skipped): each rank now resumes at its own; a resume on 1 rank stops in one line before
    anything trains where the loader keeps its own positions (where the sampler is the engine's, another number of
    ranks continues its order: test_elastic)."""
    flags = ["--trainer.max_epochs", "2", "--data.n_train", "194", "--data.loader", "stateful", "--data.state", "true",
             "--data.num_workers", "2", "--data.source", source]  # fmt: skip
    *seen, line, _ = killed_and_resumed(tmp_path, 30, 27, *flags, *DDP2)
    assert seen == [0, 0, 0, 0.0], seen
    names = {"tokens": "StatefulDataLoader", "hf": "StatefulDataLoader", "litdata": "StreamingDataLoader"}
    name = names.get(source)  # map: the engine's sampler
    if name == "StatefulDataLoader":
        assert f"(train loader 0 ({name}): its first batch on 2 ranks is the one the checkpoint's run" in line, line
    elif name is None:
        assert "resume verified (epoch 1, batch 2: 8 samples on 2 rank(s)" in line, line
    if name is None:
        return
    resumed = next(tmp_path.glob("resumed-*"))
    step = last(resumed)["global_step"]
    proc = cli("fit", *config(tmp_path), *flags, "--trainer.max_epochs", "3", "--ckpt_path", "last", cwd=resumed,
               check=False)  # fmt: skip
    assert proc.returncode != 0
    refusal = (f"train loader 0 ({name}): the checkpoint holds the loader positions of 2 rank(s), this run has 1: "
               "each rank reads its own share of the data from its own position, so resume on 2 rank(s)")  # fmt: skip
    (error,) = [x for x in proc.stderr.splitlines() if "the checkpoint holds the loader positions" in x]
    assert error.startswith("error: " + refusal), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert last(resumed)["global_step"] == step  # nothing trained, nothing saved


@pytest.mark.slow
@pytest.mark.parametrize("workers", [pytest.param("0", marks=pytest.mark.long), "2"])
def test_a_killed_fit_of_a_map_style_dataset_in_a_stateful_dataloader_resumes_in_the_engines_order(workers, tmp_path):
    """torchdata's ``StatefulDataLoader`` over a map-style dataset with ``shuffle=True``: its position is its
    sampler's, which the engine's takes over as in a plain ``DataLoader`` (on 2 ranks Lightning handed every rank
    rank 0's: 600 samples twice); its workers' draws are seeded per sample and the first batch is replayed."""
    flags = ["--trainer.max_epochs", "2", "--data.loader", "stateful", "--data.source", "map",
             "--data.num_workers", workers]  # fmt: skip
    *seen, line, _ = killed_and_resumed(tmp_path, 30, 27, *flags)
    assert seen == [0, 0, 0, 0.0], seen
    assert "exact resume: resume verified (epoch 1, batch 2: 4 samples on 1 rank(s)" in line, line
    assert "opts out" not in line, line


@pytest.mark.slow
@pytest.mark.long  # CI and make test-all; a loader's own position: the tokens loader's test above is in make test
@pytest.mark.parametrize("workers", ["0", "2"])
def test_a_killed_fit_of_litdatas_streaming_loader_resumes_after_the_last_batch_trained_on(workers, tmp_path):
    """LitData's ``StreamingDataset`` in its ``StreamingDataLoader`` (it has a length: Lightning fetches nothing
    ahead, so the checkpoint holds no next batch to compare the first with, and the start line says so)."""
    flags = ["--trainer.max_epochs", "2", "--data.source", "litdata", "--data.num_workers", workers]
    *seen, line, _ = killed_and_resumed(tmp_path, 30, 27, *flags)
    assert seen == [0, 0, 0, 0.0], seen
    assert "exact resume: not verified: train loader 0 (StreamingDataLoader): the checkpoint's run had fetched" in line
    assert "opts out: train loader 0: StreamingDataLoader has a length, so Lightning fetches no batch" in line, line


@pytest.mark.slow
@pytest.mark.long  # CI and make test-all; a stream's state in plain loader workers: the first test above, make test
@pytest.mark.parametrize("workers", ["0", "2"])
def test_a_killed_fit_of_a_hugging_face_stream_in_a_plain_dataloader_resumes_at_each_workers_state(workers, tmp_path):
    """A Hugging Face ``datasets`` stream (4 shards) in a plain ``DataLoader``: its own ``state_dict``, read in each
    loader worker after each batch (Lightning saves a loader's state only: the epoch restarted, 800 samples twice)."""
    flags = ["--trainer.max_epochs", "2", "--data.source", "hf", "--data.num_workers", workers]
    *seen, line, _ = killed_and_resumed(tmp_path, 30, 27, *flags)
    assert seen == [0, 0, 0, 0.0], seen
    assert "streams: train loader 0 (IterableDataset): resumed at its" in line, line


SHUFFLED_HF = [
    pytest.param("stateful", "0", 1, id="stateful-0-1rank"),
    pytest.param("plain", "0", 1, id="plain-0-1rank"),
    pytest.param("plain", "2", 1, id="plain-2-1rank"),
    pytest.param("plain", "0", 2, id="plain-0-2ranks"),
    pytest.param("stateful", "2", 2, id="stateful-2-2ranks"),
    pytest.param("plain", "2", 2, id="plain-2-2ranks"),
]


@pytest.mark.slow
@pytest.mark.long
@pytest.mark.parametrize(("loader", "workers", "ranks"), SHUFFLED_HF)
def test_a_shuffled_hugging_face_stream_whose_state_leaves_out_its_buffer_stops_until_the_user_accepts(
    loader, workers, ranks, tmp_path
):
    """``.shuffle(seed, buffer_size)``: Hugging Face's ``state_dict`` keeps the shards' position, not the samples in
    the shuffle buffer (its docs say so), so the resumed stream gives other samples (in a plain ``DataLoader`` the
    engine 1.4.0 went on with them: 4 samples skipped, max |delta| 1.0, the start line said ``not verified``). The
    resume stops in one line at its first batch, before training on it (the fingerprint of the batch the
    checkpoint's run fetched next differs), on each rank; ``--run.stream_resume as_saved`` continues from the
    stream's own state, and its start line says ``no``; on another number of ranks it is refused in one line. In
    loader workers the state does not even load back (``datasets`` 5.2: an ``IndexError`` in the worker, a
    traceback under engine 1.4.0): the resume stops in one line, ``as_saved`` too."""
    n = ["--data.n_train", "194"] if ranks == 2 else []
    flags = ["--trainer.max_epochs", "2", "--data.loader", loader, "--data.source", "hf_shuffled",
             "--data.num_workers", workers, *n]  # fmt: skip
    name = "StatefulDataLoader" if loader == "stateful" else "IterableDataset"
    resumed = tmp_path / "resumed-shuffled"
    resumed.mkdir()
    args = [*config(tmp_path), *flags, *(DDP2 if ranks == 2 else []), *record(resumed)]
    assert cli("fit", *args, *kill_at(30, settle=True), cwd=resumed, check=False).returncode != 0
    assert last(resumed)["global_step"] == 27
    differs = "its first batch after the resume differs from the batch the checkpoint's run had fetched next"
    unloaded = "it failed at its first batches after loading the state the checkpoint kept of it (Caught IndexError"

    def stopped(proc) -> None:
        errors = [x for x in proc.stderr.splitlines() if x.startswith("error: ")]
        stop = f"error: train loader 0 ({name}): " + (differs if workers == "0" else unloaded)
        other = "error: another rank's train loader gave other samples after the resume"
        assert errors and all(x.startswith((stop, other)) for x in errors), proc.stderr[-3000:]
        assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
        assert last(resumed)["global_step"] == 27  # nothing trained, nothing saved

    stopped(cli("fit", *args, "--ckpt_path", "last", cwd=resumed, check=False))
    if ranks == 2:
        refused_on_one_rank(tmp_path, flags, name, restart=False)
    proc = cli("fit", *args, "--ckpt_path", "last", "--run.stream_resume", "as_saved", cwd=resumed, check=False)
    if workers != "0":  # its state does not load back in a worker: nothing to continue from
        stopped(proc)
        return
    line = next(x for x in proc.stdout.splitlines() if x.startswith("Run "))
    assert f"exact resume: no: train loader 0 ({name}): its first batch after the resume" in line, line
    assert proc.returncode == 0 and last(resumed)["global_step"] > 27


@pytest.mark.slow
@pytest.mark.long  # CI and make test-all; the loaders' states loaded after Lightning's estimate: test_compat, make test
@pytest.mark.parametrize(
    "flags",
    [["--data.source", "map", "--trainer.max_epochs", "2"],
     ["--data.source", "tokens", "--data.loader", "stateful", "--data.state", "true", "--trainer.max_steps", "50"]],
    ids=["map-dataloader", "stream-statefuldataloader"],
)  # fmt: skip
def test_a_module_that_reads_estimated_stepping_batches_resumes_its_loaders_exactly(flags, tmp_path):
    """``OneCycleLR(total_steps=trainer.estimated_stepping_batches)`` in ``configure_optimizers``: Lightning builds the
    train loaders before it restores the checkpoint and then never loads their saved state (Lightning #20550). The
    engine's loaders and those that keep their own position load theirs as their iterator starts."""
    *seen, line, _ = killed_and_resumed(tmp_path, 30, 27, "--model.one_cycle", "true", *flags)
    assert seen == [0, 0, 0, 0.0], seen
    assert "exact resume: resume verified" in line, line


@pytest.mark.slow
@pytest.mark.parametrize(
    ("sampler", "workers"),
    [
        ("own", "0"),
        pytest.param("counting", "2", marks=pytest.mark.long),
        pytest.param("buckets", "0", marks=pytest.mark.long),
    ],
)
def test_a_killed_fit_of_a_loader_with_its_own_sampler_resumes_in_its_order_after_the_batches_trained_on(
    sampler, workers, tmp_path
):
    """A user's own sampler (a shuffle from torch's global generator; one with a state_dict) or batch sampler in a
    plain DataLoader restarted its epoch on a resume: its order is drawn again from the epoch's start and the batches
    trained on are dropped as indices."""
    # 97 samples in batches of 4: 25 steps an epoch; killed at step 30, resumed at step 27 (epoch 1, batch 2)
    flags = ["--trainer.max_epochs", "2", "--data.source", "map", "--data.sampler", sampler,
             "--data.num_workers", workers]  # fmt: skip
    *seen, line, _ = killed_and_resumed(tmp_path, 30, 27, *flags)
    assert seen == [0, 0, 0, 0.0], seen
    name = {"own": "Shuffled", "counting": "CountingShuffled", "buckets": "Buckets"}[sampler]
    assert (
        f"exact resume: resume verified (train loader 0 ({name}): its first batch's indices are those the "
        "checkpoint's run drew next, its order drawn again and fast-forwarded past the batches trained on)"
    ) in line, line
    assert f"streams: train loader 0 ({name}): resumed after the 2 batches of epoch 1 trained on" in line, line
    if workers != "0":  # what is not checked is named: the workers' draws
        assert "opts out: train loader 0: random draws in its 2 workers (augmentation) start again" in line, line
    else:
        assert "opts out" not in line, line


@pytest.mark.slow
@pytest.mark.long
def test_a_killed_two_rank_fit_with_its_own_sampler_resumes_each_rank_in_its_order_and_refuses_one_rank(tmp_path):
    """Under DDP Lightning wraps the user's sampler in its ``DistributedSamplerWrapper``: each rank's order is drawn
    again from its own generators and fast-forwarded; a resume on 1 rank stops in one line before anything trains."""
    flags = ["--trainer.max_epochs", "2", "--data.n_train", "194", "--data.source", "map", "--data.sampler", "own",
             "--data.num_workers", "2"]  # fmt: skip
    *seen, line, _ = killed_and_resumed(tmp_path, 30, 27, *flags, *DDP2)
    assert seen == [0, 0, 0, 0.0], seen
    assert "(train loader 0 (Shuffled): its first batch's indices on 2 ranks are those the checkpoint's run" in line
    assert "streams: train loader 0 (Shuffled): resumed on each of 2 ranks after the 2 batches of epoch 1" in line
    resumed = next(tmp_path.glob("resumed-*"))
    step = last(resumed)["global_step"]
    proc = cli("fit", *config(tmp_path), *flags, "--trainer.max_epochs", "3", "--ckpt_path", "last", cwd=resumed,
               check=False)  # fmt: skip
    (error,) = [x for x in proc.stderr.splitlines() if "the checkpoint holds the loader positions" in x]
    assert error.startswith(
        "error: train loader 0 (Shuffled): the checkpoint holds the loader positions of 2 rank(s), this run has 1: "
        "each rank reads its own share of the data from its own position, so resume on 2 rank(s), or with "
        "--run.stream_resume restart"
    ), error
    assert proc.returncode != 0 and "Traceback" not in proc.stderr and last(resumed)["global_step"] == step


@pytest.mark.slow
@pytest.mark.long
def test_a_sampler_whose_order_cannot_be_drawn_again_stops_the_resume_until_the_user_chooses(tmp_path):
    """A sampler that draws its order from ``os.urandom``: drawn again, the next batch's indices differ from the
    checkpoint's record, so the resume stops in one line before training; ``as_saved`` continues in the new order
    (the start line says ``no``), ``restart`` restarts the epoch (named in opts out)."""
    flags = ["--trainer.max_epochs", "2", "--data.source", "map", "--data.sampler", "urandom"]
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    args = [*config(tmp_path), *flags]
    assert cli("fit", *args, *kill_at(30, settle=True), cwd=resumed, check=False).returncode != 0
    proc = cli("fit", *args, "--ckpt_path", "last", cwd=resumed, check=False)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert ("error: train loader 0 (Shuffled): drawn again from the epoch's start, its next batch's indices differ "
            "from those the checkpoint's run drew") in proc.stderr, proc.stderr[-3000:]  # fmt: skip
    assert last(resumed)["global_step"] == 27  # nothing trained, nothing saved
    proc = cli("fit", *args, "--ckpt_path", "last", "--run.stream_resume", "as_saved", cwd=resumed)
    line = next(x for x in proc.stdout.splitlines() if x.startswith("Run "))
    assert "exact resume: no: train loader 0 (Shuffled): its first batch's indices after the resume differ" in line
    assert last(resumed)["global_step"] == 50


ONE = ["--trainer.accelerator", "cpu", "--trainer.devices", "1", "--trainer.strategy", "auto"]


def trained_on(cwd: Path, saved: int) -> Counter:
    """The sample ids the runs in ``cwd`` trained on, each as often as it was: the killed run's steps from ``saved``
    on are left out (the resumed run, which appends after it in rank 0's file, trained them again)."""
    counts: Counter = Counter()
    for path in cwd.glob("ids.rank*.jsonl"):
        resumed, previous = False, -1
        for line in path.read_text().splitlines():
            _, step, ids = json.loads(line)
            resumed = resumed or step < previous  # rank 0's file: the resumed run starts again at `saved`
            previous = step
            if resumed or step < saved:
                counts.update(ids)
    return counts


@pytest.mark.slow
@pytest.mark.long
def test_a_two_rank_fit_of_a_map_style_stateful_dataloader_killed_mid_epoch_resumes_on_one_rank_in_its_order(
    tmp_path,
):
    flags = ["--trainer.max_epochs", "2", "--data.n_train", "194", "--data.loader", "stateful", "--data.source", "map",
             "--data.num_workers", "2"]  # fmt: skip
    reference, resumed = tmp_path / "reference", tmp_path / "resumed"
    reference.mkdir(), resumed.mkdir()
    args = [*config(tmp_path), *flags]
    cli("fit", *args, *DDP2, *record(reference), cwd=reference)
    proc = cli("fit", *args, *DDP2, *record(resumed), *kill_at(30, settle=True), cwd=resumed, check=False)
    assert proc.returncode != 0 and last(resumed)["global_step"] == 27, proc.stderr[-2000:]  # epoch 1, batch 2
    proc = cli("fit", *args, *ONE, *record(resumed), "--ckpt_path", "last", cwd=resumed)
    line = next(x for x in proc.stdout.splitlines() if x.startswith("Run "))
    expected, got = trained_on(reference, 10**9), trained_on(resumed, 27)
    twice, skipped = sum((got - expected).values()), sum((expected - got).values())
    print(f"2 -> 1 rank(s): seen twice {twice}, skipped {skipped}\n{line}")
    assert (twice, skipped) == (0, 0) and sum(got.values()) == 2 * 200  # 2 epochs of 194, padded to 8 a step
    assert "elastic: 2 -> 1 rank(s): accumulate_grad_batches 1 -> 2 keeps the global batch of 8 samples" in line, line
    assert "exact resume: resume verified (epoch 1, batch 4: its 4 samples, the first of the checkpoint's 8" in line
    assert last(resumed)["global_step"] == last(reference)["global_step"] == 50


@pytest.mark.parametrize("persistent", [False, True])
def test_a_loader_with_its_own_sampler_resumed_mid_epoch_gives_the_rest_of_the_uninterrupted_order(persistent):
    """``own_orders`` alone, in this process: a loader with a user's shuffle (torch's global generator) and two
    persistent or fresh workers; a position taken after 3 batches resumes a new loader at batch 3 of the same order,
    the global generators left as they were."""
    from torch.utils.data import DataLoader

    from lightkeep.own_orders import OwnOrder, ReplaysOwnOrder
    from tests.fixtures.streams import Shuffled, TokenSet

    epoch = [0]

    def loader(position: OwnOrder) -> DataLoader:
        cls = type("Loader", (ReplaysOwnOrder, DataLoader), {"position": position})
        return cls(TokenSet(30, 2), sampler=Shuffled(30), batch_size=4, num_workers=2, persistent_workers=persistent)

    def ids(batches) -> list[list[int]]:
        return [b["id"].tolist() for b in batches]

    torch.manual_seed(3)
    first = OwnOrder("train loader 0 (Shuffled)", lambda: epoch[0], strict=True)
    uninterrupted = loader(first)
    it = iter(uninterrupted)
    head = ids(next(it) for _ in range(3))
    first.take(3)
    saved = first.taken
    tail = ids(it)

    torch.manual_seed(99)  # the resumed process's generators: the checkpoint's, not the epoch's start
    epoch[0] = 0
    resumed_position = OwnOrder("train loader 0 (Shuffled)", lambda: epoch[0], strict=True)
    resumed_position.restore = saved
    resumed = loader(resumed_position)
    state = torch.get_rng_state()
    rest = ids(resumed)
    assert torch.equal(torch.get_rng_state(), state)  # the draw again left the checkpoint's generators as they were
    assert rest == tail and resumed_position.problem is None and resumed_position.first == saved["next"]
    assert sorted(i for batch in head + rest for i in batch) == list(range(30))
