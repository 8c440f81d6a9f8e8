"""ckptzip: lossless, GPU-native compression of deep-learning training checkpoints."""

from ._version import __version__
from .api import CheckpointReader, CompressedTensor, compress, decompress, load, open, save, warmup
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
from .manager import CheckpointManager, CheckpointSkippedWarning

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
