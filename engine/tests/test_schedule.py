"""The LR schedule against the closed form of the issue and against pl_bolts' own recursive implementation, and
fitted to the length of a real run."""

import math

import lightning as L
import pytest
import torch

from lightkeep.schedule import FitScheduleToRun, LinearWarmupCosineAnnealingLR
from tests.fixtures.stand_in import SAMPLES, BlobsDataModule, StandIn
from tests.helpers import QUIET, cli_in_process, crash_in_process, max_abs_diff


def formula(t: int, b: float, w: int, m: int, ws: float, eta: float) -> float:
    """The curve as specified, written independently of lightkeep.schedule (edge cases as documented)."""
    if t < w:
        return ws + t * (b - ws) / (w - 1) if w >= 2 else ws
    if t >= m:
        return eta
    return eta + 0.5 * (b - eta) * (1 + math.cos(math.pi * (t - w) / (m - w)))


def pl_bolts_recursive(b: float, w: int, m: int, ws: float, eta: float, steps: int) -> list[float]:
    """pl_bolts' chained ``get_lr`` (copied logic), valid for W >= 2 and t <= M, where it is not broken."""
    lrs, lr = [], ws
    for t in range(steps):
        if t == 0:
            lr = ws
        elif t < w:
            lr = lr + (b - ws) / (w - 1)
        elif t == w:
            lr = b
        elif (t - 1 - m) % (2 * (m - w)) == 0:
            lr = lr + (b - eta) * (1 - math.cos(math.pi / (m - w))) / 2
        else:
            lr = (1 + math.cos(math.pi * (t - w) / (m - w))) / (1 + math.cos(math.pi * (t - w - 1) / (m - w))) * (
                lr - eta
            ) + eta
        lrs.append(lr)
    return lrs


def run(b: float, w: int, m: int, ws: float, eta: float, steps: int) -> list[float]:
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=b)
    sched = LinearWarmupCosineAnnealingLR(opt, w, m, warmup_start_lr=ws, eta_min=eta)
    lrs = []
    for _ in range(steps):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return lrs


CASES = [  # (base, W, M, warmup_start_lr, eta_min)
    (2e-4, 15, 150, 0.0, 0.0),  # the blog
    (1e-3, 5, 40, 1e-5, 1e-6),
    (0.1, 2, 3, 0.0, 0.01),
    (0.1, 0, 10, 0.0, 0.0),  # no warmup: starts at base
    (0.1, 1, 10, 0.01, 0.0),  # one warmup step
    (0.1, 10, 10, 0.0, 0.001),  # no cosine phase
    (0.1, 0, 0, 0.0, 0.002),
]


@pytest.mark.parametrize(("b", "w", "m", "ws", "eta"), CASES)
def test_lr_equals_formula_at_every_step_including_past_max(b, w, m, ws, eta):
    steps = m + 25  # past M the rate must stay at eta_min (pl_bolts climbs back up)
    got = run(b, w, m, ws, eta, steps)
    for t, lr in enumerate(got):
        assert lr == pytest.approx(formula(t, b, w, m, ws, eta), rel=1e-12, abs=1e-15), t


@pytest.mark.parametrize(("b", "w", "m", "ws", "eta"), [c for c in CASES if c[1] >= 2 and c[2] > c[1]])
def test_matches_pl_bolts_where_pl_bolts_is_defined(b, w, m, ws, eta):
    assert run(b, w, m, ws, eta, m + 1) == pytest.approx(pl_bolts_recursive(b, w, m, ws, eta, m + 1), rel=1e-9)


def test_edge_cases_named_in_the_issue():
    assert run(0.1, 0, 10, 0.0, 0.0, 1) == [0.1]  # W = 0: first step at the base rate
    assert run(0.1, 1, 10, 0.0, 0.0, 2) == [0.0, 0.1]  # W = 1: one warmup step, then the base rate
    assert run(0.1, 5, 5, 0.0, 0.003, 8)[5:] == [0.003] * 3  # M = W: no division by zero
    assert min(run(0.1, 2, 6, 0.0, 0.0, 30)[6:]) == max(run(0.1, 2, 6, 0.0, 0.0, 30)[6:]) == 0.0  # t > M


def test_closed_form_survives_state_dict_round_trip():
    """A scheduler rebuilt from a state_dict at step t continues with exactly the rates of the original."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    sched = LinearWarmupCosineAnnealingLR(opt, 3, 20)
    for _ in range(7):
        opt.step()
        sched.step()
    state = sched.state_dict()
    opt2 = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    opt2.load_state_dict(opt.state_dict())
    sched2 = LinearWarmupCosineAnnealingLR(opt2, 3, 20)
    sched2.load_state_dict(state)
    uninterrupted = run(0.1, 3, 20, 0.0, 0.0, 25)
    for t in range(7, 25):
        assert opt2.param_groups[0]["lr"] == uninterrupted[t]  # bitwise
        opt2.step()
        sched2.step()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"warmup_epochs": 20, "max_epochs": 10}, r"warmup_epochs \(20\) must be <= max_epochs \(10\)"),
        ({"warmup_epochs": -1, "max_epochs": 10}, "must be >= 0"),
        ({"warmup_epochs": 1, "max_epochs": 10, "eta_min": -1.0}, r"eta_min \(-1.0\) must be >= 0"),
        ({"warmup_epochs": 1, "max_epochs": 10, "warmup_start_lr": -1.0}, "warmup_start_lr"),
    ],
)
def test_invalid_arguments_raise_clear_value_error(kwargs, message):
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    with pytest.raises(ValueError, match=message):
        LinearWarmupCosineAnnealingLR(opt, **kwargs)


STEPS_PER_EPOCH = math.ceil((SAMPLES - 2 * int(SAMPLES * 0.15)) / 64)  # the stand-in's train split in batches of 64


@pytest.mark.parametrize(
    ("trainer_kwargs", "warmup", "steps", "warmup_steps"),
    [
        ({"max_epochs": 1}, 15, STEPS_PER_EPOCH, STEPS_PER_EPOCH),  # warmup 15 epochs > the run: shortened to it
        ({"fast_dev_run": 2}, 15, 2, 2),
        ({"max_epochs": -1, "max_steps": 7}, 15, 7, 7),
        # max_steps ends it first: the schedule spans those steps, the 1-epoch warmup stays
        ({"max_epochs": 30, "max_steps": STEPS_PER_EPOCH + 5}, 1, STEPS_PER_EPOCH + 5, STEPS_PER_EPOCH),
    ],
)
def test_the_schedule_fits_a_run_shorter_than_its_warmup(trainer_kwargs, warmup, steps, warmup_steps, tmp_path):
    """FitScheduleToRun, on the stand-in (its warmup in epochs, stepped every optimizer step)."""
    lrs: list[float] = []

    class RecordLR(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, *_):
            lrs.append(trainer.optimizers[0].param_groups[0]["lr"])

    trainer = L.Trainer(
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        limit_val_batches=0, default_root_dir=tmp_path, callbacks=[RecordLR(), FitScheduleToRun()], **trainer_kwargs,
    )  # fmt: skip
    model = StandIn(lr=0.01, warmup=warmup)  # max_schedule None: the run's length
    trainer.fit(model, BlobsDataModule())
    scheduler = trainer.lr_scheduler_configs[0].scheduler
    assert trainer.global_step == steps == len(lrs)
    assert (scheduler.warmup_steps, scheduler.total_steps) == (warmup_steps, steps)
    # the closed form with the adapted horizon: linear from lr/W up to lr over the W warmup steps
    w = warmup_steps
    warmup = [0.01 / w + t * (0.01 - 0.01 / w) / max(1, w - 1) for t in range(w)]
    assert lrs[:w] == pytest.approx(warmup)
    assert all(lr < 0.01 for lr in lrs[w + 1 :])  # then the cosine decay, when the run is longer than the warmup


def test_a_schedule_saved_by_engine_1_4_resumes_at_its_horizon_in_steps():
    """Engine <= 1.4.0 saved the counts as given under ``warmup``/``max_schedule`` and the horizon in scheduler steps
    under ``warmup_epochs``/``max_epochs`` (now ``warmup_steps``/``total_steps``): its checkpoints still load, at
    the same rate (the closed form at the restored step)."""
    param = torch.nn.Parameter(torch.zeros(1))
    saved = LinearWarmupCosineAnnealingLR(torch.optim.SGD([param], lr=0.1), warmup_epochs=2, max_epochs=10)
    old = {k: v for k, v in saved.state_dict().items() if k not in ("warmup_steps", "total_steps")}
    old |= {"warmup": 2, "max_schedule": 10, "warmup_epochs": 6, "max_epochs": 30, "last_epoch": 7}  # 3 steps/epoch
    resumed = LinearWarmupCosineAnnealingLR(torch.optim.SGD([param], lr=0.1), warmup_epochs=2, max_epochs=10)
    resumed.load_state_dict(old)
    assert (resumed.warmup_epochs, resumed.max_epochs, resumed.warmup_steps, resumed.total_steps) == (2, 10, 6, 30)
    assert resumed.optimizer.param_groups[0]["lr"] == pytest.approx(formula(7, 0.1, 6, 30, 0.0, 0.0))


def test_a_schedule_in_epochs_resumes_on_its_runs_curve_when_the_epochs_change_length(tmp_path, capsys, caplog):
    """A curriculum (4, 5, 6, 6 batches in epochs 0-3: the train set grows, reloaded each epoch) under the stand-in's
    schedule in epochs, stepped every step. The resume from step 10 (epoch 2) fitted the schedule to its own epoch's
    6 steps where the run had counted 4: another LR curve from there, 1.28e-2 off the uninterrupted run under
    ``resume verified`` (measured). The checkpoint keeps the run's count: bit-equal, and the run says how it counts."""
    flags = [*QUIET, "--trainer.max_epochs", "4", "--trainer.limit_train_batches", "6", "--trainer.limit_val_batches",
             "1", "--model.warmup", "1", "--data", "tests.fixtures.curriculum.Curriculum",
             "--trainer.reload_dataloaders_every_n_epochs", "1", "--trainer.callbacks+=ModelCheckpoint",
             "--trainer.callbacks.every_n_train_steps=5", "--trainer.callbacks.save_top_k=0",
             "--trainer.callbacks.save_last=true", "--trainer.callbacks.enable_version_counter=false"]  # fmt: skip
    cli_in_process("fit", *flags, root=tmp_path / "reference")
    assert "LR schedule: an epoch is counted as 4 steps (the first epoch's)" in caplog.text
    with pytest.raises(RuntimeError, match="injected crash"):
        cli_in_process("fit", *flags, "--trainer.callbacks+=tests.faults.CrashAt", "--trainer.callbacks.step=13",
                       root=tmp_path / "resumed")  # fmt: skip
    last = {name: tmp_path / name / "curriculum" / "version_0" / "checkpoints" / "last.ckpt"
            for name in ("reference", "resumed")}  # fmt: skip
    saved = torch.load(last["resumed"], weights_only=True)
    assert (saved["global_step"], saved["epoch"]) == (10, 2)  # epoch 2 (6 batches) after epochs of 4 and 5
    capsys.readouterr()
    cli_in_process("fit", *flags, "--ckpt_path", "last", root=tmp_path / "resumed")
    start = [x for x in capsys.readouterr().out.splitlines() if x.startswith("Run /")][-1]
    assert "exact resume: resume verified" in start, start
    ref, got = (torch.load(last[name], weights_only=True) for name in ("reference", "resumed"))
    assert got["global_step"] == ref["global_step"] == 21
    assert max_abs_diff(got["state_dict"], ref["state_dict"]) == 0.0
    assert max_abs_diff(got["optimizer_states"], ref["optimizer_states"]) == 0.0


@pytest.mark.slow  # several real fits: make test runs it, make test-fast leaves it out
def test_a_resume_whose_learning_rate_is_not_the_checkpoints_says_no_with_both_rates(tmp_path, capsys):
    """A 4-epoch run (6 steps an epoch, warmup 1 epoch, the schedule spanning the run) killed after its step-8 save
    and resumed with ``max_epochs`` 6: the schedule is fitted to 36 steps where the checkpoint's run had 24, so step 9
    trains at another rate than the checkpoint's run would have. The data is the same, the start line says ``no``
    and gives both rates (the closed form's, not the engine's)."""
    flags = [*QUIET, "--trainer.max_epochs", "4", "--trainer.limit_train_batches", "6", "--trainer.limit_val_batches",
             "1", "--model.warmup", "1", "--trainer.callbacks+=ModelCheckpoint",
             "--trainer.callbacks.every_n_train_steps=4", "--trainer.callbacks.save_top_k=0",
             "--trainer.callbacks.save_last=true", "--trainer.callbacks.enable_version_counter=false"]  # fmt: skip
    last = crash_in_process(10, *flags, root=tmp_path)
    saved = torch.load(last, weights_only=True)
    was, now = (formula(8, 3e-3, 6, m, 3e-3 / 6, 0.0) for m in (24, 36))
    assert saved["global_step"] == 8 and saved["optimizer_states"][0]["param_groups"][0]["lr"] == pytest.approx(was)
    capsys.readouterr()
    cli_in_process("fit", *flags, "--ckpt_path", "last", "--trainer.max_epochs", "6", root=tmp_path)
    start = [x for x in capsys.readouterr().out.splitlines() if x.startswith("Run /")][-1]
    said = (
        f"exact resume: no: optimizer 0's param group 0 resumes at learning rate {now:.6g}, where the checkpoint's run "
        f"would have trained on at {was:.6g}"
    )
    assert said in start, start
