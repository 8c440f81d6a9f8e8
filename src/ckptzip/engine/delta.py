"""XOR deltas of a tensor against the same tensor of a base checkpoint (docs/FORMAT.md, 2.1).

Consecutive checkpoints of a run share most high bytes of their weights: the XOR of a weight with
its value a few hundred steps earlier has mostly zero sign/exponent bytes, which the byte-plane
coders shrink far more than the weight itself. Optimizer moments change too much to gain, so the
choice is made per tensor, from the estimated coded size of a sample of both.
"""

from __future__ import annotations

import torch

from ..transforms.sparse import ITEMSIZES, element_view
from .estimate import middle, plane_bits, plane_counts
from .policy import SMALL_TENSOR_BYTES

SAMPLE_BYTES = 1 << 14  # bytes of each tensor the estimate looks at (from its middle)
MIN_GAIN = 0.03  # a delta is kept when its estimated size is this much smaller
GROUP = 256  # tensors whose samples are counted together (bounds the temporaries: about 64 MiB)
# Residues with at most this share of non-zero elements are coded sparse (docs/FORMAT.md, "sparse").
# At density d, E elements of k bytes: the sparse streams hold E/8 + d·E·k bytes before coding;
# the residue's planes code at best to about their entropy, H(d) + 8d bits a byte (a changed byte
# is near-random), k·E·(H(d) + 8d)/8 bytes: 0.39·E for bf16 at d = 1/8 against the sparse
# streams' 0.375·E uncoded, and a Huffman-only GPU coder spends a bit a byte besides (k·E/8).
# Below 1/8 the sparse streams are smaller even uncoded; at RL densities (1-3 %) 3-10x smaller.
SPARSE_MAX_DENSITY = 1 / 8


def xor_bytes(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a ^ b`` of two 1-D uint8 tensors of one size and device, a word at a time where aligned."""
    n = a.numel()
    for word in (torch.int64, torch.int32, torch.int16):
        size = word.itemsize
        if n % size == 0 and a.storage_offset() % size == 0 and b.storage_offset() % size == 0:
            return torch.bitwise_xor(a.view(word), b.view(word)).view(torch.uint8)
    return torch.bitwise_xor(a, b)


def nonzero_count(residue: torch.Tensor, itemsize: int) -> torch.Tensor | None:
    """The non-zero elements of a residue (1-D uint8) that may be coded sparse (an item size of the
    transform, at least SMALL_TENSOR_BYTES): 0-d int64 on its device, no host sync; else None."""
    if itemsize not in ITEMSIZES or residue.numel() < SMALL_TENSOR_BYTES:
        return None
    return torch.count_nonzero(element_view(residue, itemsize))


def codes_sparse(count: int, elements: int) -> bool:
    """Whether a residue of ``count`` non-zero elements out of ``elements`` is coded sparse."""
    return count <= SPARSE_MAX_DENSITY * elements


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
            samples = [middle(currents[j].numel(), SAMPLE_BYTES, itemsize) for j in chunk]
            wholes = [currents[j][sample] for j, sample in zip(chunk, samples)]
            # the group's samples XORed in one pass, not a launch per tensor
            residues = list(xor_bytes(torch.cat(wholes), torch.cat([bases[j][sample].to(device, non_blocking=True)
                                                                    for j, sample in zip(chunk, samples)]))
                            .split([w.numel() for w in wholes]))
            bits = plane_bits(plane_counts(wholes + residues, itemsize))
            for j, whole_bits, residue_bits in zip(chunk, bits[: len(chunk)], bits[len(chunk) :]):
                out[j] = bool(residue_bits < (1 - MIN_GAIN) * whole_bits)
    return out
