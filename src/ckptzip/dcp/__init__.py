"""PyTorch Distributed Checkpoint (DCP) storage that compresses every item with ckptzip.

``dcp.save`` / ``dcp.async_save`` / ``dcp.load`` work unchanged, with sharded (DTensor, FSDP2)
state and resharding on load::

    import torch.distributed.checkpoint as dcp
    from ckptzip.dcp import CompressedStorageReader, CompressedStorageWriter

    dcp.save(state, storage_writer=CompressedStorageWriter("ckpt/step100"))
    dcp.load(state, storage_reader=CompressedStorageReader("ckpt/step100"))

See docs/DCP.md for the file layout, safety properties and supported torch versions.
"""

from ._convert import add_parser, ckz_to_dcp, dcp_to_ckz, run
from ._reader import CompressedStorageReader
from ._writer import CompressedStorageWriter

__all__ = [
    "CompressedStorageReader",
    "CompressedStorageWriter",
    "add_parser",
    "ckz_to_dcp",
    "dcp_to_ckz",
    "run",
]
