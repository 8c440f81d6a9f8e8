"""Byte-plane split: stream j holds byte j of every element.

Float bytes differ in kind: the top byte carries sign and exponent (a few bits of entropy), the
others are near-random mantissa. Split apart, each plane goes to the codec that suits it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..errors import CorruptCheckpointError
from .base import Transform

ITEMSIZES = (2, 4, 8)


class BytePlanes(Transform):
    """Split elements of ``itemsize`` bytes into ``itemsize`` planes (little-endian byte order)."""

    transform_id = "byteplanes"

    def __init__(self, itemsize: int) -> None:
        if itemsize not in ITEMSIZES:
            raise ValueError(f"byteplanes itemsize must be one of {ITEMSIZES}, got {itemsize!r}")
        self.itemsize = itemsize

    def get_config(self) -> dict[str, Any]:
        return {"id": self.transform_id, "itemsize": self.itemsize}

    def stream_sizes(self, nbytes: int) -> list[int]:
        if nbytes % self.itemsize:
            raise CorruptCheckpointError(f"byteplanes: {nbytes} bytes is not a multiple of itemsize {self.itemsize}")
        return [nbytes // self.itemsize] * self.itemsize

    def forward(self, data: torch.Tensor) -> list[torch.Tensor]:
        planes = data.view(-1, self.itemsize).t().contiguous()
        return list(planes.unbind(0))

    def inverse(self, streams: Sequence[torch.Tensor], nbytes: int) -> torch.Tensor:
        return torch.stack(list(streams), dim=1).view(-1)
