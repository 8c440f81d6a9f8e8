"""ckptzip: lossless, GPU-native compression of deep-learning training checkpoints.

The errors are imported eagerly (they import nothing); the functions and classes below import
torch, so they are imported on first use: ``import ckptzip`` and ``ckptzip --help`` stay cheap.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._version import __version__
from .errors import (
    CheckpointNotFoundError,
    CheckpointWriteError,
    CkptzipError,
    CodecUnavailableError,
    CorruptCheckpointError,
    DecodeBudgetError,
    DeviceUnavailableError,
    GpuMemoryError,
    StorageAccessError,
    StorageUnavailableError,
    UnsupportedFormatError,
    UnsupportedObjectError,
    UsageError,
)

if TYPE_CHECKING:
    from .api import CheckpointReader, CompressedTensor, compress, decompress, load, open, save, warmup
    from .manager import CheckpointManager, CheckpointSkippedWarning

_LAZY = {
    **dict.fromkeys(
        ("CheckpointReader", "CompressedTensor", "compress", "decompress", "load", "open", "save", "warmup"), ".api"
    ),
    **dict.fromkeys(("CheckpointManager", "CheckpointSkippedWarning"), ".manager"),
}

__all__ = [
    "CheckpointManager",
    "CheckpointNotFoundError",
    "CheckpointReader",
    "CheckpointSkippedWarning",
    "CheckpointWriteError",
    "CkptzipError",
    "CodecUnavailableError",
    "CompressedTensor",
    "CorruptCheckpointError",
    "DecodeBudgetError",
    "DeviceUnavailableError",
    "GpuMemoryError",
    "StorageAccessError",
    "StorageUnavailableError",
    "UnsupportedFormatError",
    "UnsupportedObjectError",
    "UsageError",
    "__version__",
    "compress",
    "decompress",
    "load",
    "open",
    "save",
    "warmup",
]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name], __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
