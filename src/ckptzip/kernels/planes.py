"""Fused byte-plane split / merge with the ``wsum64`` checksum, in one pass over the data.

``split_planes(data, k)`` returns the ``k`` byte planes of 1-D uint8 ``data`` (stream j = byte j
of every element, docs/FORMAT.md) and its ``wsum64`` as a 0-d int64 tensor; ``merge_planes`` is
the inverse. On CUDA with Triton each reads every input byte once and writes every output byte
once; elsewhere they fall back to torch ops (``BytePlanes`` and ``checksum.wsum64_tensor``).

The checksum is linear in the data words, so each element contributes
``(x << 8·k·(e mod 8/k)) · (2·⌊e / (8/k)⌋ + 1)`` independently and partial sums per program
add up (mod 2**64) to the same value in any order.
"""

from __future__ import annotations

import os

import torch

from ..checksum import wsum64_tensor
from ..transforms import BytePlanes

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the environment
    triton = None

_ROWS_PER_PROGRAM = 1024  # rows of 4 elements each
_SAMPLE_EVERY = 64  # programs whose bytes are counted into the plane histograms
_SAMPLE_BYTES_PER_PLANE = 1 << 16
_INT_VIEW = {2: torch.int16, 4: torch.int32, 8: torch.int64}
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def fused_available(device: torch.device, nbytes: int, itemsize: int) -> bool:
    """Whether the fused kernels handle this data (CUDA + Triton, whole rows of 4 elements)."""
    return (
        triton is not None
        and (device.type == "cuda" or _INTERPRET)
        and itemsize in _INT_VIEW
        and nbytes > 0
        and nbytes % (4 * itemsize) == 0
    )


if triton is not None:

    @triton.jit
    def _element_sums(x, rows, K: tl.constexpr):
        """(Σ contribution·(2·word+1), Σ contribution) over a [R, 4] tile of elements, where an
        element's contribution is its bits shifted to its place in its 8-byte word (int64, wrapping)."""
        EPW: tl.constexpr = 8 // K
        cols = tl.arange(0, 4)[None, :]
        elem = rows[:, None].to(tl.int64) * 4 + cols
        word = elem // EPW
        shift = (elem % EPW) * (8 * K)
        value = x.to(tl.int64)
        if K < 8:
            value = value & ((1 << (8 * K)) - 1)
        placed = value << shift
        weighted = tl.sum(tl.sum(placed * (word * 2 + 1), axis=1), axis=0)
        plain = tl.sum(tl.sum(placed, axis=1), axis=0)
        return weighted, plain

    @triton.jit
    def _split_kernel(src, dst, s1, s0, hist, hist_row, nrows, K: tl.constexpr, R: tl.constexpr,
                      SAMPLE_EVERY: tl.constexpr):
        pid = tl.program_id(0)
        rows = pid * R + tl.arange(0, R)
        mask = rows < nrows
        cols = tl.arange(0, 4)[None, :]
        x = tl.load(src + rows[:, None].to(tl.int64) * 4 + cols, mask=mask[:, None], other=0)
        weighted, plain = _element_sums(x, rows, K)
        tl.store(s1 + pid, weighted)
        tl.store(s0 + pid, plain)
        byte_shift = (cols * 8).to(tl.int32)
        sampled = (pid % SAMPLE_EVERY == 0) & ((pid + 1) * R <= nrows)
        row_base = hist + tl.load(hist_row + pid).to(tl.int64) * (8 * 256)
        for j in tl.static_range(K):
            b = ((x >> (8 * j)) & 0xFF).to(tl.int32)
            packed = tl.sum(b << byte_shift, axis=1)
            tl.store(dst + j * nrows + rows, packed, mask=mask)
            if sampled:
                counts = tl.histogram(tl.reshape(b, (R * 4,)), 256)
                tl.atomic_add(row_base + j * 256 + tl.arange(0, 256), counts)

    @triton.jit
    def _merge_kernel(src, dst, partial, nrows, K: tl.constexpr, R: tl.constexpr):
        pid = tl.program_id(0)
        rows = pid * R + tl.arange(0, R)
        mask = rows < nrows
        cols = tl.arange(0, 4)[None, :]
        byte_shift = (cols * 8).to(tl.int32)
        if K == 8:
            x = tl.zeros((R, 4), dtype=tl.int64)
        else:
            x = tl.zeros((R, 4), dtype=tl.int32)
        for j in tl.static_range(K):
            packed = tl.load(src + j * nrows + rows, mask=mask, other=0)
            b = (packed[:, None] >> byte_shift) & 0xFF
            x = x | (b.to(x.dtype) << (8 * j))
        weighted, _ = _element_sums(x, rows, K)
        tl.store(partial + pid, weighted)
        out = x.to(dst.dtype.element_ty)
        tl.store(dst + rows[:, None].to(tl.int64) * 4 + cols, out, mask=mask[:, None])


def _grid(nrows: int) -> tuple[int]:
    return (triton.cdiv(nrows, _ROWS_PER_PROGRAM),)


def split_planes(
    data: torch.Tensor, itemsize: int, hist: torch.Tensor | None = None
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Byte planes of ``data`` and its wsum64 (0-d int64 tensor), fused where possible.

    ``hist``, an int32 tensor of at least ``itemsize × 256`` zeros, receives byte counts of each
    plane over a sample of the data (every 64th block of 4096 elements, whole blocks only).
    """
    if not fused_available(data.device, data.numel(), itemsize):
        planes = BytePlanes(itemsize).forward(data)
        if hist is not None:
            sample_histograms(planes, hist)
        return planes, wsum64_tensor(data)
    if hist is None:
        hist = torch.zeros(8 * 256, dtype=torch.int32, device=data.device)
    out, s1, _ = split_packed(data, itemsize, hist, None)
    return list(out.view(itemsize, -1).unbind(0)), s1.sum()


def block_bytes(itemsize: int) -> int:
    """Bytes one program of the fused kernels handles: pack tensors at multiples of this."""
    return _ROWS_PER_PROGRAM * 4 * itemsize


def split_packed(
    packed: torch.Tensor, itemsize: int, hist: torch.Tensor, hist_rows: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One fused pass over ``packed`` (fused_available must hold): its byte planes as one
    ``[itemsize, n/itemsize]`` buffer, and per block of :func:`block_bytes` the weighted and plain
    checksum sums (int64). Sampled byte counts go to ``hist`` (rows of 8×256 int32), row
    ``hist_rows[block]`` (all row 0 when None)."""
    nrows = packed.numel() // (4 * itemsize)
    out = torch.empty_like(packed)
    grid = _grid(nrows)
    s1 = torch.empty(grid[0], dtype=torch.int64, device=packed.device)
    s0 = torch.empty_like(s1)
    if hist_rows is None:
        hist_rows = torch.zeros(grid[0], dtype=torch.int32, device=packed.device)
    _split_kernel[grid](packed.view(_INT_VIEW[itemsize]), out.view(torch.int32), s1, s0, hist, hist_rows, nrows,
                        K=itemsize, R=_ROWS_PER_PROGRAM, SAMPLE_EVERY=_SAMPLE_EVERY)
    return out, s1, s0


def sample_histograms(planes: list[torch.Tensor], hist: torch.Tensor) -> None:
    """Add byte counts of evenly spaced samples of each plane into ``hist`` (planes × 256)."""
    n = planes[0].numel()
    if n < _ROWS_PER_PROGRAM * 4:
        return
    step = max(1, n // (_SAMPLE_BYTES_PER_PLANE))
    for j, plane in enumerate(planes):
        hist.view(-1, 256)[j].add_(torch.bincount(plane[::step].int(), minlength=256).int())


def merge_planes(planes: list[torch.Tensor], itemsize: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`split_planes`: the data and its wsum64."""
    nbytes = sum(p.numel() for p in planes)
    if not fused_available(planes[0].device, nbytes, itemsize):
        data = BytePlanes(itemsize).inverse(planes, nbytes)
        return data, wsum64_tensor(data)
    first = planes[0]
    adjacent = all(p.data_ptr() == first.data_ptr() + j * first.numel() for j, p in enumerate(planes))
    src = first.as_strided((nbytes,), (1,)) if adjacent else torch.cat(planes)
    nrows = nbytes // (4 * itemsize)
    out = torch.empty(nbytes, dtype=torch.uint8, device=src.device)
    grid = _grid(nrows)
    partial = torch.empty(grid[0], dtype=torch.int64, device=src.device)
    _merge_kernel[grid](src.view(torch.int32), out.view(_INT_VIEW[itemsize]), partial, nrows,
                        K=itemsize, R=_ROWS_PER_PROGRAM)
    return out, partial.sum()
