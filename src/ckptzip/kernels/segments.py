"""``wsum64`` of many byte segments in one launch, optionally gathering them into one buffer.

A segment is ``length`` bytes at an address; its checksum numbers words from the segment's own
start (docs/FORMAT.md), or from a given word where it is a part of a larger whole.
:func:`segment_sums` serves the writer (gather the stored chunks of a batch in file order and
checksum each) and the reader (checksum the stored chunks of a batch where they landed, before
any decoder sees them, and tensors copied from single streams).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from ..checksum import wsum64_array
from ..errors import CorruptCheckpointError
from ..memory.tables import to_device
from . import COMPILED, CPU_PIECE_BYTES, INTERPRET, compiled_threads, pieces, run_gpu, use_triton

BLOCK = 8192  # bytes a program handles at once
# Blocks per program: few programs, so the address tables the host builds stay small (two under
# Triton's interpreter, whose masked blocks cost as much as full ones; sums do not depend on it).
ITERS = 2 if INTERPRET else 8
SPAN = BLOCK * ITERS  # bytes per program
WORD_ALIGN = 16  # segments at such addresses, of such lengths, take the word-wise kernel
GATHER_BLOCK = 1024  # bytes a program of the byte gather handles

def gather_bytes(bases: Sequence[torch.Tensor], base_index: np.ndarray, offsets: np.ndarray) -> torch.Tensor:
    """``bases[base_index[i]][offsets[i]]`` for every i (1-D uint8 tensors on one device): one
    launch on a GPU, no host sync; a uint8 tensor on that device."""
    device = bases[0].device if bases else torch.device("cpu")
    if not use_triton(device):
        out_host = np.empty(len(offsets), dtype=np.uint8)
        order = np.argsort(base_index, kind="stable")  # one fancy index per base, over its own positions
        ordered = base_index[order]
        starts = np.flatnonzero(np.r_[True, ordered[1:] != ordered[:-1]]) if order.size else order
        for a, b in zip(starts.tolist(), np.r_[starts[1:], order.size].tolist()):
            sel = order[a:b]
            out_host[sel] = bases[int(ordered[a])].numpy()[offsets[sel]]
        return torch.from_numpy(out_host)
    out = torch.empty(len(offsets), dtype=torch.uint8, device=device)
    if len(offsets):
        base_ptrs = np.array([b.data_ptr() for b in bases], dtype=np.int64)
        addresses = to_device(base_ptrs[base_index.astype(np.int64)] + offsets.astype(np.int64), device)
        run_gpu("_segments_triton", "gather_bytes_kernel", -(-len(offsets) // GATHER_BLOCK), device,
                (addresses, out, len(offsets)), {"BLOCK": GATHER_BLOCK})
    return out


def tensor_sums(datas: Sequence[torch.Tensor]) -> torch.Tensor:
    """``wsum64`` of each whole 1-D uint8 tensor of ``datas`` (one device): :func:`segment_sums`
    with a segment a tensor."""
    count = len(datas)
    return segment_sums(datas, np.arange(count), np.zeros(count, np.int64),
                        np.array([d.numel() for d in datas], dtype=np.int64))


def _as_signed(values: np.ndarray) -> np.ndarray:
    return values.astype(np.uint64).view(np.int64)


def segment_sums(
    bases: Sequence[torch.Tensor],
    base_index: np.ndarray,
    offsets: np.ndarray,
    lengths: np.ndarray,
    *,
    outs: Sequence[torch.Tensor] = (),
    out_index: np.ndarray | None = None,
    out_offsets: np.ndarray | None = None,
    first_words: np.ndarray | None = None,
) -> torch.Tensor:
    """``wsum64`` (int64 tensor on the bases' device, no host sync on a GPU) of each segment
    ``bases[base_index[i]][offsets[i] : offsets[i] + lengths[i]]`` (1-D uint8 tensors), its words
    numbered from ``first_words[i]`` (default 0: from its own start).

    With ``outs``, also copy segment i to ``outs[out_index[i]][out_offsets[i]:]`` in the same pass.
    """
    device = bases[0].device if bases else outs[0].device if outs else torch.device("cpu")
    count = len(lengths)
    if count == 0:
        return torch.zeros(0, dtype=torch.int64, device=device)
    on_cpu = not use_triton(device)
    words = np.zeros(count, dtype=np.int64) if first_words is None else first_words.astype(np.int64)
    if on_cpu and COMPILED is None:
        return _segment_sums_numpy(bases, base_index, offsets, lengths, outs, out_index, out_offsets, words)
    lengths = lengths.astype(np.int64)
    base_ptrs = np.array([b.data_ptr() for b in bases], dtype=np.int64)
    src = base_ptrs[base_index.astype(np.int64)] + offsets.astype(np.int64)
    if on_cpu:
        _check_bounds(bases, base_index, offsets, lengths)
    if outs:
        assert out_index is not None and out_offsets is not None  # given with outs
        out_ptrs = np.array([o.data_ptr() for o in outs], dtype=np.int64)
        dst = out_ptrs[out_index.astype(np.int64)] + out_offsets.astype(np.int64)
        if on_cpu:
            _check_bounds(outs, out_index, out_offsets, lengths)
    else:
        dst = np.zeros(count, dtype=np.int64)
    if on_cpu:
        owner, start, size = pieces(lengths, CPU_PIECE_BYTES)
        found = np.zeros(count, dtype=np.uint64)
        table = np.stack([src[owner] + start, dst[owner] + start if outs else np.zeros_like(owner), size, owner,
                          words[owner] + start // 8], axis=1)
        COMPILED.segments(table, 1, found, compiled_threads(int(lengths.sum())))
        return torch.from_numpy(_as_signed(found))
    owner, start, size = pieces(lengths, SPAN)
    table = np.stack([src[owner] + start, dst[owner] + start, size, words[owner] + start // 8], axis=1)
    sums = torch.zeros(count, dtype=torch.int64, device=device)
    if not owner.size:
        return sums
    aligned = (src % WORD_ALIGN == 0) & (dst % WORD_ALIGN == 0) & (lengths % WORD_ALIGN == 0)
    fast = aligned[owner]
    partial = torch.empty(owner.size, dtype=torch.int64, device=device)
    for kernel, rows in (("segments_words_kernel", np.flatnonzero(fast)), ("segments_kernel", np.flatnonzero(~fast))):
        if rows.size:
            table_dev = to_device(table[rows].reshape(-1), device)
            part = torch.empty(rows.size, dtype=torch.int64, device=device)
            run_gpu("_segments_triton", kernel, rows.size, device, (table_dev, part),
                    {"BLOCK": BLOCK, "ITERS": ITERS, "GATHER": bool(outs)})
            partial[to_device(rows, device)] = part
    sums.index_add_(0, to_device(owner, device), partial)
    return sums


def _check_bounds(buffers: Sequence[torch.Tensor], index: np.ndarray, offsets: np.ndarray, lengths: np.ndarray) -> None:
    """``CorruptCheckpointError`` unless every segment lies within its buffer (the compiled
    kernels read and write raw addresses)."""
    sizes = np.array([b.numel() for b in buffers], dtype=np.int64)
    if ((offsets < 0) | (offsets + lengths > sizes[index.astype(np.int64)])).any():
        raise CorruptCheckpointError("a stored chunk reaches past the bytes that hold it")


def _segment_sums_numpy(
    bases: Sequence[torch.Tensor], base_index: np.ndarray, offsets: np.ndarray, lengths: np.ndarray,
    outs: Sequence[torch.Tensor], out_index: np.ndarray | None, out_offsets: np.ndarray | None,
    first_words: np.ndarray | None = None,
) -> torch.Tensor:
    arrays = [b.numpy() for b in bases]
    targets = [o.numpy() for o in outs]
    sums = np.empty(len(lengths), dtype=np.uint64)
    for i, (b, o, n) in enumerate(zip(base_index.tolist(), offsets.tolist(), lengths.tolist())):
        segment = arrays[b][o : o + n]
        if targets:
            assert out_index is not None and out_offsets is not None  # given with outs
            d = int(out_offsets[i])
            targets[int(out_index[i])][d : d + n] = segment
        sums[i] = wsum64_array(segment, 0 if first_words is None else int(first_words[i]))
    return torch.from_numpy(_as_signed(sums))
