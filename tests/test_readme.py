"""The README's own-model example, as a newcomer follows it: the Python block it names ``my_pkg.py`` written, verbatim,
into the folder the commands run in (the README says ``python -m`` imports it from there), its training command run
through the real CLI and killed with SIGKILL mid-epoch, then its resume line. The resumed run ends with the weights and
optimizer state of the same command run uninterrupted, bit for bit, and its start line says the resume was verified.
Nothing of the example is copied here: a change to the README that breaks it fails this test."""

import importlib.util
import re
import shlex
from pathlib import Path

import pytest
import torch

from tests.helpers import PROGRAM, QUIET, REPO, run_cli, run_dirs

pytestmark = pytest.mark.slow  # three real fits in subprocesses (~25 s)

README = REPO / "README.md"
FILE_LINE = re.compile(r"# (\w+\.py)\b")  # a block's first line naming the file it is: `# my_pkg.py: ...`


def example_files(readme: str) -> dict[str, str]:
    """The README's ```python blocks whose first line names a file: {file name: the block, verbatim}."""
    blocks = re.findall(r"^```python\n(.*?)^```", readme, re.M | re.S)
    return {named[1]: block for block in blocks if (named := FILE_LINE.match(block))}


def example_commands(readme: str) -> tuple[list[str], list[str]]:
    """The README's command that trains its example (``--model my_pkg...``) and the one that resumes it."""
    blocks = re.findall(r"^```bash\n(.*?)^```", readme, re.M | re.S)
    lines = [line for block in blocks for line in block.splitlines() if "--model my_pkg." in line]
    commands = [shlex.split(line, comments=True) for line in lines]
    train = [c for c in commands if "--ckpt_path" not in c]
    resume = [c for c in commands if c[-2:] == ["--ckpt_path", "last"]]
    assert len(train) == 1 and len(resume) == 1, f"README: one training and one resume line for my_pkg: {lines}"
    return train[0], resume[0]


def run(command: list[str], folder: Path, *extra: str, check: bool = True):
    """A README command line (``python -m PROGRAM ARGS``) in ``folder``, with ``extra`` arguments after its own."""
    assert command[:3] == ["python", "-m", PROGRAM], command  # the project's own CLI, as a copy renames it
    return run_cli(PROGRAM, *command[3:], *QUIET, *extra, cwd=folder, pythonpath=str(REPO), check=check)


def the_run(folder: Path) -> Path:
    (run_dir,) = [d for name in (folder / "runs").iterdir() for d in run_dirs(folder, name.name)]
    return run_dir


def max_delta(a: object, b: object) -> float:
    """The largest |a - b| over the tensors of two checkpoint entries of one structure (0.0: bit-equal)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.shape == b.shape
        return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0
    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys()
        return max((max_delta(a[k], b[k]) for k in a), default=0.0)
    if isinstance(a, list | tuple):
        assert isinstance(b, list | tuple) and len(a) == len(b)
        return max((max_delta(x, y) for x, y in zip(a, b, strict=True)), default=0.0)
    assert a == b, f"{a!r} != {b!r}"
    return 0.0


def summary(proc) -> str:
    return next(line for line in proc.stdout.splitlines() if line.startswith("Run summary:"))


def test_the_readmes_own_model_killed_mid_epoch_resumes_with_its_resume_line_bit_equal(tmp_path):
    readme = README.read_text()
    files = example_files(readme)
    assert "my_pkg.py" in files, f"README: no ```python block whose first line is '# my_pkg.py': {sorted(files)}"
    train, resume = example_commands(readme)
    assert importlib.util.find_spec("my_pkg") is None, "precondition: my_pkg imports from the run's folder only"
    whole, killed = tmp_path / "uninterrupted", tmp_path / "killed"
    for folder in (whole, killed):
        folder.mkdir()
        for name, text in files.items():
            (folder / name).write_text(text)

    reference = run(train, whole)
    ref = torch.load(the_run(whole) / "checkpoints" / "last.ckpt", weights_only=True)
    epochs, steps = ref["epoch"], ref["global_step"]
    assert epochs >= 2 and steps % epochs == 0, f"precondition: whole epochs of equal steps ({steps} in {epochs})"
    per_epoch = steps // epochs
    kill = per_epoch * (epochs // 2) + per_epoch // 2  # the middle of an epoch in the run's second half
    assert kill % per_epoch > 0, f"precondition: step {kill} is mid-epoch ({per_epoch} steps an epoch)"

    # SIGKILL as the batch of step `kill` starts: no handler runs, nothing is saved (the engine's SignalAt, which a
    # copy of the template carries too)
    kill_at = ["--trainer.callbacks+=lightkeep.selfcheck.SignalAt", f"--trainer.callbacks.step={kill}",
               "--trainer.callbacks.sig=9"]  # fmt: skip
    proc = run(train, killed, *kill_at, check=False)
    assert proc.returncode == -9, proc.stderr[-3000:]
    saved = [torch.load(p, weights_only=True)["global_step"] for p in the_run(killed).glob("checkpoints/*.ckpt")]
    assert saved and max(saved) < kill, f"precondition: checkpoints before the kill at step {kill}: {sorted(saved)}"

    proc = run(resume, killed)
    start = next(line for line in proc.stdout.splitlines() if "exact resume:" in line)
    got = torch.load(the_run(killed) / "checkpoints" / "last.ckpt", weights_only=True)
    weights = max_delta(got["state_dict"], ref["state_dict"])
    optimizer = max_delta(got["optimizer_states"], ref["optimizer_states"])
    print(f"killed at step {kill} ({per_epoch} steps an epoch), newest checkpoint step {max(saved)}: max |delta| "
          f"weights {weights}, optimizer {optimizer} | {start}")  # fmt: skip
    assert got["global_step"] == steps and weights == 0.0 and optimizer == 0.0
    assert "exact resume: resume verified" in start, start
    assert summary(proc) == summary(reference)  # the same best checkpoint and score as the uninterrupted run
