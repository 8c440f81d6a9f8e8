"""PyTorch Distributed Checkpoint (DCP) storage that compresses every item with ckptzip.

``dcp.save`` / ``dcp.async_save`` / ``dcp.load`` work unchanged, with sharded (DTensor, FSDP2)
state and resharding on load::

    import torch.distributed.checkpoint as dcp
    from ckptzip.dcp import CompressedStorageReader, CompressedStorageWriter

    dcp.save(state, storage_writer=CompressedStorageWriter("ckpt/step100"))
    dcp.load(state, storage_reader=CompressedStorageReader("ckpt/step100"))

See docs/DCP.md for the file layout, safety properties and supported torch versions. The
names below are imported on first use (``import ckptzip.dcp`` imports no torch); the
``ckptzip dcp-convert`` command lives with the command line, in :mod:`ckptzip.cli.dcp`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_attributes

if TYPE_CHECKING:
    from ._convert import ckz_to_dcp, dcp_to_ckz
    from ._reader import CompressedStorageReader
    from ._writer import CompressedStorageWriter

_LAZY = {
    "CompressedStorageReader": "._reader",
    "CompressedStorageWriter": "._writer",
    "ckz_to_dcp": "._convert",
    "dcp_to_ckz": "._convert",
}

__all__ = ["CompressedStorageReader", "CompressedStorageWriter", "ckz_to_dcp", "dcp_to_ckz"]


__getattr__, __dir__ = lazy_attributes(__name__, _LAZY, globals())
