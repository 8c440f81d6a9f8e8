"""Per-thread host buffers reused from one CPU batch to the next.

A CPU load reads each batch's stored bytes and decodes its coded streams into buffers of a few
MiB. Allocated afresh per batch on several threads, they were served from glibc's heaps once its
mmap threshold had risen, and the freed ones stayed there: a load of one 256 MiB tensor peaked at
1.3-1.6x its decoded size on 2 cores. A batch runs start to end on one thread and nothing holds
these buffers after it (its outputs are allocated before the batches run), so each thread keeps
one of each and grows it when a batch needs more. A CPU save splits each batch into a planes
buffer the same way: a large tensor's, new each batch, had its pages faulted in each time.
Buffers are :func:`~.pages.fresh` memory (huge pages where the kernel gives them on request).
"""

from __future__ import annotations

import threading

import torch

from .pages import fresh

_LOCAL = threading.local()


def scratch(name: str, nbytes: int) -> torch.Tensor:
    """``nbytes`` of this thread's buffer ``name`` (uint8, on the host), valid until the thread
    next asks for it."""
    buffers: dict[str, torch.Tensor] = _LOCAL.__dict__.setdefault("buffers", {})
    buffer = buffers.get(name)
    if buffer is None or buffer.numel() < nbytes:
        buffers.pop(name, None)  # the old one goes before the larger one comes
        buffer = buffers[name] = fresh(nbytes)
    return buffer[:nbytes]
