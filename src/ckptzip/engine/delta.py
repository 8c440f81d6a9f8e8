"""XOR deltas of a tensor against the same tensor of a base checkpoint (docs/FORMAT.md, 2.1).

Consecutive checkpoints of a run share most high bytes of their weights: the XOR of a weight with
its value a few hundred steps earlier has mostly zero sign/exponent bytes, which the byte-plane
coders shrink far more than the weight itself. Optimizer moments change too much to gain, so the
choice is made per tensor, from the estimated coded size of a sample of both.
"""

from __future__ import annotations

import torch

from .estimate import middle, plane_bits, plane_counts

SAMPLE_BYTES = 1 << 14  # bytes of each tensor the estimate looks at (from its middle)
MIN_GAIN = 0.03  # a delta is kept when its estimated size is this much smaller
GROUP = 256  # tensors whose samples are counted together (bounds the temporaries: about 64 MiB)


def xor_bytes(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a ^ b`` of two 1-D uint8 tensors of one size and device, a word at a time where aligned."""
    n = a.numel()
    for word in (torch.int64, torch.int32, torch.int16):
        size = word.itemsize
        if n % size == 0 and a.storage_offset() % size == 0 and b.storage_offset() % size == 0:
            return torch.bitwise_xor(a.view(word), b.view(word)).view(torch.uint8)
    return torch.bitwise_xor(a, b)


def deltas_that_pay(currents: list[torch.Tensor], bases: list[torch.Tensor], itemsizes: list[int]) -> list[bool]:
    """For each tensor (1-D uint8) and its base (same size, any device): whether storing their XOR
    is estimated to take fewer bytes than the tensor, from a sample of each (its middle ``SAMPLE_BYTES``).
    Batched: one histogram and one host copy per device, item size and ``GROUP`` tensors."""
    out = [False] * len(currents)
    groups: dict[tuple[torch.device, int], list[int]] = {}
    for j, (data, itemsize) in enumerate(zip(currents, itemsizes)):
        if data.numel() >= itemsize:
            groups.setdefault((data.device, itemsize), []).append(j)
    for (device, itemsize), members in groups.items():
        for first in range(0, len(members), GROUP):
            chunk = members[first : first + GROUP]
            wholes, residues = [], []
            for j in chunk:
                sample = middle(currents[j].numel(), SAMPLE_BYTES, itemsize)
                whole = currents[j][sample]
                wholes.append(whole)
                residues.append(xor_bytes(whole, bases[j][sample].to(device, non_blocking=True)))
            bits = plane_bits(plane_counts(wholes + residues, itemsize))
            for j, whole_bits, residue_bits in zip(chunk, bits[: len(chunk)], bits[len(chunk) :]):
                out[j] = bool(residue_bits < (1 - MIN_GAIN) * whole_bits)
    return out
