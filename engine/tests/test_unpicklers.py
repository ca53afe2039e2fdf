"""Every unpickler of the engine refuses a payload that names a global by a dotted name, and a sharded checkpoint is
complete only when every shard its index names is there (in-process: the real DCP folders and readers).

Pickle protocol 4 resolves ``module`` + ``a.b`` attribute by attribute: ``torch.distributed.checkpoint.filesystem``
+ ``os.system`` is ``os.system``, since that module imports ``os``. Each payload here is built by hand, opcode by
opcode, as an attacker would, and first shown to run under plain ``pickle`` (the oracle), then refused unrun.
"""

import io
import pickle
import shutil
import struct
from pathlib import Path

import pytest
import torch

from lightkeep.checkpoint_files import CheckpointLoadError, load_checkpoint_file
from lightkeep.compat_torch import load_bytes_weights_only
from lightkeep.sharded.folders import INDEX, META, _IndexUnpickler, check_complete, full_state_dict, read_meta

# (module, dotted name) pairs that reach os.system through modules an unpickler might allow
DOTTED = [
    ("torch.distributed.checkpoint.filesystem", "os.system"),
    ("torch.distributed.checkpoint.metadata", "torch.os.system"),
    ("pathlib", "os.system"),
    ("torch", "serialization.os.system"),
    ("torch.serialization", "os.system"),
]


def _text(value: str) -> bytes:
    data = value.encode()
    return b"\x8c" + struct.pack("<B", len(data)) + data  # SHORT_BINUNICODE


def payload(module: str, name: str, command: str) -> bytes:
    """Protocol-4 opcodes that call ``module``'s ``name`` with ``command``, without a STOP: a prefix for other
    pickles. No MEMOIZE, so the memo indices of a pickle appended after it still hold."""
    return _text(module) + _text(name) + b"\x93" + _text(command) + b"\x85" + b"R"  # STACK_GLOBAL, TUPLE1, REDUCE


def in_front_of(prefix: bytes, pickled: bytes) -> bytes:
    """``prefix`` run, its result dropped (POP), then ``pickled`` loaded as before: the load looks normal."""
    assert pickled[:2] == b"\x80\x04", "a protocol-4 pickle"
    return b"\x80\x04" + prefix + b"0" + pickled[2:]


@pytest.fixture
def dcp_folder(tmp_path) -> Path:
    """A real DCP folder of two tensors, one in bfloat16, as the sharded strategy writes (plus its meta.pt)."""
    import torch.distributed.checkpoint as dcp

    folder = tmp_path / "last.ckpt"
    state = {"state_dict.w": torch.arange(12.0).reshape(3, 4), "state_dict.b": torch.ones(2, dtype=torch.bfloat16)}
    dcp.save(state, checkpoint_id=folder, no_dist=True)
    torch.save({"global_step": 7}, folder / META)
    return folder


def test_the_index_unpickler_allows_exactly_the_classes_a_real_index_holds(dcp_folder):
    seen = set()

    class Recording(pickle.Unpickler):
        def find_class(self, module, name):
            seen.add((module, name))
            return super().find_class(module, name)

    Recording(io.BytesIO((dcp_folder / INDEX).read_bytes())).load()
    dtypes = {(m, n) for m, n in seen if m == "torch" and isinstance(getattr(torch, n), torch.dtype)}
    assert seen - dtypes <= _IndexUnpickler.ALLOWED, seen - dtypes - _IndexUnpickler.ALLOWED
    assert torch.equal(full_state_dict(dcp_folder)["w"], torch.arange(12.0).reshape(3, 4))


@pytest.mark.parametrize(("module", "name"), DOTTED)
def test_a_dotted_name_in_a_sharded_index_is_refused_unrun(dcp_folder, tmp_path, module, name):
    marker = tmp_path / "payload-ran"
    real = (dcp_folder / INDEX).read_bytes()
    evil = in_front_of(payload(module, name, f"touch {marker}"), real)
    index = pickle.loads(evil)  # the oracle: plain pickle runs it, then returns the real index as if nothing happened
    assert marker.exists() and type(index).__name__ == "Metadata"
    marker.unlink()
    (dcp_folder / INDEX).write_bytes(evil)
    for read in (check_complete, read_meta, full_state_dict):  # what --ckpt_path last, validate and export call
        with pytest.raises(CheckpointLoadError, match="could run code"):
            read(dcp_folder)
    assert not marker.exists()


@pytest.mark.parametrize(("module", "name"), DOTTED[:2])
def test_a_dotted_name_in_a_checkpoint_file_or_a_dcp_value_is_refused_unrun(tmp_path, module, name):
    """The other unpicklers: torch.load(weights_only=True) of a .ckpt, of a sharded folder's meta.pt and of DCP's
    non-tensor values (``load_bytes_weights_only``)."""
    marker = tmp_path / "payload-ran"
    buffer = io.BytesIO()
    torch.save({"global_step": 3}, buffer)
    good = buffer.getvalue()
    evil_pickle = in_front_of(payload(module, name, f"touch {marker}"), pickle.dumps({"global_step": 3}, protocol=4))
    pickle.loads(evil_pickle)  # the oracle
    assert marker.exists()
    marker.unlink()
    # a torch.save zip whose data.pkl is the payload: torch.load(weights_only=False) would run it
    evil_zip = _replace_data_pkl(good, evil_pickle)
    torch.load(io.BytesIO(evil_zip), weights_only=False)
    assert marker.exists()
    marker.unlink()
    (tmp_path / "evil.ckpt").write_bytes(evil_zip)
    with pytest.raises(CheckpointLoadError):
        load_checkpoint_file(tmp_path / "evil.ckpt")
    folder = tmp_path / "sharded"
    folder.mkdir()
    (folder / META).write_bytes(evil_zip)
    with pytest.raises(CheckpointLoadError):
        read_meta(folder)

    class Planner:  # what load_bytes_weights_only reads of DCP's DefaultLoadPlanner
        original_state_dict: dict = {}
        mappings = {"extra": ("extra",)}

    class Item:
        class dest_index:  # DCP's attribute name
            fqn = "extra"

    with pytest.raises(pickle.UnpicklingError):
        load_bytes_weights_only(Planner(), Item(), io.BytesIO(evil_zip))
    assert not marker.exists()


def _replace_data_pkl(zipped: bytes, data_pkl: bytes) -> bytes:
    import zipfile

    source, out = zipfile.ZipFile(io.BytesIO(zipped)), io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as target:
        for info in source.infolist():
            target.writestr(info, data_pkl if info.filename.endswith("/data.pkl") else source.read(info))
    return out.getvalue()


def test_a_folder_missing_a_shard_or_part_of_one_is_not_complete(dcp_folder, tmp_path):
    assert read_meta(dcp_folder)["global_step"] == 7
    (shard,) = dcp_folder.glob("*.distcp")
    cut = shutil.copytree(dcp_folder, tmp_path / "cut")
    data = (cut / shard.name).read_bytes()
    (cut / shard.name).write_bytes(data[: len(data) - 8])
    with pytest.raises(CheckpointLoadError, match=rf"{shard.name} has {len(data) - 8} of its {len(data)} bytes"):
        read_meta(cut)
    (cut / shard.name).unlink()
    with pytest.raises(CheckpointLoadError, match=rf"not a complete sharded checkpoint \({shard.name} is missing"):
        read_meta(cut)
