"""Exact positioned reads of a checkpoint's bytes, from any number of threads at once."""

from __future__ import annotations

import io
import os
import threading
from typing import IO

import numpy as np
import numpy.typing as npt

from ..errors import CorruptCheckpointError

Bytes = npt.NDArray[np.uint8]
Readable = IO[bytes] | bytes | bytearray | memoryview


class ByteRanges:
    """Positioned reads of a file or buffer, safe from several threads: zero-copy views of bytes
    in memory (a bytes-like object, or an ``io.BytesIO``), ``os.preadv`` on a real file, a lock
    around seek + read for other file objects. A read that finds fewer bytes than asked for is
    :class:`~ckptzip.errors.CorruptCheckpointError`."""

    def __init__(self, f: Readable) -> None:
        self._lock = threading.Lock()
        self._memory: Bytes | None = None
        self._fd: int | None = None
        self._file: IO[bytes] | None = None
        if isinstance(f, (bytes, bytearray, memoryview)):
            self._memory = np.frombuffer(f, dtype=np.uint8)
            return
        self._file = f
        if isinstance(f, io.BytesIO):  # getvalue() hands out the buffer itself where it can
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
        assert self._file is not None  # one of the three is always set
        with self._lock:
            return self._file.seek(0, os.SEEK_END)

    def view(self, offset: int, length: int) -> Bytes | None:
        """The bytes without a copy when they are in memory, else None."""
        if self._memory is None:
            return None
        return self._memory[offset : offset + length]

    def read(self, offset: int, length: int, what: str) -> bytes:
        """Exactly ``length`` bytes at ``offset``. The range is checked against the size first,
        so a damaged length never becomes a huge allocation."""
        size = self.size
        if offset + length > size:
            raise CorruptCheckpointError(
                f"{what}: expected {length} bytes at offset {offset}, but the file has {size} bytes; "
                "it was truncated or its index is damaged"
            )
        out = np.empty(length, dtype=np.uint8)
        self.read_exact_into(out, offset, what)
        return out.tobytes()

    def read_exact_into(self, out: Bytes, offset: int, what: str) -> None:
        """Fill the 1-D uint8 array ``out`` with the bytes at ``offset``; a short file is corruption."""
        got = self.read_into(out, offset)
        if got != out.size:
            raise CorruptCheckpointError(
                f"{what}: expected {out.size} bytes at offset {offset}, the file gave {got}; it was truncated"
            )

    def read_into(self, out: Bytes, offset: int) -> int:
        """Fill the 1-D uint8 array ``out`` from ``offset``; return how many bytes the file had."""
        if self._memory is not None:
            got = max(0, min(out.size, self._memory.size - offset))
            if got:  # one core per call, without the GIL: several threads copy at once
                np.copyto(out[:got], self._memory[offset : offset + got])
            return got
        view = out.data
        got = 0
        if self._fd is not None:
            while got < out.size:
                n = os.preadv(self._fd, [view[got:]], offset + got)
                if not n:
                    break
                got += n
            return got
        assert self._file is not None
        with self._lock:
            self._file.seek(offset)
            while got < out.size:
                n = self._readinto(self._file, view[got:])
                if not n:
                    break
                got += n
        return got

    @staticmethod
    def _readinto(f: IO[bytes], view: memoryview) -> int:
        """``f.readinto(view)``, for file objects that only have ``read`` too."""
        readinto = getattr(f, "readinto", None)
        n = readinto(view) if readinto is not None else None
        if n is None:  # no readinto, or a non-blocking stream with nothing ready
            data = f.read(len(view))
            n = len(data)
            view[:n] = data
        return int(n)

    def close(self) -> None:
        """Drop the in-memory view (so a BytesIO can grow or close again)."""
        self._memory = None
