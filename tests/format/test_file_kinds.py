"""Issue #44: another kind of file given to ckptzip is named for what it is, with what to run,
not called damaged; ``compress`` refuses what it cannot read the same way."""

from __future__ import annotations

import gzip
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import assert_same
from safetensors.torch import save_file

import ckptzip
from ckptzip.cli import main
from ckptzip.errors import CheckpointNotFoundError, CorruptCheckpointError

STATE = {"w": torch.arange(6, dtype=torch.float32)}
COMPRESS = "`ckptzip compress SRC DST.ckz` makes a .ckz of it"


def _write(kind: str, path: Path) -> None:
    if kind == "torch.save":
        torch.save(STATE, path)
    elif kind == "torch.save legacy":
        torch.save(STATE, path, _use_new_zipfile_serialization=False)
    elif kind == "safetensors":
        save_file(STATE, path)
    elif kind == "npy":
        with open(path, "wb") as f:  # a file: np.save would add .npy to the name
            np.save(f, np.ones(3))
    elif kind == "npz":
        with open(path, "wb") as f:
            np.savez(f, a=np.ones(3))
    elif kind == "pickle":
        path.write_bytes(pickle.dumps({"a": 1}))
    elif kind == "gzip":
        path.write_bytes(gzip.compress(b"x" * 100))


KINDS = {
    "torch.save": f"this is a torch.save file (zip format), not a ckptzip file: {COMPRESS}",
    "torch.save legacy": f"this is a torch.save file (the legacy format of torch < 1.6), not a ckptzip file: {COMPRESS}",
    "safetensors": f"this is a .safetensors file, not a ckptzip file: {COMPRESS}",
    "npy": "this is a NumPy .npy file, not a ckptzip file: numpy.load reads it, and ckptzip.save stores NumPy arrays",
    "npz": "this is a NumPy .npz archive, not a ckptzip file: ckptzip.save(dict(numpy.load(SRC)), DST) stores its arrays",
    "pickle": "this is a Python pickle (pickle.dump, or torch.save with another pickle_module), not a ckptzip file",
    "gzip": "this is a gzip-compressed file, not a ckptzip file: decompress it first",
}


@pytest.mark.parametrize("kind", KINDS)
def test_load_and_open_name_another_kind_of_file_and_what_to_run(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "model.ckz"
    _write(kind, path)
    for read in (ckptzip.load, ckptzip.open, lambda p: ckptzip.load(p.read_bytes())):
        with pytest.raises(CorruptCheckpointError) as info:
            read(path)
        assert str(info.value).startswith(KINDS[kind])
        assert "end marker" not in str(info.value)


def test_inspect_of_a_torch_save_file_points_to_compress(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _write("torch.save", tmp_path / "model.pt")
    assert main(["inspect", str(tmp_path / "model.pt")]) == 1
    assert capsys.readouterr().err == f"ckptzip: error: {KINDS['torch.save']}\n"


@pytest.mark.parametrize(("names", "said"), [
    ([".metadata.ckz", "__0.ckzd"], "a DCP checkpoint directory written by ckptzip.dcp, not a ckptzip file: "
     "dcp.load(state, storage_reader=ckptzip.dcp.CompressedStorageReader(DIR)) loads it, and `ckptzip dcp-convert "
     "DIR FILE.ckz` makes one .ckz of it"),
    (["__0.metadata.ckz"], "a DCP checkpoint directory written by ckptzip.dcp"),
    ([".metadata", "__0_0.distcp"], "a DCP checkpoint directory (torch.distributed.checkpoint's FileSystemWriter), not "
     "a ckptzip file: `ckptzip dcp-convert --trusted-objects DIR FILE.ckz` makes one .ckz of it"),
    (["step_00000010.ckz"], "a CheckpointManager directory, not a ckptzip file: ckptzip.CheckpointManager(DIR).restore() "
     "loads its newest checkpoint"),
    ([], "a directory, not a ckptzip file: give a .ckz file"),
])
def test_a_directory_is_named_for_what_it_holds(tmp_path: Path, names: list[str], said: str) -> None:
    for name in names:
        (tmp_path / name).write_bytes(b"")
    with pytest.raises(CheckpointNotFoundError) as info:
        ckptzip.load(tmp_path)
    assert str(info.value).startswith(f"no checkpoint file at {str(tmp_path)!r}: it is {said}")


@pytest.mark.parametrize(("kind", "said"), [
    ("ckz", "is a .ckz file already: `ckptzip inspect` shows it, `ckptzip convert SRC DST --codec portable` "
     "re-encodes it, `ckptzip decompress SRC DST.pt` makes a torch.save file of it"),
    ("npy", "is a NumPy .npy file, not a torch.save or .safetensors file: numpy.load reads it"),
    ("text", "is neither a torch.save nor a .safetensors file (it starts with b'hello world\\nhell'); compress reads those"),
    ("empty", "is neither a torch.save nor a .safetensors file (it is empty); compress reads those"),
    ("dcp", "is a DCP checkpoint directory written by ckptzip.dcp, not a torch.save or .safetensors file: "
     "dcp.load(state"),
])
def test_compress_says_what_it_cannot_read_without_suggesting_trust_pickle(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], kind: str, said: str
) -> None:
    src = tmp_path / "in"
    if kind == "ckz":
        ckptzip.save(STATE, src)
    elif kind == "npy":
        _write("npy", src)
    elif kind == "text":
        src.write_text("hello world\n" * 10)
    elif kind == "empty":
        src.write_bytes(b"")
    else:
        src.mkdir()
        (src / ".metadata.ckz").write_bytes(b"")
    assert main(["compress", str(src), str(tmp_path / "out.ckz")]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"ckptzip: error: {str(src)!r} {said}")
    assert "--trust-pickle" not in err and not (tmp_path / "out.ckz").exists()


def test_compress_reads_a_safetensors_file_by_its_bytes_whatever_its_name(tmp_path: Path) -> None:
    _write("safetensors", tmp_path / "weights.bin")
    assert main(["compress", "-q", str(tmp_path / "weights.bin"), str(tmp_path / "out.ckz")]) == 0
    assert_same(ckptzip.load(tmp_path / "out.ckz"), STATE)
