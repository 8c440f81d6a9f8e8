"""Constants and fixed-size structures of the .ckz container (docs/FORMAT.md)."""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from typing import BinaryIO

import torch

from ..errors import CorruptCheckpointError, UnsupportedFormatError

MAGIC = b"\x89CKZ\r\n\x1a\n"
END_MAGIC = b"CKZINDEX"
VERSION = (2, 0)  # what a file without 2.1 features is written as
VERSION_SOURCES = (2, 1)  # tensors stored as references (copy, cast) or XOR deltas against bases
VERSION_SPARSE = (2, 2)  # the "sparse" transform (bitmap and non-zero values: XOR deltas of barely moved weights)
READABLE_MAJORS = (1, 2)  # format 1: chunk digests are XXH3-64; format 2: wsum64
KNOWN_MINORS = {1: 0, 2: 2}  # newest minor version of each major this reader knows
PREAMBLE_SIZE = 16
TRAILER_SIZE = 32
MIN_FILE_SIZE = PREAMBLE_SIZE + TRAILER_SIZE
MAX_CHUNK_RAW = 1 << 28
MAX_DIMS = 64
FORMAT_NAME = "ckptzip"

_PREAMBLE = struct.Struct("<8sHHI")
_TRAILER = struct.Struct("<QQQ8s")

# Every dtype of this torch build by name ("float32", "float8_e4m3fn", ...): readers of stored names
# (trees, DCP metadata) look them up here and never call getattr(torch, name), which can import submodules.
TORCH_DTYPES: dict[str, torch.dtype] = {
    str(v).removeprefix("torch."): v for v in vars(torch).values() if isinstance(v, torch.dtype)
}
# Name in the index -> torch dtype, for the dtypes a tensor may have that this torch build has.
DTYPES: dict[str, torch.dtype] = {
    name: TORCH_DTYPES[name]
    for name in (
        "float64 float32 float16 bfloat16 float8_e4m3fn float8_e5m2 float8_e4m3fnuz float8_e5m2fnuz "
        "int64 int32 int16 int8 uint64 uint32 uint16 uint8 bool complex128 complex64"
    ).split()
    if name in TORCH_DTYPES
}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


def is_ckz(file: str | os.PathLike[str] | BinaryIO) -> bool:
    """Whether a file (a path, or a binary file read at its position, which is kept) starts as a
    .ckz container does; nothing else is checked."""
    if isinstance(file, (str, os.PathLike)):
        with open(file, "rb") as f:
            return f.read(len(MAGIC)) == MAGIC
    start = file.tell()
    try:
        return file.read(len(MAGIC)) == MAGIC
    finally:
        file.seek(start)


def preamble(version: tuple[int, int] = VERSION) -> bytes:
    """The 16 bytes every file starts with."""
    return _PREAMBLE.pack(MAGIC, version[0], version[1], 0)


@dataclass(frozen=True)
class Trailer:
    """The last 32 bytes: where the index is and its hash."""

    index_offset: int
    index_length: int
    index_hash: int

    def pack(self) -> bytes:
        return _TRAILER.pack(self.index_offset, self.index_length, self.index_hash, END_MAGIC)

    @classmethod
    def unpack(cls, raw: bytes, file_size: int) -> Trailer:
        """Parse and check the trailer against the file size (FORMAT.md, "Trailer")."""
        if file_size < MIN_FILE_SIZE:
            raise CorruptCheckpointError(
                f"file is {file_size} bytes, shorter than the {MIN_FILE_SIZE} bytes of an empty ckptzip "
                "file: it is truncated or not a ckptzip file"
            )
        offset, length, digest, end = _TRAILER.unpack(raw)
        if end != END_MAGIC:
            raise CorruptCheckpointError(
                f"file does not end with the ckptzip end marker {END_MAGIC!r} (found {end!r}): it is "
                "truncated, was not written to the end, or is not a ckptzip file"
            )
        if offset < PREAMBLE_SIZE or offset + length + TRAILER_SIZE != file_size:
            raise CorruptCheckpointError(
                f"trailer places the index at offset {offset} with length {length}, which does not fit "
                f"a file of {file_size} bytes: the file is damaged or truncated"
            )
        return cls(offset, length, digest)


def check_preamble(raw: bytes) -> int:
    """Check magic, version and flags (call only after the index hash, which covers them, matched);
    return the major version."""
    magic, major, minor, flags = _PREAMBLE.unpack(raw)
    if magic != MAGIC:
        raise CorruptCheckpointError(f"bad magic {magic!r}, expected {MAGIC!r}: not a ckptzip file")
    if major not in READABLE_MAJORS:
        raise UnsupportedFormatError(
            f"file format version {major}.{minor}; this ckptzip reads versions "
            f"{', '.join(f'{m}.x' for m in READABLE_MAJORS)}. Install a ckptzip release that supports it."
        )
    if flags != 0:
        raise UnsupportedFormatError(f"file has format flags {flags:#x}; this ckptzip knows none. Upgrade ckptzip.")
    return int(major)
