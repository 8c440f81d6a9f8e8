"""Coded sizes estimated from byte counts: the order-0 entropy of byte planes, and of samples.

The planner reads plane entropies to pick what it codes; the delta decision compares a tensor's
estimated size as byte planes with its XOR against a base's, from a sample of each.
"""

from __future__ import annotations

import numpy as np
import torch

from ..kernels.planes import ELEMENTS_PER_BLOCK, SAMPLE_EVERY

# A byte plane whose order-0 entropy exceeds this (bits/byte) is near-random: stored raw.
RANDOM_ENTROPY_BITS = 7.5
GPU_COUNT_BYTES = 1 << 24  # sample bytes counted per bincount on a GPU
SAMPLE_RUNS = 16  # blocks of a tensor sampled for its plane entropies ahead of its batch


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
    """Byte counts of each byte plane of each uint8 sample (1-D, or a view of rows; whole
    ``itemsize``-byte elements, one device): ``[samples, itemsize, 256]`` on the host, with one
    copy off a GPU (which holds one group's samples gathered at a time)."""
    if samples[0].is_cuda:
        parts, group, size = [], [], 0
        for i, sample in enumerate(samples):  # bounded groups: a bincount's int32 temporaries are ~12x its input
            group.append(sample)
            size += sample.numel()
            if size >= GPU_COUNT_BYTES or i == len(samples) - 1:
                parts.append(_device_counts(group, itemsize))
                group, size = [], 0
        counts = torch.cat(parts).cpu().numpy()
    else:
        lengths = [s.numel() for s in samples]
        keys = np.empty(sum(lengths), dtype=np.int32)
        planes = np.arange(itemsize, dtype=np.int32) * 256
        at = 0
        for r, sample in enumerate(samples):  # bin of each byte: (sample, plane, value)
            n = lengths[r]
            np.add(sample.numpy().reshape(-1, itemsize), planes + r * itemsize * 256,
                   out=keys[at : at + n].reshape(-1, itemsize))
            at += n
        counts = np.bincount(keys, minlength=len(samples) * itemsize * 256)
    return counts.reshape(len(samples), itemsize, 256)


def sampled_plane_entropies(datas: list[torch.Tensor], itemsizes: np.ndarray) -> np.ndarray:
    """Each tensor's plane entropies (``[tensors, 8]`` bits/byte; rows of 1-byte tensors 0), from
    whole blocks of the GPU split's sample (:data:`~ckptzip.kernels.planes.SAMPLE_EVERY`), at most
    :data:`SAMPLE_RUNS` of them a tensor: a tensor of up to that many sampled blocks gets the
    entropies its split would count, a larger one those of an even subset. Known before any batch
    is split, they let a GPU's batches choose their codecs without waiting for the split; one
    wait an item size for the whole state."""
    entropies = np.zeros((len(datas), 8), dtype=np.float32)
    for k in (2, 4, 8):
        idx = np.flatnonzero(itemsizes == k)
        if idx.size:
            samples = [_sampled_blocks(datas[i], k) for i in idx.tolist()]
            entropies[idx, :k] = entropy_of_count_array(plane_counts(samples, k))
    return entropies


def _sampled_blocks(data: torch.Tensor, itemsize: int) -> torch.Tensor:
    """Whole blocks of :data:`~ckptzip.kernels.planes.ELEMENTS_PER_BLOCK` elements of ``data``
    (1-D uint8) that the split samples, evenly spread, at most :data:`SAMPLE_RUNS`: a view, one
    row a block."""
    block = ELEMENTS_PER_BLOCK * itemsize
    count = data.numel() // block
    sampled = -(-count // SAMPLE_EVERY)  # the blocks the split counts
    step = SAMPLE_EVERY * max(1, -(-sampled // SAMPLE_RUNS))
    return data[: count * block].view(count, block)[::step]


def _device_counts(samples: list[torch.Tensor], itemsize: int) -> torch.Tensor:
    """:func:`plane_counts` of samples on one GPU, left there (flat ``[samples * itemsize * 256]``)."""
    device = samples[0].device
    lengths = torch.tensor([s.numel() // itemsize for s in samples], device=device)
    rows = torch.repeat_interleave(torch.arange(len(samples), dtype=torch.int32, device=device), lengths)
    keys = torch.cat([s.reshape(-1) for s in samples]).view(-1, itemsize).to(torch.int32)
    keys += torch.arange(itemsize, dtype=torch.int32, device=device) * 256
    keys += (rows * (itemsize * 256))[:, None]
    return torch.bincount(keys.view(-1), minlength=len(samples) * itemsize * 256)


def plane_bits(counts: np.ndarray) -> np.ndarray:
    """Estimated coded bits per element of each sample stored as byte planes: the order-0
    entropy of each plane, near-random planes raw."""
    entropy = entropy_of_count_array(counts)
    bits: np.ndarray = np.where(entropy > RANDOM_ENTROPY_BITS, 8.0, entropy).sum(axis=-1)
    return bits


def middle(nbytes: int, size: int, itemsize: int) -> slice:
    """Up to ``size`` bytes from the middle of ``nbytes``, whole elements, starting at a multiple
    of 256 bytes (so word-wise passes over the sample, such as ``delta.xor_bytes``, stay aligned)."""
    take = min(nbytes, size) // itemsize * itemsize
    start = (nbytes - take) // 2 // 256 * 256
    return slice(start, start + take)
