"""Which parts of a module the plain-value record covers (``lightkeep.plain_state``), without a fit: the run-level
behaviour (a count named at a resume, with both values) is in ``test_resume_epoch_start``."""

from types import SimpleNamespace

import lightning as L
import torch
from torch.ao.quantization import FakeQuantize
from torchmetrics import Metric

from lightkeep.plain_state import record_unsaved, unsaved_notes
from tests.fixtures.epoch_start import SampleWarmup


class Hits(Metric):
    """A metric of the user's own: its states are plain tensor attributes, kept by the engine's metric restore, and
    torchmetrics' own counters (``_update_count``) change with every update."""

    def __init__(self) -> None:
        super().__init__()
        self.add_state("hits", default=torch.tensor(0), dist_reduce_fx="sum")

    def update(self, value: torch.Tensor) -> None:
        self.hits += value

    def compute(self) -> torch.Tensor:
        return self.hits


class Parts(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.steps = 0
        self.warmup = SampleWarmup()
        self.hits = Hits()
        self.layer = torch.nn.Linear(2, 2)  # torch's: settings (in_features), not recorded
        self.quantize = FakeQuantize()  # torch's too, though abc.ABC, which is in no site-packages, is among its bases
        self.blocks = torch.nn.ModuleList([SampleWarmup() for _ in range(3)])
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64), persistent=False)  # in no state_dict
        self.register_buffer("kept", torch.zeros((), dtype=torch.int64))  # in the state_dict: not recorded
        self.register_buffer("table", torch.arange(64.0), persistent=False)  # a cache, over 16 values: not recorded
        self.register_buffer("lazy", None, persistent=False)  # a cache filled in training: None on a resume
        packed = torch.zeros(2, dtype=torch.uint8).view(torch.bits8)  # no Python scalars: tolist raises
        self.register_buffer("packed", packed, persistent=False)


def test_the_record_covers_the_module_and_its_submodules_of_ones_own_not_torchs_layers_nor_metrics():
    module = Parts()
    trainer = SimpleNamespace(lightning_module=module, callbacks=[])
    module.steps, module.warmup.seen = 3, 96
    for block in module.blocks:
        block.seen = 64
    module.hits.update(torch.tensor(5))
    module.calls += 7
    module.kept += 2
    module.lazy = torch.ones(2)
    saved = record_unsaved(trainer)
    blocks = {f"self.blocks.{i}": {"seen": "64"} for i in range(3)}
    module_values = {"calls": "7", "lazy": "[1.0, 1.0]", "packed": "a torch.bits8 tensor", "steps": "3"}
    assert saved["values"] == {"": module_values, "self.warmup": {"seen": "96"}, **blocks}
    fresh = Parts()  # a resume's module: every count afresh
    notes = unsaved_notes(saved, SimpleNamespace(lightning_module=fresh, callbacks=[]))
    assert [note.split(":")[0] for note in notes] == [
        "steps (3 saved, 0 now) of Parts",  # a plain attribute and buffers: a note each, each with its own advice
        "calls (7 saved, 0 now), lazy ([1.0, 1.0] saved, None now) of Parts",
        "seen (64 saved, 0 now) of self.blocks.0 and 2 more (SampleWarmup)",  # the same change in each: said once
        "seen (96 saved, 0 now) of self.warmup (SampleWarmup)",
    ]
    assert "a plain attribute, in no checkpoint" in notes[0] and "on_load_checkpoint keep one" in notes[0], notes[0]
    assert "a buffer registered with persistent=False, in no checkpoint, differs" in notes[1], notes[1]
    assert "(a buffer registered with persistent=True keeps one)" in notes[1], notes[1]
    assert "a buffer (register_buffer) keeps one" in notes[2]
    fresh.steps, fresh.warmup.seen, fresh.calls, fresh.lazy = 3, 96, torch.tensor(7), torch.ones(2)
    for block in fresh.blocks:
        block.seen = 64
    assert unsaved_notes(saved, SimpleNamespace(lightning_module=fresh, callbacks=[])) == []


def test_submodules_of_the_modules_own_package_are_covered_when_it_is_installed_into_site_packages(
    tmp_path, monkeypatch
):
    """A project installed as a wheel (``pip install .``, not ``-e``) lives in site-packages, where torch's and other
    libraries' layers live: the classes of the module's own package are the user's there too."""
    import sys

    package = tmp_path / "lib" / "python3" / "site-packages" / "mylab_installed"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "layers.py").write_text(
        "import torch\n\n\nclass Warmup(torch.nn.Module):\n    def __init__(self):\n        super().__init__()\n"
        "        self.seen = 0\n"
    )
    (package / "models.py").write_text(
        "import lightning as L\n\nfrom mylab_installed.layers import Warmup\n\n\nclass Lit(L.LightningModule):\n"
        "    def __init__(self):\n        super().__init__()\n        self.warmup = Warmup()\n"
    )
    monkeypatch.syspath_prepend(str(package.parent))
    for name in ("mylab_installed", "mylab_installed.layers", "mylab_installed.models"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    from mylab_installed.models import Lit

    module = Lit()
    module.warmup.seen = 96
    saved = record_unsaved(SimpleNamespace(lightning_module=module, callbacks=[]))
    assert saved["values"]["self.warmup"] == {"seen": "96"}, saved
    (note,) = unsaved_notes(saved, SimpleNamespace(lightning_module=Lit(), callbacks=[]))
    assert note.startswith("seen (96 saved, 0 now) of self.warmup (Warmup): a plain attribute"), note
