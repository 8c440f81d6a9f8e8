"""The .ckz container: spec constants, index, writer and reader (docs/FORMAT.md)."""

from .index import Chunk, Index, StreamEntry, TensorEntry
from .reader import ContainerReader
from .spec import DTYPE_NAMES, DTYPES, VERSION
from .writer import ContainerWriter

__all__ = [
    "DTYPES",
    "DTYPE_NAMES",
    "VERSION",
    "Chunk",
    "ContainerReader",
    "ContainerWriter",
    "Index",
    "StreamEntry",
    "TensorEntry",
]
