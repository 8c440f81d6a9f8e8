"""XOR deltas of a tensor against the same tensor of a base checkpoint (docs/FORMAT.md, 2.1).

Consecutive checkpoints of a run share most high bytes of their weights: the XOR of a weight with
its value a few hundred steps earlier has mostly zero sign/exponent bytes, which the byte-plane
coders shrink far more than the weight itself. Optimizer moments change too much to gain, so the
choice is made per tensor, from the estimated coded size of a sample of both.
"""

from __future__ import annotations

import numpy as np
import torch

from .policy import RANDOM_ENTROPY_BITS

SAMPLE_BYTES = 1 << 16  # bytes of each tensor the estimate looks at (from its middle)
MIN_GAIN = 0.03  # a delta is kept when its estimated size is this much smaller


def xor_bytes(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a ^ b`` of two 1-D uint8 tensors of one size and device, a word at a time where aligned."""
    n = a.numel()
    for word in (torch.int64, torch.int32, torch.int16):
        size = word.itemsize
        if n % size == 0 and a.storage_offset() % size == 0 and b.storage_offset() % size == 0:
            return torch.bitwise_xor(a.view(word), b.view(word)).view(torch.uint8)
    return torch.bitwise_xor(a, b)


def _plane_counts(data: torch.Tensor, itemsize: int) -> torch.Tensor:
    """Byte counts of each byte plane of a 1-D uint8 tensor (``[itemsize, 256]``, on the host)."""
    if data.is_cuda:
        planes = data.view(-1, itemsize).to(torch.int32) + 256 * torch.arange(itemsize, device=data.device, dtype=torch.int32)
        return torch.bincount(planes.reshape(-1), minlength=256 * itemsize).view(itemsize, 256).cpu()
    rows = data.numpy().reshape(-1, itemsize)
    return torch.from_numpy(np.stack([np.bincount(rows[:, j], minlength=256) for j in range(itemsize)]))


def _estimated_bits(data: torch.Tensor, itemsize: int) -> float:
    """Estimated coded bits per element: order-0 entropy of each byte plane, near-random planes raw."""
    counts = _plane_counts(data, itemsize).double()
    p = counts / counts.sum(dim=1, keepdim=True)
    entropy = -(p * torch.log2(p.clamp_min(1e-300))).sum(dim=1)
    return float(torch.where(entropy > RANDOM_ENTROPY_BITS, 8.0, entropy).sum())


def delta_pays(current: torch.Tensor, residue: torch.Tensor, itemsize: int) -> bool:
    """Whether storing the XOR residue is estimated to take fewer bytes than the tensor (1-D uint8)."""
    n = current.numel()
    if n < itemsize:
        return False
    take = min(n, SAMPLE_BYTES) // itemsize * itemsize
    start = (n - take) // 2 // itemsize * itemsize
    part = slice(start, start + take)
    return _estimated_bits(residue[part], itemsize) < (1 - MIN_GAIN) * _estimated_bits(current[part], itemsize)
