"""Container reader: validates trailer and index up front; reads stored bytes on demand, from any
number of threads at once."""

from __future__ import annotations

import io
import os
import threading
from typing import BinaryIO

import numpy as np
import xxhash

from ..checksum import xxh3_hex
from ..errors import CorruptCheckpointError
from .index import Chunk, Index, TensorEntry
from .spec import PREAMBLE_SIZE, TRAILER_SIZE, Trailer, check_preamble


class ByteSource:
    """Positioned reads of a checkpoint's bytes, safe from several threads: zero-copy views of
    bytes in memory (a bytes-like object, or an ``io.BytesIO``), ``os.preadv`` on a real file, a
    lock around seek + read for other file objects."""

    def __init__(self, f: BinaryIO | bytes | bytearray | memoryview) -> None:
        self._f = f
        self._lock = threading.Lock()
        self._memory: np.ndarray | None = None
        self._fd: int | None = None
        if isinstance(f, (bytes, bytearray, memoryview)):
            self._memory = np.frombuffer(f, dtype=np.uint8)
        elif isinstance(f, io.BytesIO):  # getvalue() hands out the buffer itself where it can
            self._memory = np.frombuffer(f.getvalue(), dtype=np.uint8)
        elif hasattr(os, "preadv"):
            try:
                self._fd = f.fileno()
            except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is an OSError
                self._fd = None

    @property
    def size(self) -> int:
        if self._memory is not None:
            return self._memory.size
        if self._fd is not None:
            return os.fstat(self._fd).st_size
        with self._lock:
            return self._f.seek(0, os.SEEK_END)  # type: ignore[union-attr]

    def view(self, offset: int, length: int) -> np.ndarray | None:
        """The bytes without a copy when they are in memory, else None."""
        if self._memory is None:
            return None
        return self._memory[offset : offset + length]

    def read(self, offset: int, length: int, what: str) -> bytes:
        """Exactly ``length`` bytes at ``offset``; fewer means the file was truncated."""
        out = np.empty(length, dtype=np.uint8)
        got = self.read_into(out, offset)
        if got != length:
            raise CorruptCheckpointError(
                f"{what}: expected {length} bytes at offset {offset}, the file gave {got}; it was truncated"
            )
        return out.tobytes()

    def read_into(self, out: np.ndarray, offset: int) -> int:
        """Fill the 1-D uint8 array ``out`` from ``offset``; return how many bytes the file had."""
        if self._memory is not None:
            got = max(0, min(out.size, self._memory.size - offset))
            if got:  # one core per call, without the GIL: several threads copy at once
                np.copyto(out[:got], self._memory[offset : offset + got])
            return got
        view = memoryview(out)
        got = 0
        if self._fd is not None:
            while got < out.size:
                n = os.preadv(self._fd, [view[got:]], offset + got)
                if not n:
                    break
                got += n
            return got
        with self._lock:
            self._f.seek(offset)  # type: ignore[union-attr]
            while got < out.size:
                n = self._f.readinto(view[got:]) if hasattr(self._f, "readinto") else None  # type: ignore[union-attr]
                if n is None:
                    data = self._f.read(out.size - got)  # type: ignore[union-attr]
                    n = len(data)
                    view[got : got + n] = data
                if not n:
                    break
                got += n
        return got

    def close(self) -> None:
        """Drop the in-memory view (so a BytesIO can grow or close again)."""
        self._memory = None


class ContainerReader:
    """The verified index of one .ckz container, and its stored bytes."""

    def __init__(self, f: BinaryIO | bytes | bytearray | memoryview) -> None:
        source = ByteSource(f)
        size = source.size
        if size < PREAMBLE_SIZE + TRAILER_SIZE:
            Trailer.unpack(b"\0" * TRAILER_SIZE, size)  # raises with the size in the message
        trailer = Trailer.unpack(source.read(size - TRAILER_SIZE, TRAILER_SIZE, "trailer"), size)
        head = source.read(0, PREAMBLE_SIZE, "preamble")
        raw_index = source.read(trailer.index_offset, trailer.index_length, "index")
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
        self.source = source

    @property
    def tensors(self) -> list[TensorEntry]:
        return self.index.tensors

    @property
    def digest_is_wsum64(self) -> bool:
        """Whether chunk digests are wsum64 (format 2) rather than XXH3-64 (format 1)."""
        return self.index.version[0] >= 2

    def read_into(self, out: np.ndarray, offset: int, what: str) -> None:
        """Fill ``out`` with the stored bytes at ``offset``; a short file is corruption."""
        got = self.source.read_into(out, offset)
        if got != out.size:
            raise CorruptCheckpointError(
                f"{what}: expected {out.size} bytes at offset {offset}, the file gave {got}; it was truncated"
            )


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
