"""Checksums of the format: ``wsum64`` of stored chunks and of decoded tensors; XXH3-64 of the index
(and of the stored chunks of version-1 files).

``wsum64`` (docs/FORMAT.md) is the sum modulo 2**64 of ``w_i * (2i + 1)`` over the bytes read as
little-endian u64 words (the tail zero-padded). Integer arithmetic makes it exact and independent
of reduction order, so the CPU and the GPU compute the same value in one pass over the data, many
segments at once (:func:`ckptzip.kernels.segments.segment_sums` on the GPU). Its CPU form here is
NumPy, which releases the GIL, so threads checksum in parallel.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import torch
import xxhash

MASK64 = (1 << 64) - 1  # wsum64 values are unsigned 64-bit: a signed int64 sum & MASK64
_BLOCK_WORDS = 1 << 12  # words per row of the blocked CPU sum
_BLOCK_WEIGHTS = np.arange(1, 2 * _BLOCK_WORDS, 2, dtype=np.uint64)
_TORCH_BLOCK_WORDS = 1 << 26


def xxh3_hex(data: torch.Tensor | npt.NDArray[np.uint8] | bytes | bytearray | memoryview) -> str:
    """XXH3-64 (seed 0) of bytes or a 1-D uint8 CPU tensor or array, as 16 lowercase hex digits."""
    if isinstance(data, torch.Tensor):
        data = data.numpy()
    return f"{xxhash.xxh3_64_intdigest(data.data if isinstance(data, np.ndarray) else data):016x}"


def wsum64_array(raw: np.ndarray, first_word: int = 0) -> int:
    """``wsum64`` of a 1-D uint8 NumPy array as an unsigned int, its words numbered from
    ``first_word`` (the array a part of a larger one that starts there: the parts' sums add up,
    modulo 2**64, to the whole's).

    Blocked: each row of ``_BLOCK_WORDS`` words is one integer dot product with the odd weights,
    and row ``r`` adds ``2·r·_BLOCK_WORDS`` times its plain sum (the weights' offset).
    """
    if first_word:  # word i of the part is word first_word + i of the whole: 2·first_word·Σw more
        return (wsum64_array(raw) + 2 * first_word * _word_sum(raw)) & MASK64
    n = raw.size
    nwords, tail = divmod(n, 8)
    total = 0
    whole = nwords - nwords % _BLOCK_WORDS
    if whole:
        body = raw[: whole * 8]
        if body.ctypes.data % 8:
            body = body.copy()
        rows = body.view("<u8").reshape(-1, _BLOCK_WORDS)
        starts = np.arange(rows.shape[0], dtype=np.uint64) * np.uint64(2 * _BLOCK_WORDS)
        total = int((rows @ _BLOCK_WEIGHTS + starts * rows.sum(axis=1, dtype=np.uint64)).sum(dtype=np.uint64))
    if nwords > whole:
        body = raw[whole * 8 : nwords * 8]
        if body.ctypes.data % 8:
            body = body.copy()
        words = body.view("<u8")
        # the block weights start at 1; these words' at 2·whole + 1 (Python ints: no overflow warnings)
        total += int(words @ _BLOCK_WEIGHTS[: words.size]) + 2 * whole * int(words.sum(dtype=np.uint64))
    if tail:
        last = np.zeros(8, dtype=np.uint8)
        last[:tail] = raw[nwords * 8 :]
        total += int(last.view("<u8")[0]) * (2 * nwords + 1)
    return total & MASK64


def _word_sum(raw: np.ndarray) -> int:
    """Σ of the array's little-endian u64 words (the tail zero-padded), as an unsigned int."""
    nwords, tail = divmod(raw.size, 8)
    body = raw[: nwords * 8]
    if body.ctypes.data % 8:
        body = body.copy()
    total = int(body.view("<u8").sum(dtype=np.uint64))
    if tail:
        last = np.zeros(8, dtype=np.uint8)
        last[:tail] = raw[nwords * 8 :]
        total += int(last.view("<u8")[0])
    return total


def wsum64_tensor(data: torch.Tensor) -> torch.Tensor:
    """``wsum64`` of a 1-D uint8 tensor as a 0-d int64 tensor on the data's device (no sync)."""
    if not data.is_cuda:
        value = wsum64_array(data.numpy())
        return torch.tensor(value - (1 << 64) if value >= 1 << 63 else value, dtype=torch.int64)
    device = data.device
    nwords, tail = divmod(data.numel(), 8)
    total = torch.zeros((), dtype=torch.int64, device=device)
    if nwords:
        words = data[: nwords * 8]
        if words.storage_offset() % 8:  # an int64 view needs 8-byte alignment (sliced tensors lack it)
            words = words.clone()
        words = words.view(torch.int64)
        for start in range(0, nwords, _TORCH_BLOCK_WORDS):
            stop = min(start + _TORCH_BLOCK_WORDS, nwords)
            weights = torch.arange(2 * start + 1, 2 * stop + 1, 2, dtype=torch.int64, device=device)
            total += (words[start:stop] * weights).sum()
    if tail:
        padded = torch.zeros(8, dtype=torch.uint8, device=device)
        padded[:tail] = data[nwords * 8 :]
        total += padded.view(torch.int64)[0] * (2 * nwords + 1)
    return total


def wsum64(data: torch.Tensor) -> int:
    """``wsum64`` of a 1-D uint8 tensor as an unsigned Python int."""
    if not data.is_cuda:
        return wsum64_array(data.numpy())
    return int(wsum64_tensor(data).item()) & MASK64


def format_wsum64(value: int) -> str:
    """The index form of a tensor's ``wsum64`` value."""
    return f"wsum64:{value & MASK64:016x}"
