"""The .ckz container: spec constants, index, writer and reader (docs/FORMAT.md)."""

from .index import BaseRef, Chunk, Index, StreamEntry, TensorEntry, content_hash, digest_hexes
from .reader import ContainerReader
from .spec import DTYPE_NAMES, DTYPES, TORCH_DTYPES, VERSION, is_ckz
from .writer import ContainerWriter

__all__ = [
    "DTYPES",
    "DTYPE_NAMES",
    "TORCH_DTYPES",
    "VERSION",
    "BaseRef",
    "Chunk",
    "ContainerReader",
    "ContainerWriter",
    "Index",
    "StreamEntry",
    "TensorEntry",
    "content_hash",
    "digest_hexes",
    "is_ckz",
]
