"""A user's own LightningModule and DataModule with plain DataLoaders (tests/fixtures/byo.py), through the real CLI:
mid-epoch resumes are bit-exact and DDP evaluation sees each sample once, with nothing imported from the template."""

import pytest
import torch
from lightning.pytorch import Trainer
from torch.utils.data import (
    DataLoader,
    DistributedSampler,
    SequentialSampler,
    SubsetRandomSampler,
    TensorDataset,
    WeightedRandomSampler,
)

from lightkeep.loaders import ResumableSampler
from lightkeep.user_loaders import engine_loader
from tests.faults import kill_at
from tests.helpers import DDP2, QUIET, cli, cli_in_process, max_abs_diff, run_dirs, scalars

N_VAL = 37  # validation samples: indices 0..36, whose sum is 666


def config(tmp_path, checkpoint: dict) -> list[str]:
    """The fixture model and data, and one ModelCheckpoint that writes last.ckpt as ``checkpoint`` says."""
    path = tmp_path / "byo.yaml"
    options = "".join(f"        {k}: {v}\n" for k, v in checkpoint.items())
    path.write_text(
        "trainer:\n  callbacks:\n    - class_path: lightning.pytorch.callbacks.ModelCheckpoint\n      init_args:\n"
        f"        save_top_k: 0\n        save_last: true\n        enable_version_counter: false\n{options}"
        "model:\n  class_path: tests.fixtures.byo.MyModel\ndata:\n  class_path: tests.fixtures.byo.MyData\n"
    )
    # batch_size too: the base config's data.init_args.batch_size (64) carries over to any data class that has one
    return ["--config", str(path), *QUIET, "--data.n_train", "96", "--data.batch_size", "8", "--run.monitor", "null"]


EVERY_4_STEPS = {"every_n_train_steps": 4}  # 12 batches an epoch: steps 4, 8 are mid-epoch, 12 an epoch's end
EVERY_EPOCH = {"every_n_epochs": 1}
# At each epoch's last batch end (every_n_epochs with save_top_k 0 and no monitor wrote no last.ckpt before the end)
EPOCH_END = {"every_n_train_steps": 12}


def last(runs) -> dict:
    """The last.ckpt of the one run under the runs folder ``runs`` (the fixture's data names it ``my``)."""
    (run,) = (runs / "my").glob("version_*")
    return torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)


def final_difference(reference, resumed) -> float:
    """The largest difference between two runs' final weights and optimizer states (runs folders)."""
    ref, got = last(reference), last(resumed)
    assert got["global_step"] == ref["global_step"]
    diff = max(max_abs_diff(ref["state_dict"], got["state_dict"]), max_abs_diff(ref["optimizer_states"],
                                                                             got["optimizer_states"]))  # fmt: skip
    print(f"max |delta| of weights and optimizer state: {diff}")
    return diff


def batches_done(runs) -> tuple[int, int]:
    """(global step, batches of its epoch done) of the run's last.ckpt."""
    saved = last(runs)
    return saved["global_step"], saved["loops"]["fit_loop"]["epoch_loop.batch_progress"]["current"]["completed"]


def test_a_crashed_fit_of_plain_loaders_resumes_mid_epoch_bitwise_equal(tmp_path):
    args = [*config(tmp_path, EVERY_4_STEPS), "--trainer.max_epochs", "2"]
    cli_in_process("fit", *args, root=tmp_path / "reference")
    with pytest.raises(RuntimeError, match="injected crash"):
        cli_in_process("fit", *args, "--trainer.callbacks+=tests.faults.CrashAt", "--trainer.callbacks.step=18",
                       root=tmp_path / "resumed")  # fmt: skip
    step, done = batches_done(tmp_path / "resumed")
    assert step == 16 and 0 < done < 12  # mid-epoch: epoch 1, 4 of 12 batches
    cli = cli_in_process("fit", *args, "--ckpt_path", "last", root=tmp_path / "resumed")
    assert "train_dataloader" not in vars(cli.datamodule)  # the engine's wrappers are gone after the run
    assert final_difference(tmp_path / "reference", tmp_path / "resumed") == 0


class MyLoader(DataLoader):
    """A user's DataLoader subclass: the engine rebuilds it as its own class."""


@pytest.mark.parametrize("kind", ["shuffle", "shuffle+generator", "sequential", "subset", "weighted", "distributed"])
def test_each_kind_of_sampler_is_replaced_by_one_that_draws_from_seed_and_epoch(kind, monkeypatch):
    data = TensorDataset(torch.arange(30))
    samplers = {
        "shuffle": None,
        "shuffle+generator": None,
        "sequential": SequentialSampler(data),
        "subset": SubsetRandomSampler(list(range(5, 20))),
        "weighted": WeightedRandomSampler(torch.linspace(0.1, 1, 30), 25),
        "distributed": DistributedSampler(data, num_replicas=1, rank=0, seed=3),
    }
    trainer = Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False)

    def epoch(seed: int, number: int) -> list[int]:
        monkeypatch.setenv("PL_GLOBAL_SEED", str(seed))
        generator = torch.Generator().manual_seed(123) if kind == "shuffle+generator" else None
        sampler = samplers[kind]
        user = MyLoader(data, batch_size=4, shuffle=sampler is None, sampler=sampler, generator=generator)
        loader, note = engine_loader(user, trainer, "train")
        assert note is None and isinstance(loader, MyLoader) and isinstance(loader.sampler, ResumableSampler)
        assert hasattr(loader, "state_dict") and loader.batch_size == 4
        loader.sampler.set_epoch(number)
        return [i for (batch,) in loader for i in batch.tolist()]

    first = epoch(0, 0)
    assert epoch(0, 0) == first  # a pure function of (seed, epoch)
    # padded to a multiple of the global batch (4 here) by the order's first indices, whatever the number of ranks
    size = {"subset": 15, "weighted": 25}.get(kind, 30)
    assert len(first) % 4 == 0 and first[size:] == first[: len(first) - size]
    first, padding = first[:size], first[size:]
    if kind == "sequential":
        assert first == list(range(30)) and first + padding == epoch(0, 1)
        return
    assert epoch(0, 1)[: len(first)] != first
    # the user's DistributedSampler keeps its own seed, and a generator of the loader's own its own
    assert (epoch(1, 0)[: len(first)] != first) == (kind not in ("distributed", "shuffle+generator"))
    if kind == "subset":
        assert sorted(first) == list(range(5, 20))
    elif kind == "weighted":
        assert len(first) == 25 and isinstance(samplers[kind], WeightedRandomSampler)
    else:
        assert sorted(first) == list(range(30))
    if kind.startswith("shuffle"):  # what Lightning's DistributedSampler would draw: randperm seeded with seed + epoch
        seed = 123 if kind == "shuffle+generator" else 0  # the generator's seed, as torch's RandomSampler takes it
        assert first == torch.randperm(30, generator=torch.Generator().manual_seed(seed)).tolist()


def test_a_resume_keeps_the_seed_its_run_drew_the_order_with(monkeypatch):
    trainer = Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False)
    data = TensorDataset(torch.arange(30))
    monkeypatch.setenv("PL_GLOBAL_SEED", "5")
    first, _ = engine_loader(DataLoader(data, batch_size=4, shuffle=True), trainer, "train")
    it = iter(first)
    head = [next(it)[0].tolist() for _ in range(2)]
    state = first.state_dict()
    monkeypatch.setenv("PL_GLOBAL_SEED", "6")  # seed_everything: true draws another seed for the resumed run
    resumed, _ = engine_loader(DataLoader(data, batch_size=4, shuffle=True), trainer, "train")
    resumed.load_state_dict(state)
    order = torch.randperm(30, generator=torch.Generator().manual_seed(5))
    expected = torch.cat([order, order[:2]]).split(4)  # padded to the global batch of 4
    assert head + [b.tolist() for (b,) in resumed] == [b.tolist() for b in expected]


EXACT = "yes, also mid-epoch (each resume checks its first batch)"  # a fresh run's promise


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        # the user's own sampler: its order is drawn again on a resume (lightkeep.own_orders), unless restart
        (["--data.train_sampler", "own"], f"exact resume: {EXACT} | streams: train loader 0 (EveryOtherSampler): a "
                                          "mid-epoch resume draws its order again, past the batches trained on"),
        (["--data.train_sampler", "own", "--run.stream_resume", "restart"],
         "train loader 0: its sampler EveryOtherSampler is the user's own: a mid-epoch resume restarts that epoch's "
         "data"),
        # a stream without state is fast-forwarded (lightkeep.stream_resume), checked against its fingerprint
        (["--data.train_sampler", "stream"], f"exact resume: {EXACT} | streams: train loader 0 (Stream), "
                                             "no state_dict: a mid-epoch resume fast-forwards it"),
        (["--data.train_sampler", "weighted"], f"exact resume: {EXACT}"),
        (["--data.val_sampler", "own"], f"exact resume: {EXACT}"),  # one rank: each sample once
    ],
)  # fmt: skip
def test_the_start_line_names_each_loader_the_engine_cannot_make_exact(flags, expected, tmp_path, capsys):
    args = [*config(tmp_path, EVERY_EPOCH), "--trainer.max_epochs", "1", "--trainer.limit_train_batches", "2", *flags]
    cli_in_process("fit", *args, root=tmp_path)
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("Run "))
    assert expected in line, line
    assert "make_loader" not in line


def validated(cwd, devices: int, *flags: str) -> tuple[dict[str, float], str]:
    """``validate`` of the fixture on ``devices`` CPU ranks: the logged metrics and the start line."""
    ranks = [*DDP2[:2], "--trainer.devices", str(devices)] + (["--trainer.strategy", "ddp"] if devices > 1 else [])
    proc = cli("validate", *config(cwd, EVERY_EPOCH), *ranks, "--data.n_val", str(N_VAL), *flags, cwd=cwd)
    line = next(x for x in proc.stdout.splitlines() if x.startswith("Run "))
    logged = {tag: values[-1][1] for tag, values in scalars(run_dirs(cwd, "my")[-1]).items()}
    return logged, line


@pytest.mark.slow
@pytest.mark.long
def test_validate_on_1_2_and_3_ranks_sees_each_sample_once(tmp_path):
    results = {}
    for devices in (1, 2, 3):
        (tmp_path / str(devices)).mkdir()
        results[devices], line = validated(tmp_path / str(devices), devices)
        assert "opts out" not in line, line
    print({d: (r["seen/index_sum"], r["seen/count"], r["seen/mse"]) for d, r in results.items()})
    for devices in (1, 2, 3):
        assert results[devices]["seen/count"] == N_VAL and results[devices]["seen/index_sum"] == N_VAL * 35 / 2 + 18.5
        for tag in ("seen/index_sum", "seen/count", "seen/mse"):
            assert results[devices][tag] == pytest.approx(results[1][tag], rel=1e-6), (devices, tag)


@pytest.mark.slow
@pytest.mark.long  # CI and make test-all; what validate under DDP cannot split is named: the test below, make test
def test_validate_under_ddp_names_a_sampler_it_cannot_replace(tmp_path):
    logged, line = validated(tmp_path, 2, "--data.val_sampler", "own")
    assert (
        "opts out: val loader 0: its sampler EveryOtherSampler is the user's own: Lightning's DistributedSampler "
        "pads it over 2 ranks, so validation counts a few samples twice"
    ) in line, line
    assert logged["seen/count"] == 20  # the 19 samples of EveryOtherSampler, one of them twice


@pytest.mark.slow
def test_validate_under_ddp_without_lightnings_sampler_names_that_each_rank_sees_every_sample(tmp_path):
    logged, line = validated(tmp_path, 2, "--trainer.use_distributed_sampler", "false")
    assert (
        "opts out: val loader 0: use_distributed_sampler is off: each of the 2 ranks gets every sample, so "
        "validation counts samples up to 2 times"
    ) in line, line
    # what the line warns of, counted: every sample on each rank, the sums over both ranks
    assert logged["seen/count"] == 2 * N_VAL and logged["seen/index_sum"] == 2 * (N_VAL * 35 / 2 + 18.5)


@pytest.mark.slow
@pytest.mark.long  # CI and make test-all; plain loaders killed mid-epoch: tests/test_resume.py and the crash above
@pytest.mark.parametrize(("checkpoint", "kill", "saved"), [(EVERY_4_STEPS, 18, 16), (EPOCH_END, 28, 24)])
def test_a_killed_fit_of_plain_loaders_resumes_bitwise_equal(checkpoint, kill, saved, tmp_path):
    reference, resumed = tmp_path / "reference", tmp_path / "resumed"
    reference.mkdir()
    resumed.mkdir()
    args = [*config(tmp_path, checkpoint), "--trainer.max_epochs", "3"]
    if checkpoint is EPOCH_END:  # the engine's every-2-epochs file of step 24 would make last.ckpt that point's one
        args += ["--checkpoints.every_n_epochs", "null"]  # file, holding the state after the epoch ended (done 12)
    cli("fit", *args, cwd=reference)
    proc = cli("fit", *args, *kill_at(kill, settle=True), cwd=resumed, check=False)
    assert proc.returncode == -9, proc.stderr[-2000:]
    step, done = batches_done(resumed / "runs")  # done: 11 at the last batch's end (counted after the save)
    assert step == saved and (0 < done < 11 if checkpoint is EVERY_4_STEPS else done == 11), (step, done)
    cli("fit", *args, "--ckpt_path", "last", cwd=resumed)
    assert final_difference(reference / "runs", resumed / "runs") == 0


@pytest.mark.slow
@pytest.mark.long  # make test kills and resumes 2 ranks in tests/test_resume.py
def test_a_killed_two_rank_ddp_fit_of_plain_loaders_resumes_mid_epoch_bitwise_equal(tmp_path):
    reference, resumed = tmp_path / "reference", tmp_path / "resumed"
    reference.mkdir()
    resumed.mkdir()
    args = [*config(tmp_path, EVERY_4_STEPS), *DDP2, "--trainer.max_epochs", "4"]  # 48 per rank: 6 batches an epoch
    cli("fit", *args, cwd=reference)
    proc = cli("fit", *args, *kill_at(19, settle=True), cwd=resumed, check=False)
    assert proc.returncode != 0, proc.stderr[-2000:]
    step, done = batches_done(resumed / "runs")
    assert step == 16 and 0 < done < 6, (step, done)  # epoch 2, 4 of 6 batches
    cli("fit", *args, "--ckpt_path", "last", cwd=resumed)
    assert final_difference(reference / "runs", resumed / "runs") == 0


def test_torchdatas_stateful_samplers_are_a_plain_shuffle_only_as_one_permutation_of_every_sample():
    from torchdata.stateful_dataloader.sampler import BatchSampler, RandomSampler

    from lightkeep.user_loaders import _torchdata_plain

    data = TensorDataset(torch.arange(10))
    assert _torchdata_plain(RandomSampler(data)) and _torchdata_plain(RandomSampler(data, num_samples=10))
    assert not _torchdata_plain(RandomSampler(data, num_samples=4))  # a part of the samples each epoch
    assert not _torchdata_plain(RandomSampler(data, num_samples=25))  # more than one permutation
    assert not _torchdata_plain(RandomSampler(data, replacement=True))
    assert _torchdata_plain(BatchSampler(RandomSampler(data), 3, False))
    assert not _torchdata_plain(torch.utils.data.RandomSampler(data))  # torch's own is another path
