"""What a file or directory that is not a .ckz container is, and what to run on it.

A torch.save file handed to ``ckptzip.load`` is not damaged: it is another kind of file, and the
error says which kind and how to make a .ckz of it. Only the first bytes are looked at (and, for
a directory, the names in it); nothing is parsed further, so a damaged .ckz, which starts with
ckptzip's magic, is still reported as damaged.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass

from .spec import MAGIC

HEAD_BYTES = 64  # the bytes foreign_kind looks at: a zip's first member name lies within them
DCP_METADATA = ".metadata.ckz"  # the metadata file of ckptzip's DCP checkpoints (ckptzip.dcp)
PLAIN_DCP_METADATA = ".metadata"  # that of DCP's own FileSystemWriter
_COMPRESS = "`ckptzip compress SRC DST.ckz` makes a .ckz of it"
_TORCH_LEGACY = b"\x80\x02\x8a\x0al\xfc\x9cF\xf9 j\xa8P\x19"  # pickle protocol 2, then torch's magic number
_COMPRESSED = {b"\x1f\x8b": "gzip", b"\x28\xb5\x2f\xfd": "zstd", b"\xfd7zXZ\x00": "xz", b"BZh": "bzip2"}


@dataclass(frozen=True)
class Kind:
    """A kind of file: ``what`` it is ("a torch.save file (zip format)") and ``advice``, what to run."""

    what: str
    advice: str
    readable: bool = False  # whether ``ckptzip compress`` reads it

    def describe(self) -> str:
        return f"{self.what}, not a ckptzip file: {self.advice}"


TORCH_ZIP = Kind("a torch.save file (zip format)", _COMPRESS, readable=True)
TORCH_LEGACY = Kind("a torch.save file (the legacy format of torch < 1.6)", _COMPRESS, readable=True)
PICKLE = Kind(
    "a Python pickle (pickle.dump, or torch.save with another pickle_module)",
    "load it with the code that wrote it and save the result with ckptzip.save", readable=True)
SAFETENSORS = Kind("a .safetensors file", _COMPRESS, readable=True)
NPY = Kind("a NumPy .npy file", "numpy.load reads it, and ckptzip.save stores NumPy arrays")
NPZ = Kind("a NumPy .npz archive", "ckptzip.save(dict(numpy.load(SRC)), DST) stores its arrays")


def foreign_kind(head: bytes, size: int) -> Kind | None:
    """The kind of a file of ``size`` bytes that starts with ``head`` (its first ``HEAD_BYTES``),
    where it is a known kind other than a .ckz container; else None."""
    if head.startswith(MAGIC):
        return None
    if head.startswith(b"PK\x03\x04"):
        return _zip_kind(head)
    if head.startswith(_TORCH_LEGACY):
        return TORCH_LEGACY
    if len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5:
        return PICKLE
    if head.startswith(b"\x93NUMPY"):
        return NPY
    if len(head) >= 9 and head[8:9] == b"{" and 2 <= struct.unpack("<Q", head[:8])[0] <= size - 8:
        return SAFETENSORS  # an 8-byte header length, then the JSON header
    for magic, name in _COMPRESSED.items():
        if head.startswith(magic):
            return Kind(f"a {name}-compressed file", "decompress it first, then give ckptzip what it holds")
    return None


def _zip_kind(head: bytes) -> Kind:
    """torch.save's zip archives start with ``<name>/data.pkl``; NumPy's .npz with ``<array>.npy``."""
    if len(head) >= 30:
        (name_length,) = struct.unpack("<H", head[26:28])
        first = head[30 : 30 + name_length]
        if first.endswith(b"/data.pkl"):
            return TORCH_ZIP
        if first.endswith(b".npy"):
            return NPZ
    return Kind("a zip archive", "if it is a torch.save file, " + _COMPRESS)


def file_kind(path: str | os.PathLike[str]) -> Kind | None:
    """:func:`foreign_kind` of the file at ``path`` (None where it cannot be read)."""
    try:
        with open(path, "rb") as f:
            return foreign_kind(f.read(HEAD_BYTES), os.fstat(f.fileno()).st_size)
    except OSError:
        return None


def directory_kind(path: str | os.PathLike[str]) -> Kind:
    """What the directory at ``path`` holds, from the names in it: a DCP checkpoint, a
    CheckpointManager's checkpoints, or something else."""
    try:
        names = set(os.listdir(path))
    except OSError:
        names = set()
    if any(name.endswith(DCP_METADATA) for name in names):  # __<rank>.metadata.ckz: a save without collectives
        return Kind(
            "a DCP checkpoint directory written by ckptzip.dcp",
            "dcp.load(state, storage_reader=ckptzip.dcp.CompressedStorageReader(DIR)) loads it, and "
            "`ckptzip dcp-convert DIR FILE.ckz` makes one .ckz of it")
    if PLAIN_DCP_METADATA in names:
        return Kind(
            "a DCP checkpoint directory (torch.distributed.checkpoint's FileSystemWriter)",
            "`ckptzip dcp-convert --trusted-objects DIR FILE.ckz` makes one .ckz of it")
    if any(name.startswith("step_") and name.endswith(".ckz") for name in names):
        return Kind(
            "a CheckpointManager directory",
            "ckptzip.CheckpointManager(DIR).restore() loads its newest checkpoint; or give one of its step_*.ckz files")
    return Kind("a directory", "give a .ckz file")
