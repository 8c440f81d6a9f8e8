"""Container reader: validates trailer and index up front, then reads verified chunks on demand."""

from __future__ import annotations

import os
from typing import BinaryIO

import torch
import xxhash

from ..checksum import xxh3_hex
from ..codecs._threads import parallel_map
from ..errors import CorruptCheckpointError
from .index import Chunk, Index, StreamEntry, TensorEntry
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
        whole = torch.empty(stream.compressed_nbytes, dtype=torch.uint8)
        group = [(tensor, stream_no, k, c) for k, c in enumerate(stream.chunks)]
        self.read_into(whole, stream.chunks[0].offset, group)
        return list(whole.split([c.length for c in stream.chunks]))

    def read_into(self, out: torch.Tensor, offset: int, chunks: list[tuple[TensorEntry, int, int, Chunk]]) -> None:
        """Read ``out.numel()`` bytes at ``offset`` into the 1-D uint8 CPU tensor ``out`` and check
        the XXH3 of each chunk in it (given as (tensor, stream number, chunk number, chunk))."""
        view = memoryview(out.numpy())
        self._f.seek(offset)
        got = 0
        while got < len(view):
            n = self._f.readinto(view[got:]) if hasattr(self._f, "readinto") else None
            if n is None:
                data = self._f.read(len(view) - got)
                n = len(data)
                view[got : got + n] = data
            if not n:
                break
            got += n
        if got != len(view):
            tensor, stream_no, _, _ = chunks[0]
            raise CorruptCheckpointError(
                f"tensor {tensor.name!r} stream {stream_no}: expected {len(view)} bytes at offset {offset}, "
                f"the file gave {got}; it was truncated"
            )
        digests = parallel_map(lambda c: xxh3_hex(view[c.offset - offset : c.offset - offset + c.length]),
                               [c for _, _, _, c in chunks], len(view))
        for (tensor, stream_no, k, c), digest in zip(chunks, digests):
            if digest != c.xxh3:
                raise CorruptCheckpointError(
                    f"tensor {tensor.name!r} stream {stream_no} chunk {k} (file bytes {c.offset}..{c.offset + c.length}) "
                    f"is damaged: XXH3 {digest}, expected {c.xxh3}"
                )
