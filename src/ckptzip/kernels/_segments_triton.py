"""Triton kernels of :mod:`.segments` (imported on the first launch on a GPU, or under
``TRITON_INTERPRET=1``): checksummed gathers of byte segments, and a byte gather."""

import triton
import triton.language as tl


@triton.jit
def segments_kernel(table, partial, BLOCK: tl.constexpr, ITERS: tl.constexpr, GATHER: tl.constexpr):
    # table row per program: source address, destination address, bytes (<= ITERS * BLOCK),
    # first word; a program handles ITERS blocks of BLOCK bytes
    pid = tl.program_id(0)
    src = tl.load(table + pid * 4).to(tl.pointer_type(tl.uint8))
    dst = tl.load(table + pid * 4 + 1).to(tl.pointer_type(tl.uint8))
    n = tl.load(table + pid * 4 + 2)
    word0 = tl.load(table + pid * 4 + 3)
    W: tl.constexpr = BLOCK // 8
    shifts = (tl.arange(0, 8) * 8).to(tl.int64)[None, :]
    total = tl.zeros((), dtype=tl.int64)
    for it in range(ITERS):
        offs = it * BLOCK + tl.arange(0, W)[:, None] * 8 + tl.arange(0, 8)[None, :]
        mask = offs < n
        x = tl.load(src + offs, mask=mask, other=0)
        if GATHER:
            tl.store(dst + offs, x, mask=mask)
        words = tl.sum(x.to(tl.int64) << shifts, axis=1)
        weights = (word0 + it * W + tl.arange(0, W)).to(tl.int64) * 2 + 1
        total += tl.sum(words * weights, axis=0)
    tl.store(partial + pid, total)


@triton.jit
def segments_words_kernel(table, partial, BLOCK: tl.constexpr, ITERS: tl.constexpr, GATHER: tl.constexpr):
    # as _segments_kernel, for 16-byte aligned addresses and lengths: whole words, vector loads
    pid = tl.program_id(0)
    src = tl.multiple_of(tl.load(table + pid * 4), 16).to(tl.pointer_type(tl.int64))
    dst = tl.multiple_of(tl.load(table + pid * 4 + 1), 16).to(tl.pointer_type(tl.int64))
    n = tl.load(table + pid * 4 + 2) // 8
    word0 = tl.load(table + pid * 4 + 3)
    W: tl.constexpr = BLOCK // 8
    total = tl.zeros((), dtype=tl.int64)
    for it in range(ITERS):
        i = it * W + tl.arange(0, W)
        mask = i < n
        x = tl.load(src + i, mask=mask, other=0)
        if GATHER:
            tl.store(dst + i, x, mask=mask)
        total += tl.sum(x * ((word0 + i).to(tl.int64) * 2 + 1), axis=0)
    tl.store(partial + pid, total)


@triton.jit
def gather_bytes_kernel(addresses, out, n, BLOCK: tl.constexpr):
    # out[i] = the byte at addresses[i]
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = i < n
    at = tl.load(addresses + i, mask=mask, other=0).to(tl.pointer_type(tl.uint8))
    tl.store(out + i, tl.load(at, mask=mask, other=0), mask=mask)
