"""Sparse coding: a bitmap of the non-zero elements, then the non-zero elements' byte planes.

An XOR delta of weights that barely moved is mostly zero elements. Byte planes of it still cost
every coder at least a bit per byte where it works byte by byte (Huffman: ``planes·elements/8``
bytes at best); this transform keeps one bit per element and the changed elements' bytes only.

Streams: the bitmap (bit ``e % 8`` of byte ``e // 8`` is set where element ``e`` is not zero,
``np.packbits(..., bitorder="little")``; bits past the last element are zero), then the ``count``
non-zero elements in order split into ``itemsize`` byte planes of ``count`` bytes each. The torch
ops below run alike on the CPU and on CUDA, with no host sync (``count`` sizes the gather).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import torch

from ..errors import CorruptCheckpointError
from .base import Transform
from .byteplanes import BytePlanes

ITEMSIZES = (1, 2, 4, 8)
_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # element views: -0.0 is not zero


def element_view(data: torch.Tensor, itemsize: int) -> torch.Tensor:
    """1-D uint8 data (aligned to ``itemsize``) as integer elements: a bit pattern is zero or not."""
    return data.view(_INTS[itemsize])


# Eight bytes of 0 or 1 read as a little-endian int64 and multiplied by this: byte i lands on bit
# 56 + i of the product, and no other partial product reaches the top byte or carries into it.
_GATHER_BITS = 0x0102040810204080


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """A 1-D bool tensor as a little-endian bitmap (uint8, ``ceil(n/8)`` bytes, zero tail bits):
    each 8 elements' bytes, read as one int64, gathered into one byte by a multiply and a shift
    (three element-wise passes over ``n / 8`` words; a padded copy first where ``n`` is not a
    multiple of 8 or the mask is not 8-byte aligned)."""
    n = mask.numel()
    ones = mask.view(torch.uint8)  # a bool is one byte, 0 or 1
    if n % 8 or ones.storage_offset() % 8:
        padded = torch.zeros(-(-n // 8) * 8, dtype=torch.uint8, device=mask.device)
        padded[:n] = ones
        ones = padded
    return ((ones.view(torch.int64) * _GATHER_BITS) >> 56).to(torch.uint8)


def unpack_bits(bitmap: torch.Tensor, elements: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The mask of ``elements`` elements in a bitmap, and (0-d int64) its set bits, plus
    ``elements + 1`` if any bit past the last element is set (so it exceeds any valid count)."""
    shifts = torch.arange(8, dtype=torch.uint8, device=bitmap.device)
    table = (torch.arange(256, dtype=torch.uint8, device=bitmap.device)[:, None] >> shifts) & 1  # byte -> its bits
    bits = table.index_select(0, bitmap.to(torch.int32)).view(-1)  # 0 or 1 a byte: a bool view
    inside = torch.count_nonzero(bits[:elements])
    tail = torch.count_nonzero(bits[elements:])
    return bits[:elements].view(torch.bool), inside + (tail != 0) * (elements + 1)


# Tensors whose elements forward_many codes together: a group's concatenated residues, masks and
# gathered values are temporaries of about this many bytes (a launch per op and group, not per tensor).
GROUP_BYTES = 64 << 20
# Devices where it groups them: on a GPU each op's launch and Python cost more than the group's
# concatenation; on a CPU the concatenation is a copy that costs more than the calls it saves.
GROUPED_DEVICES = frozenset({"cuda"})


def forward_many(transforms: Sequence[Sparse], datas: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
    """``[t.forward(d) for t, d in zip(transforms, datas)]``, the same bytes, with each op run once
    over groups of tensors of one item size (up to :data:`GROUP_BYTES`) instead of once a tensor:
    a group's elements are concatenated, masked, gathered and split into planes together, and each
    tensor's streams are views of the group's (on :data:`GROUPED_DEVICES`). Tensors whose element
    count is not a multiple of 8 (their bitmaps would not end on a byte) are coded one by one."""
    out: list[list[torch.Tensor] | None] = [None] * len(datas)
    groups: dict[int, list[list[int]]] = {}
    for i, (t, d) in enumerate(zip(transforms, datas)):
        if d.device.type not in GROUPED_DEVICES or (d.numel() // t.itemsize) % 8:
            out[i] = t.forward(d)
            continue
        runs = groups.setdefault(t.itemsize, [[]])
        if runs[-1] and sum(datas[j].numel() for j in runs[-1]) + d.numel() > GROUP_BYTES:
            runs.append([])
        runs[-1].append(i)
    for k, runs in groups.items():
        for members in runs:
            for i, streams in zip(members, _forward_group(k, [transforms[i] for i in members],
                                                          [datas[i] for i in members])):
                out[i] = streams
    assert all(streams is not None for streams in out)
    return cast(list[list[torch.Tensor]], out)


def _forward_group(itemsize: int, transforms: Sequence[Sparse], datas: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
    """The streams of tensors of one item size, whose element counts are multiples of 8."""
    x = torch.cat([element_view(d if d.storage_offset() % itemsize == 0 else d.clone(), itemsize) for d in datas])
    mask = x != 0
    counts = [t.count for t in transforms]
    values = x[torch.nonzero_static(mask, size=sum(counts)).view(-1)].view(torch.uint8)
    planes = [values] if itemsize == 1 else BytePlanes(itemsize).forward(values)
    bitmap = pack_bits(mask)
    streams, element, value = [], 0, 0
    for d, count in zip(datas, counts):
        elements = d.numel() // itemsize
        streams.append([bitmap[element // 8 : (element + elements) // 8],
                        *(p[value : value + count] for p in planes)])
        element += elements
        value += count
    return streams


class Sparse(Transform):
    """Bitmap of the non-zero ``itemsize``-byte elements, then ``count`` values in byte planes."""

    transform_id = "sparse"

    def __init__(self, itemsize: int, count: int) -> None:
        if type(itemsize) is not int or itemsize not in ITEMSIZES:
            raise ValueError(f"sparse itemsize must be one of {ITEMSIZES}, got {itemsize!r}")
        if type(count) is not int or count < 0:
            raise ValueError(f"sparse count must be a non-negative integer, got {count!r}")
        self.itemsize = itemsize
        self.count = count

    def get_config(self) -> dict[str, Any]:
        return {"id": self.transform_id, "itemsize": self.itemsize, "count": self.count}

    def elements(self, nbytes: int) -> int:
        """Elements of ``nbytes`` of data, checked against the configuration."""
        if nbytes % self.itemsize:
            raise CorruptCheckpointError(f"sparse: {nbytes} bytes is not a multiple of itemsize {self.itemsize}")
        elements = nbytes // self.itemsize
        if self.count > elements:
            raise CorruptCheckpointError(f"sparse: count {self.count} exceeds the {elements} elements")
        return elements

    def stream_sizes(self, nbytes: int) -> list[int]:
        return [-(-self.elements(nbytes) // 8)] + [self.count] * self.itemsize

    def forward(self, data: torch.Tensor) -> list[torch.Tensor]:
        """The streams of ``data``, which must have exactly ``count`` non-zero elements."""
        if data.storage_offset() % self.itemsize:
            data = data.clone()
        x = element_view(data, self.itemsize)
        mask = x != 0
        values = x[torch.nonzero_static(mask, size=self.count).view(-1)].view(torch.uint8)
        planes = [values] if self.itemsize == 1 else BytePlanes(self.itemsize).forward(values)
        return [pack_bits(mask), *planes]

    def values(self, planes: Sequence[torch.Tensor]) -> torch.Tensor:
        """The non-zero elements' bytes (uint8, ``count·itemsize``) from their planes."""
        if self.itemsize == 1:
            return planes[0]
        return BytePlanes(self.itemsize).inverse(planes, self.count * self.itemsize)

    def verify(self, found: int, elements: int) -> None:
        """Raise where the bitmap's count (:func:`unpack_bits`) is not the configuration's."""
        if found > elements:
            raise CorruptCheckpointError(f"sparse: the bitmap has bits set past its {elements} elements")
        if found != self.count:
            raise CorruptCheckpointError(f"sparse: the bitmap marks {found} non-zero elements, the index {self.count}")

    def scatter(self, mask: torch.Tensor, values: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Fill ``out`` (1-D uint8 of the data's size): zeros, ``values`` where ``mask`` is set
        (whose set bits :meth:`verify` checked)."""
        out.zero_()
        element_view(out, self.itemsize).masked_scatter_(mask, element_view(values, self.itemsize))
        return out

    def inverse(self, streams: Sequence[torch.Tensor], nbytes: int) -> torch.Tensor:
        elements = self.elements(nbytes)
        mask, found = unpack_bits(streams[0], elements)
        self.verify(int(found), elements)
        out = torch.empty(nbytes, dtype=torch.uint8, device=streams[0].device)
        return self.scatter(mask, self.values(streams[1:]), out)
