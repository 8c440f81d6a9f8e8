"""Early writeback: the kernel is asked to start writing a file's bytes to its disk as they
arrive, so that the fsync committing the file finds little left to write.

Without it the bytes stay dirty in the page cache until that fsync: Linux starts writing them in
the background only once dirty pages pass ``vm.dirty_background_ratio`` of memory (a tenth by
default), more than a checkpoint on a host with much memory. The fsync then writes the whole
file at the disk's speed after its coding has ended, instead of the disk working while it runs.
"""

from __future__ import annotations

import os
from typing import BinaryIO

# Bytes written between two requests: large enough that the calls cost nothing, small enough
# that the disk starts early.
WRITEBACK_BYTES = 64 << 20


def file_descriptor(f: BinaryIO) -> int | None:
    """The OS file descriptor behind ``f`` where early writeback can use it: a file that can
    seek (a pipe or a socket cannot take the advice), on a platform with ``posix_fadvise``; else
    None."""
    if not hasattr(os, "posix_fadvise"):
        return None
    try:
        fd = f.fileno()  # first: what has no descriptor (memory, fsspec's files) is asked nothing more
        return fd if f.seekable() else None
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is an OSError
        return None


class Writeback:
    """Asks the kernel, every :data:`WRITEBACK_BYTES` its writer adds to ``f`` (from where ``f``
    is when this is made), to write them to the disk."""

    def __init__(self, f: BinaryIO) -> None:
        self._f = f
        self._fd = file_descriptor(f)
        self._done = f.tell() if self._fd is not None else 0  # bytes before it were handed to the kernel

    def wrote(self) -> None:
        """Call after each write to ``f``."""
        if self._fd is None:
            return
        end = self._f.tell()
        if end - self._done < WRITEBACK_BYTES:
            return
        self._f.flush()  # a buffered file's bytes reach the kernel first
        try:  # DONTNEED starts writing the range's dirty pages; the file's content is unchanged
            os.posix_fadvise(self._fd, self._done, end - self._done, os.POSIX_FADV_DONTNEED)
        except OSError:  # a file system that takes no advice: its fsync writes everything
            self._fd = None
        self._done = end
