"""scripts/count_syncs_counter.py on a GPU also counts what CUDA reports as a synchronization
(``torch.cuda.set_sync_debug_mode("warn")``). No GPU here: CUDA's side is played by a fake that emits torch's warning
text at each synchronizing call, and the counter must count exactly those of the counted thread and phase."""

import sys
import threading
import warnings

import torch

from tests.helpers import REPO

sys.path.insert(0, str(REPO / "scripts"))
from count_syncs_counter import CUDA_SYNC_WARNING, SyncCounter


def test_cuda_sync_debug_warnings_are_counted_in_steps_only_and_the_modes_are_restored(monkeypatch, recwarn):
    modes = ["default"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)

    def synchronize() -> None:  # what a synchronizing CUDA call does in "warn" mode
        if modes[-1] == "warn":
            warnings.warn(f"Warning: {CUDA_SYNC_WARNING}", UserWarning, stacklevel=1)

    phase, counting = ["step"], [True]
    showwarning = warnings.showwarning
    with SyncCounter(lambda: counting[0], lambda: phase[0]) as counter:
        for _ in range(3):
            synchronize()  # counted: 3
        phase[0] = "epoch end"
        synchronize()  # an epoch end: apart
        phase[0], counting[0] = "step", False
        synchronize()  # validation: not counted
        counting[0] = True
        other = threading.Thread(target=synchronize)  # another thread (the checkpoint writer): not counted
        other.start()
        other.join()
        warnings.warn("an unrelated warning", UserWarning, stacklevel=1)  # still reaches the user
    assert counter.cuda_syncs == 3
    assert [str(w.message) for w in recwarn] == ["an unrelated warning"]  # through the counter's hook, alone
    assert modes == ["default", "warn", 0]  # on for the count, then the mode from before
    assert warnings.showwarning is showwarning
    assert SyncCounter(lambda: True, lambda: "step").cuda_syncs is None  # set only where CUDA is
