"""Checksums of the format: XXH3-64 of stored chunks, ``wsum64`` of decoded tensors.

``wsum64`` (docs/FORMAT.md) is the sum modulo 2**64 of ``w_i * (2i + 1)`` over the bytes read as
little-endian u64 words (the tail zero-padded). Integer arithmetic makes it exact and independent
of reduction order, so the CPU and the GPU compute the same value from one pass over the data.
"""

from __future__ import annotations

import numpy as np
import torch
import xxhash

_MASK64 = (1 << 64) - 1
_SMALL = 1 << 16
_BLOCK_WORDS = {"cpu": 1 << 20, "cuda": 1 << 26}


def xxh3_hex(data: torch.Tensor | bytes | bytearray | memoryview) -> str:
    """XXH3-64 (seed 0) of bytes or a 1-D uint8 CPU tensor, as 16 lowercase hex digits."""
    if isinstance(data, torch.Tensor):
        data = data.numpy()
    return f"{xxhash.xxh3_64_intdigest(data):016x}"


def _wsum64_small(data: torch.Tensor) -> int:
    """``wsum64`` of a small CPU tensor with NumPy (fewer calls than the blocked torch version)."""
    raw = data.numpy()
    padded = np.zeros(-(-raw.size // 8) * 8, dtype=np.uint8)
    padded[: raw.size] = raw
    words = padded.view("<u8")
    return int((words * (np.arange(words.size, dtype=np.uint64) * np.uint64(2) + np.uint64(1))).sum(dtype=np.uint64))


def wsum64_tensor(data: torch.Tensor) -> torch.Tensor:
    """``wsum64`` of a 1-D uint8 tensor as a 0-d int64 tensor on the data's device (no sync)."""
    if not data.is_cuda and data.numel() <= _SMALL:
        value = _wsum64_small(data)
        return torch.tensor(value - (1 << 64) if value >= 1 << 63 else value, dtype=torch.int64)
    device = data.device
    nwords, tail = divmod(data.numel(), 8)
    total = torch.zeros((), dtype=torch.int64, device=device)
    if nwords:
        words = data[: nwords * 8]
        if words.storage_offset() % 8:  # an int64 view needs 8-byte alignment (sliced tensors lack it)
            words = words.clone()
        words = words.view(torch.int64)
        block = _BLOCK_WORDS.get(device.type, _BLOCK_WORDS["cuda"])
        for start in range(0, nwords, block):
            stop = min(start + block, nwords)
            weights = torch.arange(2 * start + 1, 2 * stop + 1, 2, dtype=torch.int64, device=device)
            total += (words[start:stop] * weights).sum()
    if tail:
        padded = torch.zeros(8, dtype=torch.uint8, device=device)
        padded[:tail] = data[nwords * 8 :]
        total += padded.view(torch.int64)[0] * (2 * nwords + 1)
    return total


def wsum64(data: torch.Tensor) -> int:
    """``wsum64`` of a 1-D uint8 tensor as an unsigned Python int."""
    return int(wsum64_tensor(data).item()) & _MASK64


def format_wsum64(value: int) -> str:
    """The index form of a ``wsum64`` value."""
    return f"wsum64:{value & _MASK64:016x}"
