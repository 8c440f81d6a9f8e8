"""ckptzip: lossless, GPU-native compression of deep-learning training checkpoints.

The errors are imported eagerly (they import nothing); the functions and classes below import
torch, so they are imported on first use, and so are the subpackages (``ckptzip.dcp``,
``ckptzip.integrations.lightning``, ...) when first reached as attributes: ``import ckptzip`` and
``ckptzip --help`` stay cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._lazy import lazy_attributes
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
    SnapshotAbandonedError,
    StorageAccessError,
    StorageUnavailableError,
    UnsupportedFormatError,
    UnsupportedObjectError,
    UsageError,
)

if TYPE_CHECKING:
    from . import api as api, dcp as dcp, integrations as integrations, manager as manager, testing as testing
    from . import tier as tier
    from .api import CheckpointReader, CompressedTensor, compress, decompress, load, save, warmup
    from .api import open as open  # a public name, left out of __all__
    from .manager import CheckpointManager, CheckpointSkippedWarning

_LAZY = {
    **dict.fromkeys(
        ("CheckpointReader", "CompressedTensor", "compress", "decompress", "load", "open", "save", "warmup"), ".api"
    ),
    **dict.fromkeys(("CheckpointManager", "CheckpointSkippedWarning"), ".manager"),
}
# Reached as attributes (``ckptzip.dcp.CompressedStorageWriter(...)``), imported on first access.
_SUBMODULES = ("api", "dcp", "integrations", "manager", "testing", "tier")

# What ``from ckptzip import *`` binds: every public name but ``open``, which would shadow the built-in.

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
    "SnapshotAbandonedError",
    "StorageAccessError",
    "StorageUnavailableError",
    "UnsupportedFormatError",
    "UnsupportedObjectError",
    "UsageError",
    "__version__",
    "compress",
    "decompress",
    "load",
    "save",
    "warmup",
]


__getattr__, __dir__ = lazy_attributes(__name__, _LAZY, globals(), _SUBMODULES)
