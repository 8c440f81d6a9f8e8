"""Host memory faulted in ahead of the writes that fill it.

A load's outputs are new memory: the first write to each 4 KiB page traps into the kernel, which
zeroes it, and those traps, not the decoding, bound the merge of fresh outputs on one core. Linux
5.14 and later fault a whole range in with one ``madvise(MADV_POPULATE_WRITE)``, on the thread
that is about to write it, faster than page by page (results: "CPU path and the GDeflate
decoder"). Elsewhere (older kernels, other systems) this does nothing.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import sys
from collections.abc import Callable, Iterable

import torch

MADV_POPULATE_WRITE = 23  # Linux's value (include/uapi/asm-generic/mman-common.h); mmap names it from Python 3.14
MIN_BYTES = 1 << 20  # smaller outputs: the call costs more than the traps it saves
_PAGE = mmap.PAGESIZE


@functools.cache
def _madvise() -> Callable[[int, int, int], int] | None:
    """libc's madvise, where the platform has MADV_POPULATE_WRITE's meaning (Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        function = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    function.restype = ctypes.c_int
    return function


def populate(tensors: Iterable[torch.Tensor]) -> None:
    """Fault in the whole pages of each host tensor of at least :data:`MIN_BYTES` (their contents
    stay as they are). A kernel that refuses (before 5.14: EINVAL) leaves the pages to be faulted
    in by the writes, as without this call."""
    madvise = _madvise()
    if madvise is None:
        return
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        if t.device.type != "cpu" or nbytes < MIN_BYTES:
            continue
        start = -(-t.data_ptr() // _PAGE) * _PAGE
        end = (t.data_ptr() + nbytes) // _PAGE * _PAGE
        if end > start:
            madvise(start, end - start, MADV_POPULATE_WRITE)
