"""Container reader: validates trailer and index up front; reads stored bytes on demand, from any
number of threads at once."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import xxhash

from ..checksum import xxh3_hex
from ..errors import CorruptCheckpointError
from ..storage.ranges import ByteRanges, Readable
from .index import Chunk, Index, TensorEntry
from .kinds import HEAD_BYTES, foreign_kind
from .spec import PREAMBLE_SIZE, TRAILER_SIZE, Trailer, check_preamble


class ContainerReader:
    """The verified index of one .ckz container, and its stored bytes."""

    def __init__(self, f: Readable) -> None:
        ranges = ByteRanges(f)
        size = ranges.size
        head = ranges.read(0, min(size, HEAD_BYTES), "head")
        kind = foreign_kind(head, size)
        if kind is not None:  # another kind of file, not a damaged one
            raise CorruptCheckpointError(f"this is {kind.describe()}")
        if size < PREAMBLE_SIZE + TRAILER_SIZE:
            Trailer.unpack(b"\0" * TRAILER_SIZE, size)  # raises with the size in the message
        trailer = Trailer.unpack(ranges.read(size - TRAILER_SIZE, TRAILER_SIZE, "trailer"), size)
        head = ranges.read(0, PREAMBLE_SIZE, "preamble")
        raw_index = ranges.read(trailer.index_offset, trailer.index_length, "index")
        if xxhash.xxh3_64_intdigest(head + raw_index) != trailer.index_hash:
            raise CorruptCheckpointError(
                "the index checksum does not match: the file header or index is damaged "
                f"(index at offset {trailer.index_offset}, {trailer.index_length} bytes)"
            )
        major = check_preamble(head)
        self.file_size = size
        self.index = Index.parse(raw_index, trailer.index_offset)
        if self.index.version[0] != major:
            raise CorruptCheckpointError(
                f"the preamble says format {major}.x but the index says {self.index.version[0]}.x; "
                "the file is damaged or was not written by ckptzip"
            )
        self.ranges = ranges

    @property
    def tensors(self) -> list[TensorEntry]:
        return self.index.tensors

    @property
    def digest_is_wsum64(self) -> bool:
        """Whether chunk digests are wsum64 (format 2) rather than XXH3-64 (format 1)."""
        return self.index.version[0] >= 2

    def read_into(self, out: npt.NDArray[np.uint8], offset: int, what: str) -> None:
        """Fill ``out`` with the stored bytes at ``offset``; a short file is corruption."""
        self.ranges.read_exact_into(out, offset, what)


def verify_xxh3(data: np.ndarray, start: int, chunks: list[tuple[TensorEntry, int, int, Chunk]]) -> None:
    """Check the XXH3-64 digests of format-1 chunks whose stored bytes are ``data`` (from file
    offset ``start``); the error names the tensor, stream and chunk."""
    for tensor, stream_no, k, c in chunks:
        digest = xxh3_hex(data[c.offset - start : c.offset - start + c.length])
        if digest != c.digest:
            raise CorruptCheckpointError(
                f"tensor {tensor.name!r} stream {stream_no} chunk {k} (file bytes {c.offset}..{c.offset + c.length}) "
                f"is damaged: XXH3 {digest}, expected {c.digest}"
            )
