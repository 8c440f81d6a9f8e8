"""Fused byte-plane split / merge with the ``wsum64`` checksum, one launch for many tensors.

``split_many`` writes the byte planes of many tensors (stream j = byte j of every element,
docs/FORMAT.md) into one buffer and returns each tensor's ``wsum64``; ``merge_many`` is the
inverse. Each reads every input byte once and writes every output byte once. Programs find their
tensor through small address tables, so one launch serves a whole batch without packing copies.
On machines without CUDA and Triton, ``split_planes``/``merge_planes`` fall back to torch ops.

The checksum is linear in the data words: an element contributes
``(x << 8·k·(e mod 8/k)) · (2·⌊e / (8/k)⌋ + 1)`` independently, so per-program partial sums add
up (mod 2**64) to the same value in any order.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np
import torch

from ..checksum import wsum64_tensor
from ..transforms import BytePlanes

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the environment
    triton = None

ROWS_PER_PROGRAM = 1024  # rows of 4 elements each
_SAMPLE_EVERY = 64  # blocks whose bytes are counted into the plane histograms
_SAMPLE_BYTES_PER_PLANE = 1 << 16
PLANE_ALIGN = 256  # bytes: planes start at multiples of this, so nvCOMP reads them in place
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def fused_available(device: torch.device, nbytes: int, itemsize: int) -> bool:
    """Whether the fused kernels handle this data (CUDA + Triton, whole rows of 4 elements)."""
    return (
        triton is not None
        and (device.type == "cuda" or _INTERPRET)
        and itemsize in (2, 4, 8)
        and nbytes > 0
        and nbytes % (4 * itemsize) == 0
    )


if triton is not None:

    @triton.jit
    def _element_sum(x, rows, K: tl.constexpr):
        """Σ over a [R, 4] tile of each element's bits, shifted to its place in its 8-byte word,
        times (2·word + 1) (int64, wrapping)."""
        EPW: tl.constexpr = 8 // K
        cols = tl.arange(0, 4)[None, :]
        elem = rows[:, None].to(tl.int64) * 4 + cols
        value = x.to(tl.int64)
        if K < 8:
            value = value & ((1 << (8 * K)) - 1)
        placed = value << ((elem % EPW) * (8 * K))
        return tl.sum(tl.sum(placed * ((elem // EPW) * 2 + 1), axis=1), axis=0)

    @triton.jit
    def _element_ptr(addr, K: tl.constexpr):
        if K == 2:
            return addr.to(tl.pointer_type(tl.int16))
        elif K == 4:
            return addr.to(tl.pointer_type(tl.int32))
        else:
            return addr.to(tl.pointer_type(tl.int64))

    @triton.jit
    def _split_many_kernel(table, partial, hist, K: tl.constexpr, R: tl.constexpr, SAMPLE_EVERY: tl.constexpr):
        # table row per program: src address, planes address, tensor rows, first row, plane stride
        # (int32 units), histogram row
        pid = tl.program_id(0)
        src = _element_ptr(tl.load(table + pid * 6), K)
        dst = tl.load(table + pid * 6 + 1).to(tl.pointer_type(tl.int32))
        nrows = tl.load(table + pid * 6 + 2)
        row0 = tl.load(table + pid * 6 + 3)
        stride = tl.load(table + pid * 6 + 4)
        rows = row0 + tl.arange(0, R)
        mask = rows < nrows
        cols = tl.arange(0, 4)[None, :]
        x = tl.load(src + rows[:, None] * 4 + cols, mask=mask[:, None], other=0)
        tl.store(partial + pid, _element_sum(x, rows, K))
        byte_shift = (cols * 8).to(tl.int32)
        sampled = ((row0 // R) % SAMPLE_EVERY == 0) & (row0 + R <= nrows)
        hist_row = hist + tl.load(table + pid * 6 + 5) * (8 * 256)
        for j in tl.static_range(K):
            b = ((x >> (8 * j)) & 0xFF).to(tl.int32)
            tl.store(dst + j * stride + rows, tl.sum(b << byte_shift, axis=1), mask=mask)
            if sampled:
                counts = tl.histogram(tl.reshape(b, (R * 4,)), 256)
                tl.atomic_add(hist_row + j * 256 + tl.arange(0, 256), counts)

    @triton.jit
    def _merge_many_kernel(table, partial, K: tl.constexpr, R: tl.constexpr):
        # table row per program: planes address, output address, tensor rows, first row, plane stride
        pid = tl.program_id(0)
        src = tl.load(table + pid * 5).to(tl.pointer_type(tl.int32))
        dst = _element_ptr(tl.load(table + pid * 5 + 1), K)
        nrows = tl.load(table + pid * 5 + 2)
        row0 = tl.load(table + pid * 5 + 3)
        stride = tl.load(table + pid * 5 + 4)
        rows = row0 + tl.arange(0, R)
        mask = rows < nrows
        cols = tl.arange(0, 4)[None, :]
        byte_shift = (cols * 8).to(tl.int32)
        if K == 8:
            x = tl.zeros((R, 4), dtype=tl.int64)
        else:
            x = tl.zeros((R, 4), dtype=tl.int32)
        for j in tl.static_range(K):
            packed = tl.load(src + j * stride + rows, mask=mask, other=0)
            b = (packed[:, None] >> byte_shift) & 0xFF
            x = x | (b.to(x.dtype) << (8 * j))
        tl.store(partial + pid, _element_sum(x, rows, K))
        tl.store(dst + rows[:, None] * 4 + cols, x.to(dst.dtype.element_ty), mask=mask[:, None])


def _programs(nrows: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """For tensors of ``nrows`` rows: the tensor of each program and its first row."""
    counts = np.array([-(-n // ROWS_PER_PROGRAM) for n in nrows], dtype=np.int64)
    owner = np.repeat(np.arange(len(nrows), dtype=np.int64), counts)
    first = np.arange(len(owner), dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
    return owner, first * ROWS_PER_PROGRAM


def _per_tensor_sums(partial: torch.Tensor, owner: torch.Tensor, count: int) -> torch.Tensor:
    return torch.zeros(count, dtype=torch.int64, device=partial.device).index_add_(0, owner, partial)


def plane_layout(nbytes: Sequence[int], itemsize: int) -> tuple[list[int], list[int], int]:
    """Where ``split_many`` puts each tensor's planes: start offsets, plane strides (bytes, both
    multiples of PLANE_ALIGN) and the buffer size."""
    starts, strides, end = [], [], 0
    for n in nbytes:
        stride = -(-(n // itemsize) // PLANE_ALIGN) * PLANE_ALIGN
        starts.append(end)
        strides.append(stride)
        end += stride * itemsize
    return starts, strides, end


def split_many(datas: Sequence[torch.Tensor], itemsize: int, hist: torch.Tensor,
               hist_rows: Sequence[int]) -> tuple[torch.Tensor, list[int], list[int], torch.Tensor]:
    """Split 1-D uint8 tensors of one device (each ``fused_available``) into byte planes in one
    launch. Returns the planes buffer, each tensor's planes offset and plane stride (plane j of
    tensor t is ``buffer[start + j·stride :][: nbytes/itemsize]``), and their wsum64 (int64 [T]).
    Sampled byte counts of tensor t's planes are added to ``hist[hist_rows[t]]`` (8×256 int32)."""
    device = datas[0].device
    sizes = [d.numel() for d in datas]
    starts, strides, total = plane_layout(sizes, itemsize)
    planes = torch.empty(total, dtype=torch.uint8, device=device)
    nrows = [n // (4 * itemsize) for n in sizes]
    owner, first = _programs(nrows)
    base = planes.data_ptr()
    columns = [
        np.array([d.data_ptr() for d in datas], dtype=np.int64)[owner],
        (base + np.array(starts, dtype=np.int64))[owner],
        np.array(nrows, dtype=np.int64)[owner],
        first,
        (np.array(strides, dtype=np.int64) // 4)[owner],
        np.array(hist_rows, dtype=np.int64)[owner],
    ]
    table = torch.from_numpy(np.stack(columns, axis=1).reshape(-1)).to(device)
    partial = torch.empty(len(owner), dtype=torch.int64, device=device)
    _split_many_kernel[(len(owner),)](table, partial, hist, K=itemsize, R=ROWS_PER_PROGRAM, SAMPLE_EVERY=_SAMPLE_EVERY)
    owner_dev = torch.from_numpy(owner).to(device)
    return planes, starts, strides, _per_tensor_sums(partial, owner_dev, len(datas))


def merge_many(sources: Sequence[torch.Tensor], itemsize: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Inverse of ``split_many`` for tensors whose planes each lie back to back in one 1-D uint8
    tensor (``sources[t]``, plane stride = its size / itemsize): the data and their wsum64."""
    device = sources[0].device
    outputs = [torch.empty_like(s) for s in sources]
    nrows = [s.numel() // (4 * itemsize) for s in sources]
    owner, first = _programs(nrows)
    columns = [
        np.array([s.data_ptr() for s in sources], dtype=np.int64)[owner],
        np.array([o.data_ptr() for o in outputs], dtype=np.int64)[owner],
        np.array(nrows, dtype=np.int64)[owner],
        first,
        np.array([s.numel() // itemsize // 4 for s in sources], dtype=np.int64)[owner],
    ]
    table = torch.from_numpy(np.stack(columns, axis=1).reshape(-1)).to(device)
    partial = torch.empty(len(owner), dtype=torch.int64, device=device)
    _merge_many_kernel[(len(owner),)](table, partial, K=itemsize, R=ROWS_PER_PROGRAM)
    owner_dev = torch.from_numpy(owner).to(device)
    return outputs, _per_tensor_sums(partial, owner_dev, len(sources))


def split_planes(
    data: torch.Tensor, itemsize: int, hist: torch.Tensor | None = None
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Byte planes of one tensor and its wsum64 (0-d int64 tensor), fused where possible.
    ``hist`` (≥ itemsize × 256 int32 zeros) receives sampled byte counts of each plane."""
    if not fused_available(data.device, data.numel(), itemsize):
        planes = BytePlanes(itemsize).forward(data)
        if hist is not None:
            sample_histograms(planes, hist)
        return planes, wsum64_tensor(data)
    if hist is None:
        hist = torch.zeros(8 * 256, dtype=torch.int32, device=data.device)
    buffer, (start,), (stride,), checksum = split_many([data], itemsize, hist.view(1, -1), [0])
    n = data.numel() // itemsize
    return [buffer[start + j * stride : start + j * stride + n] for j in range(itemsize)], checksum[0]


def merge_planes(planes: list[torch.Tensor], itemsize: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`split_planes`: the data and its wsum64."""
    nbytes = sum(p.numel() for p in planes)
    if not fused_available(planes[0].device, nbytes, itemsize):
        data = BytePlanes(itemsize).inverse(planes, nbytes)
        return data, wsum64_tensor(data)
    first = planes[0]
    adjacent = all(p.data_ptr() == first.data_ptr() + j * first.numel() for j, p in enumerate(planes))
    src = first.as_strided((nbytes,), (1,)) if adjacent else torch.cat(planes)
    (data,), checksum = merge_many([src], itemsize)
    return data, checksum[0]


def sample_histograms(planes: list[torch.Tensor], hist: torch.Tensor) -> None:
    """Add byte counts of evenly spaced samples of each plane into ``hist`` (planes × 256)."""
    n = planes[0].numel()
    if n < ROWS_PER_PROGRAM * 4:
        return
    step = max(1, n // _SAMPLE_BYTES_PER_PLANE)
    for j, plane in enumerate(planes):
        hist.view(-1, 256)[j].add_(torch.bincount(plane[::step].int(), minlength=256).int())
