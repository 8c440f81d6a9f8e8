"""ckptzip: lossless, GPU-native compression of deep-learning training checkpoints."""

from ._version import __version__
from .api import CheckpointReader, CompressedTensor, compress, decompress, load, open, save
from .errors import (
    CheckpointNotFoundError,
    CheckpointWriteError,
    CkptzipError,
    CodecUnavailableError,
    CorruptCheckpointError,
    DeviceUnavailableError,
    UnsupportedFormatError,
    UnsupportedObjectError,
)

__all__ = [
    "CheckpointNotFoundError",
    "CheckpointReader",
    "CheckpointWriteError",
    "CkptzipError",
    "CodecUnavailableError",
    "CompressedTensor",
    "CorruptCheckpointError",
    "DeviceUnavailableError",
    "UnsupportedFormatError",
    "UnsupportedObjectError",
    "__version__",
    "compress",
    "decompress",
    "load",
    "open",
    "save",
]
