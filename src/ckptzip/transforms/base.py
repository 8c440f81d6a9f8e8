"""The transform interface: invertible maps from a tensor's bytes to one or more byte streams."""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import Any, ClassVar

import torch


class Transform(abc.ABC):
    """An invertible map from 1-D uint8 data to byte streams, on any device."""

    transform_id: ClassVar[str]

    @abc.abstractmethod
    def forward(self, data: torch.Tensor) -> list[torch.Tensor]:
        """Split ``data`` (1-D uint8, contiguous) into streams on the same device."""

    @abc.abstractmethod
    def inverse(self, streams: Sequence[torch.Tensor], nbytes: int) -> torch.Tensor:
        """Rebuild the ``nbytes`` of data from the streams ``forward`` made."""

    @abc.abstractmethod
    def stream_sizes(self, nbytes: int) -> list[int]:
        """Sizes of the streams ``forward`` makes from ``nbytes`` of data (for validation)."""

    def get_config(self) -> dict[str, Any]:
        """JSON-able configuration with an ``"id"`` key."""
        return {"id": self.transform_id}
