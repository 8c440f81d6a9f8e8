"""Byte-plane split and merge (docs/FORMAT.md, ``byteplanes``) of many tensors at once, with each
tensor's ``wsum64`` from the same pass and, when splitting, sampled byte counts of every plane.

Plane ``j`` of a tensor holds byte ``j`` of every element. Split reads every input byte once and
writes every plane byte once; merge the reverse. Planes may lie anywhere (a table gives each
plane's address), so the reader merges raw planes in place in the stored bytes and coded planes
where the decoder put them, without copies. Any element count works.

The checksum is linear in the data words: element ``e`` of ``k`` bytes contributes
``(x << 8·k·(e mod 8/k)) · (2·⌊e / (8/k)⌋ + 1)`` independently, so per-program partial sums add up
(mod 2**64) to the same value in any order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from ..checksum import wsum64_array
from ..errors import CorruptCheckpointError
from ..memory.tables import to_device
from . import COMPILED, CPU_PIECE_BYTES, INTERPRET, compiled_threads, pieces, run_gpu, use_triton

ELEMENTS_PER_BLOCK = 4096  # elements a program handles at once
# Few programs, so the address tables the host builds stay small (two under Triton's interpreter,
# whose masked blocks cost as much as full ones; the result does not depend on it).
BLOCKS_PER_PROGRAM = 2 if INTERPRET else 16
ELEMENTS_PER_PROGRAM = ELEMENTS_PER_BLOCK * BLOCKS_PER_PROGRAM
PLANE_ALIGN = 256  # bytes: plane starts in a planes buffer, so nvCOMP reads and writes them in place
SAMPLE_EVERY = 16  # programs whose bytes are counted into the plane histograms (GPU)
_SAMPLE_ELEMENTS = 1 << 13  # elements sampled per tensor (CPU)
_CPU_BLOCK = 1 << 16  # elements per step of the NumPy split/merge: its planes' slices stay in cache
MAX_ITEMSIZE = 8


def plane_layout(nbytes: Sequence[int] | npt.NDArray[np.int64], itemsize: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Where planes go in a planes buffer: each tensor's first plane offset and plane stride (both
    multiples of PLANE_ALIGN), and the buffer size."""
    n = np.asarray(nbytes, dtype=np.int64) // itemsize
    strides = -(-n // PLANE_ALIGN) * PLANE_ALIGN
    sizes = strides * itemsize
    starts = np.cumsum(sizes) - sizes
    return starts, strides, int(sizes.sum())


def _programs(elements: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For tensors of ``elements`` elements: the tensor of each program and its first element."""
    owner, first, _ = pieces(elements, ELEMENTS_PER_PROGRAM)
    return owner, first


def _table(rows: list[np.ndarray], count: int) -> np.ndarray:
    """A table of ``count`` rows of the split and merge kernels: columns 0-3, then plane addresses."""
    table = np.zeros((count, 4 + MAX_ITEMSIZE), dtype=np.int64)
    for c, column in enumerate(rows):
        if column.ndim == 1:
            table[:, c] = column
        else:
            table[:, 4 : 4 + column.shape[1]] = column
    return table


def _launch(kernel: str, device: torch.device, rows: list[np.ndarray], owner: np.ndarray, count: int,
            *args: torch.Tensor, **meta: object) -> torch.Tensor:
    """Launch ``kernel`` over a table of one row per program (columns 0-3, then plane addresses);
    return the per-tensor sums of the programs' partial checksums."""
    table = _table(rows, owner.size)
    sums = torch.zeros(count, dtype=torch.int64, device=device)
    if owner.size:
        table_dev = to_device(table.reshape(-1), device)
        partial = torch.empty(owner.size, dtype=torch.int64, device=device)
        run_gpu("_planes_triton", kernel, owner.size, device, (table_dev, partial, *args),
                {"E": ELEMENTS_PER_BLOCK, "ITERS": BLOCKS_PER_PROGRAM, **meta})
        sums.index_add_(0, to_device(owner, device), partial)
    return sums


def _run_compiled(kernel: Any, ptrs: np.ndarray, elements: np.ndarray, plane_ptrs: np.ndarray,
                  itemsize: int, e0: np.ndarray | None = None) -> torch.Tensor:
    """Run a compiled split or merge over tensors at ``ptrs`` (rows of at most CPU_PIECE_BYTES,
    threads split by bytes); each tensor's wsum64, its elements numbered from ``e0`` (default 0)."""
    owner, first, count = pieces(elements, CPU_PIECE_BYTES // itemsize)
    sums = np.zeros(elements.size, dtype=np.uint64)
    e0 = np.zeros(elements.size, dtype=np.int64) if e0 is None else e0
    ptrs, plane_ptrs = _numbered_from(e0, itemsize, ptrs, plane_ptrs)
    kernel(_table([ptrs[owner], first + e0[owner], count, owner, plane_ptrs[owner]], owner.size), itemsize, sums,
           compiled_threads(int(elements.sum()) * itemsize))
    return torch.from_numpy(sums.view(np.int64))


def _numbered_from(e0: np.ndarray, itemsize: int, ptrs: np.ndarray, plane_ptrs: np.ndarray
                   ) -> tuple[np.ndarray, np.ndarray]:
    """Element and plane addresses moved back by ``e0`` elements, so that the kernels, which find
    element ``e`` at ``address + e``, number a tensor's elements (and weigh its words) from
    ``e0``: a part of a larger tensor then sums as its part of the whole (never read there)."""
    return ptrs - e0 * itemsize, plane_ptrs - e0[:, None]


def split_planes(datas: Sequence[torch.Tensor], itemsize: int, planes: torch.Tensor, starts: np.ndarray,
                 strides: np.ndarray, hist: torch.Tensor, hist_rows: np.ndarray) -> torch.Tensor:
    """Split 1-D uint8 tensors (whole ``itemsize``-byte elements, one device) into the planes
    buffer: plane j of tensor t at ``planes[starts[t] + j·strides[t]:]``. Adds sampled byte counts
    of tensor t's planes to ``hist[hist_rows[t]]`` (8×256 int32) and returns each tensor's wsum64
    (int64)."""
    device = planes.device
    elements = np.array([d.numel() // itemsize for d in datas], dtype=np.int64)
    if not use_triton(device) and COMPILED is None:
        return _split_numpy(datas, itemsize, planes, starts, strides, hist, hist_rows)
    src = np.array([d.data_ptr() for d in datas], dtype=np.int64)
    plane_ptrs = planes.data_ptr() + starts[:, None] + strides[:, None] * np.arange(itemsize)[None, :]
    if not use_triton(device):
        COMPILED.sample_counts(np.stack([src, elements, hist_rows.astype(np.int64)], axis=1), itemsize, hist.numpy(),
                               _SAMPLE_ELEMENTS)
        return _run_compiled(COMPILED.split, src, elements, plane_ptrs, itemsize)
    owner, first = _programs(elements)
    rows = [src[owner], elements[owner], first, hist_rows.astype(np.int64)[owner], plane_ptrs[owner]]
    return _launch("split_kernel", device, rows, owner, len(datas), hist, K=itemsize, SAMPLE_EVERY=SAMPLE_EVERY)


def merge_planes(outs: Sequence[torch.Tensor], itemsize: int, bases: Sequence[torch.Tensor],
                 plane_base: np.ndarray, plane_offset: np.ndarray, first_words: np.ndarray | None = None
                 ) -> torch.Tensor:
    """Inverse of :func:`split_planes` into the 1-D uint8 tensors ``outs``: plane j of tensor t is
    at ``bases[plane_base[t, j]][plane_offset[t, j]:]``. Returns each tensor's wsum64 (int64), its
    words numbered from ``first_words[t]`` (default 0; where an output is a part of a larger
    tensor that starts there, the parts' sums add up to the tensor's)."""
    device = outs[0].device
    elements = np.array([o.numel() // itemsize for o in outs], dtype=np.int64)
    if not use_triton(device) and COMPILED is None:
        return _merge_numpy(outs, itemsize, bases, plane_base, plane_offset, first_words)
    words = np.zeros(len(outs), dtype=np.int64) if first_words is None else first_words.astype(np.int64)
    e0 = words * 8 // itemsize  # the first element of each output's first word
    dst = np.array([o.data_ptr() for o in outs], dtype=np.int64)
    base_ptrs = np.array([b.data_ptr() for b in bases], dtype=np.int64)
    plane_ptrs = base_ptrs[plane_base] + plane_offset
    if not use_triton(device):
        sizes = np.array([b.numel() for b in bases], dtype=np.int64)
        if ((plane_offset < 0) | (plane_offset + elements[:, None] > sizes[plane_base])).any():
            raise CorruptCheckpointError("a byte plane reaches past the bytes that hold it")
        return _run_compiled(COMPILED.merge, dst, elements, plane_ptrs, itemsize, e0)
    owner, first = _programs(elements)
    dst, plane_ptrs = _numbered_from(e0, itemsize, dst, plane_ptrs)
    rows = [dst[owner], (elements + e0)[owner], first + e0[owner], np.zeros_like(owner), plane_ptrs[owner]]
    return _launch("merge_kernel", device, rows, owner, len(outs), K=itemsize)


def _each_element_row(tensors: Sequence[torch.Tensor], itemsize: int,
                      visit: Callable[[int, np.ndarray], None], first_words: np.ndarray | None = None
                      ) -> torch.Tensor:
    """Call ``visit(t, elements)`` with each tensor's bytes as rows of ``itemsize`` bytes (a view,
    which ``visit`` may fill); return each tensor's wsum64, taken after the visit (its words
    numbered from ``first_words[t]``)."""
    sums = np.empty(len(tensors), dtype=np.uint64)
    for t, tensor in enumerate(tensors):
        raw = tensor.numpy()
        visit(t, raw.reshape(-1, itemsize))
        sums[t] = wsum64_array(raw, 0 if first_words is None else int(first_words[t]))
    return torch.from_numpy(sums.view(np.int64))


def _split_numpy(datas: Sequence[torch.Tensor], itemsize: int, planes: torch.Tensor, starts: np.ndarray,
                 strides: np.ndarray, hist: torch.Tensor, hist_rows: np.ndarray) -> torch.Tensor:
    buffer = planes.numpy()
    counts = hist.numpy().reshape(-1, 8, 256)

    def split(t: int, elements: np.ndarray) -> None:
        n = elements.shape[0]
        rows = buffer[int(starts[t]) : int(starts[t]) + itemsize * int(strides[t])].reshape(itemsize, -1)
        for a in range(0, n, _CPU_BLOCK):
            b = min(n, a + _CPU_BLOCK)
            for j in range(itemsize):
                rows[j, a:b] = elements[a:b, j]
        sample = elements[:: max(1, n // _SAMPLE_ELEMENTS)]
        for j in range(itemsize):
            counts[hist_rows[t], j] += np.bincount(sample[:, j], minlength=256).astype(np.int32)

    return _each_element_row(datas, itemsize, split)


def _merge_numpy(outs: Sequence[torch.Tensor], itemsize: int, bases: Sequence[torch.Tensor],
                 plane_base: np.ndarray, plane_offset: np.ndarray, first_words: np.ndarray | None = None
                 ) -> torch.Tensor:
    arrays = [b.numpy() for b in bases]

    def merge(t: int, elements: np.ndarray) -> None:
        n = elements.shape[0]
        planes = [arrays[plane_base[t, j]][int(plane_offset[t, j]) :] for j in range(itemsize)]
        for a in range(0, n, _CPU_BLOCK):
            b = min(n, a + _CPU_BLOCK)
            for j in range(itemsize):
                elements[a:b, j] = planes[j][a:b]

    return _each_element_row(outs, itemsize, merge, first_words)
