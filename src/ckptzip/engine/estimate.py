"""Coded sizes estimated from byte counts: the order-0 entropy of byte planes, and of samples.

The planner reads plane entropies to pick what it codes; the delta and LZ trials compare a
tensor's estimated size as byte planes against an alternative from a sample of it.
"""

from __future__ import annotations

import numpy as np
import torch

# A byte plane whose order-0 entropy exceeds this (bits/byte) is near-random: stored raw.
RANDOM_ENTROPY_BITS = 7.5


def entropy_of_counts(counts: torch.Tensor) -> torch.Tensor:
    """Order-0 entropy in bits/byte of each row of byte counts (``[..., 256]``); 0 for empty rows."""
    counts = counts.to(torch.float32)
    p = counts / counts.sum(dim=-1, keepdim=True).clamp_min(1)
    return (-(p * torch.log2(p.clamp_min(1e-30))).sum(dim=-1)).clamp_min(0.0)


def entropy_of_count_array(counts: np.ndarray) -> np.ndarray:
    """:func:`entropy_of_counts` in NumPy (torch ops called from several threads at once compete
    for its OpenMP threads)."""
    freqs = counts.astype(np.float32)
    p = freqs / np.maximum(freqs.sum(axis=-1, keepdims=True), 1)
    entropy: np.ndarray = np.maximum(-(p * np.log2(np.maximum(p, 1e-30))).sum(axis=-1), 0.0)
    return entropy


def plane_counts(samples: list[torch.Tensor], itemsize: int) -> np.ndarray:
    """Byte counts of each byte plane of each 1-D uint8 sample (lengths multiples of ``itemsize``,
    one device): ``[samples, itemsize, 256]`` on the host, from one bincount and one copy."""
    lengths = [s.numel() for s in samples]
    bins = len(samples) * itemsize * 256
    if samples[0].is_cuda:
        device = samples[0].device
        data = torch.cat(samples).to(torch.int32)
        rows = torch.repeat_interleave(torch.arange(len(samples), dtype=torch.int32, device=device),
                                       torch.tensor(lengths, device=device))
        plane = torch.arange(data.numel(), dtype=torch.int32, device=device) % itemsize
        counts = torch.bincount((rows * itemsize + plane) * 256 + data, minlength=bins).cpu().numpy()
    else:
        keys = np.empty(sum(lengths), dtype=np.int32)
        planes = np.arange(itemsize, dtype=np.int32) * 256
        at = 0
        for r, sample in enumerate(samples):  # bin of each byte: (sample, plane, value)
            n = lengths[r]
            np.add(sample.numpy().reshape(-1, itemsize), planes + r * itemsize * 256,
                   out=keys[at : at + n].reshape(-1, itemsize))
            at += n
        counts = np.bincount(keys, minlength=bins)
    return counts.reshape(len(samples), itemsize, 256)


def plane_bits(counts: np.ndarray) -> np.ndarray:
    """Estimated coded bits per element of each sample stored as byte planes: the order-0
    entropy of each plane, near-random planes raw."""
    entropy = entropy_of_count_array(counts)
    bits: np.ndarray = np.where(entropy > RANDOM_ENTROPY_BITS, 8.0, entropy).sum(axis=-1)
    return bits


def middle(nbytes: int, size: int, itemsize: int) -> slice:
    """Up to ``size`` bytes from the middle of ``nbytes``, whole elements, starting at a multiple
    of 256 bytes (GPU codecs read aligned chunks without a copy)."""
    take = min(nbytes, size) // itemsize * itemsize
    start = (nbytes - take) // 2 // 256 * 256
    return slice(start, start + take)
