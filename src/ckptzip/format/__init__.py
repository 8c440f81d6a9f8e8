"""The .ckz container: spec constants, index, writer and reader (docs/FORMAT.md)."""

from .index import BaseRef, Chunk, Index, StreamEntry, TensorEntry, content_hash
from .reader import ContainerReader
from .spec import DTYPE_NAMES, DTYPES, VERSION
from .writer import ContainerWriter

__all__ = [
    "DTYPES",
    "DTYPE_NAMES",
    "VERSION",
    "BaseRef",
    "Chunk",
    "ContainerReader",
    "ContainerWriter",
    "Index",
    "StreamEntry",
    "TensorEntry",
    "content_hash",
]
