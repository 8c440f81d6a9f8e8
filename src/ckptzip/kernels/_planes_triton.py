"""Triton kernels of :mod:`.planes` (imported on the first launch on a GPU, or under
``TRITON_INTERPRET=1``): split and merge of byte planes with each program's partial wsum64."""

import triton
import triton.language as tl


@triton.jit
def _element_ptr(addr, K: tl.constexpr):
    if K == 2:
        return addr.to(tl.pointer_type(tl.int16))
    elif K == 4:
        return addr.to(tl.pointer_type(tl.int32))
    else:
        return addr.to(tl.pointer_type(tl.int64))


@triton.jit
def _element_sum(x, elems, K: tl.constexpr):
    """Σ of each element's bits (int64, zero-extended), placed in its word, times (2·word + 1)."""
    EPW: tl.constexpr = 8 // K
    placed = x << ((elems % EPW) * (8 * K)).to(tl.int64)
    return tl.sum(placed * ((elems // EPW) * 2 + 1).to(tl.int64), axis=0)


@triton.jit
def split_kernel(table, partial, hist, K: tl.constexpr, E: tl.constexpr, ITERS: tl.constexpr,
                  SAMPLE_EVERY: tl.constexpr):
    # table row per program: source address, elements, first element, histogram row, K plane
    # addresses; a program splits ITERS blocks of E elements
    W: tl.constexpr = 4 + 8
    pid = tl.program_id(0)
    src = _element_ptr(tl.load(table + pid * W), K)
    n = tl.load(table + pid * W + 1)
    first = tl.load(table + pid * W + 2)
    hist_row = hist + tl.load(table + pid * W + 3) * (8 * 256)
    total = tl.zeros((), dtype=tl.int64)
    for it in range(ITERS):
        e0 = first + it * E
        elems = e0 + tl.arange(0, E)
        mask = elems < n
        x = tl.load(src + elems, mask=mask, other=0).to(tl.int64)
        if K < 8:
            x = x & ((1 << (8 * K)) - 1)
        total += _element_sum(x, elems, K)
        sampled = ((e0 // E) % SAMPLE_EVERY == 0) & (e0 + E <= n)
        for j in tl.static_range(K):
            plane = tl.load(table + pid * W + 4 + j).to(tl.pointer_type(tl.uint8))
            b = ((x >> (8 * j)) & 0xFF).to(tl.uint8)
            tl.store(plane + elems, b, mask=mask)
            if sampled:
                counts = tl.histogram(b.to(tl.int32), 256)
                tl.atomic_add(hist_row + j * 256 + tl.arange(0, 256), counts)
    tl.store(partial + pid, total)


@triton.jit
def merge_kernel(table, partial, K: tl.constexpr, E: tl.constexpr, ITERS: tl.constexpr):
    # table row per program: output address, elements, first element, unused, K plane addresses
    W: tl.constexpr = 4 + 8
    pid = tl.program_id(0)
    dst = _element_ptr(tl.load(table + pid * W), K)
    n = tl.load(table + pid * W + 1)
    first = tl.load(table + pid * W + 2)
    total = tl.zeros((), dtype=tl.int64)
    for it in range(ITERS):
        elems = first + it * E + tl.arange(0, E)
        mask = elems < n
        x = tl.zeros((E,), dtype=tl.int64)
        for j in tl.static_range(K):
            plane = tl.load(table + pid * W + 4 + j).to(tl.pointer_type(tl.uint8))
            b = tl.load(plane + elems, mask=mask, other=0).to(tl.int64)
            x = x | (b << (8 * j))
        total += _element_sum(x, elems, K)
        tl.store(dst + elems, x.to(dst.dtype.element_ty), mask=mask)
    tl.store(partial + pid, total)
