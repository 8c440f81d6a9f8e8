"""``discard://``: an fsspec store for a manager's benchmarks that keeps its markers and lock in
memory and counts, but drops, the checkpoint bytes written to it, so a manager's pipeline is timed
without the disk (and without an in-memory store that grows by copying). Importing this module
registers the protocol."""

from __future__ import annotations

from typing import Any, ClassVar

import fsspec
from fsspec.implementations.memory import MemoryFile, MemoryFileSystem


class _Counted(MemoryFile):
    """A checkpoint file whose bytes are counted, not kept."""

    def __init__(self, fs: Any, path: str) -> None:
        super().__init__(fs, path)
        self.written = 0

    def write(self, b: Any) -> int:
        n = memoryview(b).nbytes
        self.written += n
        return n

    def tell(self) -> int:
        return self.written


class DiscardFileSystem(MemoryFileSystem):
    """``discard://``: an in-memory store (the manager's markers and lock) that keeps no
    checkpoint bytes, so a manager's pipeline is timed without the disk."""

    protocol = "discard"
    # fsspec's MemoryFileSystem keeps its files in these class attributes, shared by its instances
    store: ClassVar[dict[str, Any]] = {}
    pseudo_dirs: ClassVar[list[str]] = [""]

    def _open(self, path: str, mode: str = "rb", *args: Any, **kwargs: Any) -> Any:
        if mode == "wb" and path.endswith(".ckz"):
            f = _Counted(self, self._strip_protocol(path))
            f.commit()
            return f
        return super()._open(path, mode, *args, **kwargs)


fsspec.register_implementation("discard", DiscardFileSystem, clobber=True)


def written(run: str) -> int:
    """Checkpoint bytes written so far under ``discard://run``, the newest file."""
    files = [f for p, f in DiscardFileSystem.store.items() if f"{run}/" in p and isinstance(f, _Counted)]
    return files[-1].written if files else 0
