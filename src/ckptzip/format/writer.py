"""Sequential container writer: chunks first, index and trailer last."""

from __future__ import annotations

from typing import Any, BinaryIO

import torch
import xxhash

from .._version import __version__
from ..checksum import xxh3_hex
from .index import Chunk, Index, TensorEntry
from .spec import PREAMBLE_SIZE, Trailer, preamble


class ContainerWriter:
    """Writes one .ckz container to a binary file object, front to back, without seeking."""

    def __init__(self, f: BinaryIO) -> None:
        self._f = f
        self._preamble = preamble()
        self._f.write(self._preamble)
        self.offset = PREAMBLE_SIZE
        self.tensors: list[TensorEntry] = []

    def write_chunk(self, data: torch.Tensor, raw_length: int) -> Chunk:
        """Append one stored chunk (1-D uint8 CPU tensor) and return its index entry."""
        view = memoryview(data.numpy())
        self._f.write(view)
        chunk = Chunk(self.offset, len(view), raw_length, xxh3_hex(view))
        self.offset += len(view)
        return chunk

    def flush(self) -> None:
        """Flush the file object's buffer to the OS."""
        self._f.flush()

    def add_tensor(self, entry: TensorEntry) -> None:
        """Record a tensor whose chunks were written (in table order)."""
        self.tensors.append(entry)

    def finish(self, tree: Any) -> int:
        """Write index and trailer; return the file size. The caller flushes and syncs."""
        index = Index(tree, self.tensors, f"ckptzip {__version__}").to_json()
        digest = xxhash.xxh3_64_intdigest(self._preamble + index)
        self._f.write(index)
        self._f.write(Trailer(self.offset, len(index), digest).pack())
        return self.offset + len(index) + 32
