"""Host memory faulted in ahead of the writes that fill it, in huge pages where the kernel has them.

A load's outputs are new memory: the first write to each 4 KiB page traps into the kernel, which
zeroes it, and those traps, not the decoding, bound the merge of fresh outputs on one core, and
many cores' traps contend in the kernel. Linux 5.14 and later fault a whole range in with one
``madvise(MADV_POPULATE_WRITE)``, on the thread that is about to write it, faster than page by
page (results: "CPU path and the GDeflate decoder"); where transparent huge pages are enabled on
request (``madvise`` mode), outputs advised ``MADV_HUGEPAGE`` first are faulted in 2 MiB at a time,
one trap where there were 512. Elsewhere (older kernels, other systems) this does nothing.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import sys
from collections.abc import Callable, Iterable

import torch

MADV_HUGEPAGE = 14  # Linux's values (include/uapi/asm-generic/mman-common.h)
MADV_POPULATE_WRITE = 23  # mmap names it from Python 3.14
MIN_BYTES = 1 << 20  # smaller outputs: the call costs more than the traps it saves
# glibc serves larger allocations from mappings of their own, new each time (smaller ones mostly
# from memory freed before, whose pages are there)
OWN_MAPPING_BYTES = 32 << 20
_PAGE = mmap.PAGESIZE
THP_MODE = "/sys/kernel/mm/transparent_hugepage/enabled"
MAPS = "/proc/self/maps"
MAX_MAP_COUNT = "/proc/sys/vm/max_map_count"


@functools.cache
def libc_madvise() -> Callable[[int, int, int], int] | None:
    """libc's madvise (the interpreter lock released while it runs), on Linux, whose advice values
    this package uses; None elsewhere."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        function = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    function.restype = ctypes.c_int
    return function


def _large(tensors: Iterable[torch.Tensor]) -> list[tuple[int, int]]:
    """The address and size of each host tensor of at least :data:`MIN_BYTES`."""
    out = []
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        if t.device.type == "cpu" and nbytes >= MIN_BYTES:
            out.append((t.data_ptr(), nbytes))
    return out


def populate(tensors: Iterable[torch.Tensor]) -> None:
    """Fault in the whole pages of each host tensor of at least :data:`MIN_BYTES` (their contents
    stay as they are). A kernel that refuses (before 5.14: EINVAL) leaves the pages to be faulted
    in by the writes, as without this call."""
    madvise = libc_madvise()
    if madvise is None:
        return
    for address, nbytes in _large(tensors):
        start = -(-address // _PAGE) * _PAGE
        end = (address + nbytes) // _PAGE * _PAGE
        if end > start:
            madvise(start, end - start, MADV_POPULATE_WRITE)


@functools.cache
def _huge_pages_on_request() -> bool:
    """Whether transparent huge pages back memory only where it is advised (``madvise`` mode; in
    ``always`` mode they back it unadvised, and advice would only add the kernel's compaction)."""
    try:
        with open(THP_MODE, encoding="ascii") as f:
            return "[madvise]" in f.read()
    except (OSError, UnicodeDecodeError):
        return False


def _room_for_mappings(extra: int) -> bool:
    """Whether this process's memory mappings stay under half the kernel's limit with ``extra``
    more: an advised range may split a mapping in three, and a process out of mappings fails its
    next allocations, so advice stops well before it."""
    try:
        with open(MAPS, "rb") as f:
            count = f.read().count(b"\n")
        with open(MAX_MAP_COUNT, "rb") as f:
            limit = int(f.read())
    except (OSError, ValueError):
        return False
    return count + extra <= limit // 2


def prefer_huge_pages(tensors: Iterable[torch.Tensor]) -> None:
    """Advise that new host tensors of at least :data:`MIN_BYTES` be backed by huge pages when
    first touched (:func:`populate` then faults them in 2 MiB at a time), where the kernel gives
    them on request. The advice covers each tensor's whole pages, so adjacent advised outputs
    stay one mapping; it changes no contents. Meant for outputs just allocated: a caller's own
    tensors are left as they are."""
    madvise = libc_madvise()
    ranges = _large(tensors)
    if madvise is None or not ranges or not _huge_pages_on_request() or not _room_for_mappings(2 * len(ranges)):
        return
    for address, nbytes in ranges:
        start = address // _PAGE * _PAGE
        madvise(start, -(-(address + nbytes) // _PAGE) * _PAGE - start, MADV_HUGEPAGE)


def fresh(nbytes: int) -> torch.Tensor:
    """``nbytes`` of new host memory (uint8): where it is a mapping of its own, in huge pages
    where the kernel gives them on request. Its pages are faulted in by the writes that fill it
    (2 MiB at a time there), so a decoder that stops early touches no more than it wrote."""
    out = torch.empty(nbytes, dtype=torch.uint8)
    if nbytes >= OWN_MAPPING_BYTES:
        prefer_huge_pages([out])
    return out
