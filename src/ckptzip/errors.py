"""The one exception hierarchy of ckptzip.

Every error ckptzip raises on purpose derives from :class:`CkptzipError`. Subclasses also derive
from the matching built-in exception where one exists, so callers can catch either.
"""

from __future__ import annotations


class CkptzipError(Exception):
    """Root of every error ckptzip raises on purpose."""


class CorruptCheckpointError(CkptzipError, ValueError):
    """A file or buffer is damaged: bad magic, bad checksum, bad structure, truncation."""


class CorruptChunkError(CorruptCheckpointError):
    """A codec's chunk does not decode; ``chunk`` is its position among those of one decode call
    (the engine names the tensor, stream and chunk from it)."""

    def __init__(self, message: str, chunk: int) -> None:
        super().__init__(message)
        self.chunk = chunk


class UnsupportedFormatError(CkptzipError, ValueError):
    """The file is a ckptzip file of a format version or feature this reader does not know."""


class CodecUnavailableError(CkptzipError, RuntimeError):
    """A codec or transform cannot run here (needs a GPU, nvCOMP, or an optional package)."""


class UnsupportedObjectError(CkptzipError, TypeError):
    """An object in the state cannot be stored without executing code on load."""


class CheckpointNotFoundError(CkptzipError, FileNotFoundError):
    """No checkpoint (or no valid checkpoint) exists where one was asked for."""


class CheckpointWriteError(CkptzipError, OSError):
    """Writing a checkpoint failed (disk full, permission, I/O); the previous checkpoint is intact."""


class SnapshotAbandonedError(CheckpointWriteError):
    """A save's read of the state did not end before a writer of the state stopped waiting for
    it (an optimizer step, ``CheckpointManager.guard()``); that checkpoint was not written."""


class UsageError(CkptzipError, ValueError):
    """An argument ckptzip cannot act on; the message says what to pass instead."""


class DeviceUnavailableError(CkptzipError, RuntimeError):
    """A tensor is to be placed on a device this machine does not have."""


class StorageUnavailableError(CkptzipError, ImportError):
    """The fsspec implementation for a URL's protocol (for example s3fs) is not installed."""


class StorageAccessError(CkptzipError, PermissionError):
    """An object store refused access (no credentials, or none that allow it); the message says
    how to give them."""


class DecodeBudgetError(CkptzipError, MemoryError):
    """A checkpoint declares more decoded bytes than the caller's ``max_bytes`` allows, or without
    it than the target device can hold; nothing was allocated for its tensors."""


class GpuMemoryError(CkptzipError, MemoryError):
    """Too little GPU memory can be had for a call (below the documented minimum, or what a
    tensor needs); the message gives the numbers. Nothing was written or changed."""


class TargetMismatchError(CkptzipError, ValueError):
    """A checkpoint does not fit the object it is restored into (a missing entry, a shape or dtype)."""


class MissingBaseError(CkptzipError, LookupError):
    """A checkpoint stores tensors as XOR deltas against a base checkpoint that was not given, is
    missing, is damaged, or is not the one it was written against; the message names the base."""
