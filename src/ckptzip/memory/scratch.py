"""Per-thread host buffers reused from one CPU batch to the next.

A CPU load reads each batch's stored bytes and decodes its coded streams into buffers of a few
MiB. Allocated afresh per batch on several threads, they were served from glibc's heaps once its
mmap threshold had risen, and the freed ones stayed there: a load of one 256 MiB tensor peaked at
1.3-1.6x its decoded size on 2 cores. A batch runs start to end on one thread and nothing holds
these buffers after it (its outputs are allocated before the batches run), so each thread keeps
one of each and grows it when a batch needs more.
"""

from __future__ import annotations

import threading

import torch

_LOCAL = threading.local()


def scratch(name: str, nbytes: int) -> torch.Tensor:
    """``nbytes`` of this thread's buffer ``name`` (uint8, on the host), valid until the thread
    next asks for it."""
    buffers: dict[str, torch.Tensor] = _LOCAL.__dict__.setdefault("buffers", {})
    buffer = buffers.get(name)
    if buffer is None or buffer.numel() < nbytes:
        buffers.pop(name, None)  # the old one goes before the larger one comes
        buffer = buffers[name] = torch.empty(nbytes, dtype=torch.uint8)
    return buffer[:nbytes]
