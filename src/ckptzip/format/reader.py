"""Container reader: validates trailer and index up front, then reads verified chunks on demand."""

from __future__ import annotations

import os
from typing import BinaryIO

import torch
import xxhash

from ..checksum import xxh3_hex
from ..errors import CorruptCheckpointError
from .index import Index, StreamEntry, TensorEntry
from .spec import PREAMBLE_SIZE, TRAILER_SIZE, Trailer, check_preamble


def _read_exact(f: BinaryIO, offset: int, length: int, what: str) -> bytes:
    f.seek(offset)
    data = f.read(length)
    if len(data) != length:
        raise CorruptCheckpointError(
            f"{what}: expected {length} bytes at offset {offset}, the file gave {len(data)}; it was truncated"
        )
    return data


def _file_size(f: BinaryIO) -> int:
    try:
        return os.fstat(f.fileno()).st_size
    except (AttributeError, OSError, ValueError):
        return f.seek(0, os.SEEK_END)


class ContainerReader:
    """Random access to the verified contents of one .ckz container."""

    def __init__(self, f: BinaryIO) -> None:
        self._f = f
        size = _file_size(f)
        if size < PREAMBLE_SIZE + TRAILER_SIZE:
            Trailer.unpack(b"\0" * TRAILER_SIZE, size)  # raises with the size in the message
        trailer = Trailer.unpack(_read_exact(f, size - TRAILER_SIZE, TRAILER_SIZE, "trailer"), size)
        head = _read_exact(f, 0, PREAMBLE_SIZE, "preamble")
        raw_index = _read_exact(f, trailer.index_offset, trailer.index_length, "index")
        if xxhash.xxh3_64_intdigest(head + raw_index) != trailer.index_hash:
            raise CorruptCheckpointError(
                "the index checksum does not match: the file header or index is damaged "
                f"(index at offset {trailer.index_offset}, {trailer.index_length} bytes)"
            )
        check_preamble(head)
        self.file_size = size
        self.index = Index.parse(raw_index, trailer.index_offset)

    @property
    def tensors(self) -> list[TensorEntry]:
        return self.index.tensors

    def read_stream(self, tensor: TensorEntry, stream_no: int) -> list[torch.Tensor]:
        """Read one stream's stored chunks (one contiguous read), each checked against its XXH3."""
        stream: StreamEntry = tensor.streams[stream_no]
        if not stream.chunks:
            return []
        start = stream.chunks[0].offset
        blob = bytearray(stream.compressed_nbytes)
        self._f.seek(start)
        got = self._f.readinto(blob) if hasattr(self._f, "readinto") else None
        if got is None:
            data = self._f.read(len(blob))
            got = len(data)
            blob[:got] = data
        if got != len(blob):
            raise CorruptCheckpointError(
                f"tensor {tensor.name!r} stream {stream_no}: expected {len(blob)} bytes at offset {start}, "
                f"the file gave {got}; it was truncated"
            )
        whole = torch.frombuffer(blob, dtype=torch.uint8)
        chunks = []
        for k, c in enumerate(stream.chunks):
            piece = whole[c.offset - start : c.offset - start + c.length]
            digest = xxh3_hex(piece)
            if digest != c.xxh3:
                raise CorruptCheckpointError(
                    f"tensor {tensor.name!r} stream {stream_no} chunk {k} (file bytes {c.offset}..{c.offset + c.length}) "
                    f"is damaged: XXH3 {digest}, expected {c.xxh3}"
                )
            chunks.append(piece)
        return chunks
