"""A save's large GPU buffers in blocks of one size (:func:`uniform`), which torch's cache never splits.

On a GPU a training job has filled, what a save can have is mostly torch's cache. Buffers of
varying sizes (a batch's planes, its codec outputs, its stored chunks) split the cache's blocks,
and the free bytes end in pieces that no later buffer fits, while torch cannot return a segment
that still holds one live block: on a filled GPU, batches ran out of memory while torch's cache
held room enough unused, in pieces (results: "A filled GPU, a training job's conditions").
Inside :func:`uniform`, each buffer of up to that size that the engine and the GPU codecs allocate
on this thread through :func:`empty` or :func:`zeros` is a view of a block of exactly that size,
which torch hands back whole to the next one: the cache the save works in holds blocks of one
size, never split.
"""

from __future__ import annotations

import contextlib

import torch

from .._local import ThreadSetting

__all__ = ["empty", "uniform", "zeros"]

_SMALLEST = 1 << 20  # smaller buffers come from torch's pool of small blocks, which large ones never split
_SIZE: ThreadSetting[int] = ThreadSetting()


def uniform(nbytes: int | None) -> contextlib.AbstractContextManager[None]:
    """Within: on this thread, GPU buffers of :data:`_SMALLEST` to ``nbytes`` bytes are blocks
    of ``nbytes`` (None: of their own size)."""
    return _SIZE.within(nbytes)


def empty(nbytes: int, device: torch.device) -> torch.Tensor:
    """``nbytes`` of uninitialised uint8 on ``device``: a view of a block of the uniform size
    where one holds them."""
    size = _SIZE.get()
    if size is None or device.type != "cuda" or not _SMALLEST <= nbytes <= size:
        return torch.empty(nbytes, dtype=torch.uint8, device=device)
    return torch.empty(size, dtype=torch.uint8, device=device)[:nbytes]


def zeros(nbytes: int, device: torch.device) -> torch.Tensor:
    """:func:`empty`, zeroed."""
    return empty(nbytes, device).zero_()
