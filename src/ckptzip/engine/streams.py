"""A batch's streams as one table (:class:`Streams`), and the buffers they lie in (:class:`Batch`),
as :func:`~.encode.start_batch` lays them out for the codecs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..transforms import Transform

WHOLE, PLANE, SPARSE = 0, 1, 2  # what a stream is: a tensor's bytes, one of its byte planes, a part of a sparse coding


@dataclass(frozen=True)
class Streams:
    """The streams of a batch, in tensor order and each tensor's streams in order: per stream,
    its tensor, the buffer it lies in (an index into the batch's buffers), its offset there, its
    size in bytes, what it is (``WHOLE``, ``PLANE``, ``SPARSE``) and its number among its
    tensor's streams."""

    tensor: np.ndarray
    base: np.ndarray
    offset: np.ndarray
    size: np.ndarray
    kind: np.ndarray
    index: np.ndarray

    def __len__(self) -> int:
        return int(self.size.size)


@dataclass
class Batch:
    """A batch being encoded: its buffers (planes, sparse parts, whole streams; codec outputs are
    appended as they are made), the streams that lie in them, each tensor's transform and
    checksum (wsum64, int64 on the batch's device)."""

    bases: list[torch.Tensor]
    streams: Streams
    transforms: list[Transform | None]
    checksums: torch.Tensor


class BatchBuilder:
    """Collects a batch's buffers and their streams, buffer by buffer, and each tensor's
    transform; :meth:`build` puts the streams in order."""

    def __init__(self, count: int) -> None:
        self.bases: list[torch.Tensor] = []
        self.transforms: list[Transform | None] = [None] * count
        self._parts: list[tuple[np.ndarray, ...]] = []

    def add(self, buffer: torch.Tensor, tensor: np.ndarray, offset: np.ndarray, size: np.ndarray, kind: int) -> None:
        """A buffer holding streams of ``tensor`` (one entry per stream) at ``offset``, of ``size``."""
        self._parts.append((tensor, np.full(tensor.size, len(self.bases), dtype=np.int64), offset, size,
                            np.full(tensor.size, kind, dtype=np.int8)))
        self.bases.append(buffer)

    def build(self, checksums: torch.Tensor) -> Batch:
        if not self._parts:
            empty = np.zeros(0, np.int64)
            return Batch(self.bases, Streams(empty, empty, empty, empty, np.zeros(0, np.int8), empty), self.transforms,
                          checksums)
        tensor, base, offset, size, kind = (np.concatenate(c) for c in zip(*self._parts))
        order = np.lexsort((offset, tensor))  # tensor order, then plane order (planes lie in order)
        tensor, base, offset, size, kind = (c[order] for c in (tensor, base, offset, size, kind))
        first = np.r_[True, tensor[1:] != tensor[:-1]]
        group_start = np.maximum.accumulate(np.where(first, np.arange(tensor.size), 0))
        streams = Streams(tensor, base, offset, size, kind, np.arange(tensor.size) - group_start)
        return Batch(self.bases, streams, self.transforms, checksums)
