"""Sequential container writer: stored chunks first, index and trailer last, never seeking."""

from __future__ import annotations

from typing import Any, BinaryIO

import xxhash

from .._version import __version__
from .index import BaseRef, Index, TensorEntry
from .spec import PREAMBLE_SIZE, TRAILER_SIZE, VERSION, Trailer, preamble


class ContainerWriter:
    """Writes one .ckz container to a binary file object, front to back."""

    def __init__(self, f: BinaryIO, version: tuple[int, int] = VERSION) -> None:
        self._f = f
        self._version = version
        self._preamble = preamble(version)
        self._f.write(self._preamble)
        self.offset = PREAMBLE_SIZE
        self.tensors: list[TensorEntry] = []

    def append(self, data: memoryview) -> int:
        """Append stored bytes; return the file offset they start at."""
        start = self.offset
        self._f.write(data)
        self.offset += data.nbytes
        return start

    def flush(self) -> None:
        """Flush the file object's buffer to the OS."""
        self._f.flush()

    def add_tensor(self, entry: TensorEntry) -> None:
        """Record a tensor whose chunks were appended (table order is the caller's)."""
        self.tensors.append(entry)

    def finish(self, tree: Any, bases: list[BaseRef] | None = None) -> int:
        """Write index and trailer; return the file size. The caller flushes and syncs."""
        index = Index(tree, self.tensors, f"ckptzip {__version__}", self._version, bases or []).to_json()
        digest = xxhash.xxh3_64_intdigest(self._preamble + index)
        self._f.write(index)
        self._f.write(Trailer(self.offset, len(index), digest).pack())
        return self.offset + len(index) + TRAILER_SIZE
