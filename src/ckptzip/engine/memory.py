"""GPU memory of the engine: how much one call may use, and a private pool that gives it back.

A training job fills its GPU, so every GPU path sizes its batches from what can really be had:
the device's free memory plus the cached blocks torch's allocator would release for an
allocation that does not fit (whole free segments), capped by the caller (``gpu_memory=``) or
``CKPTZIP_GPU_MEMORY_MB``. Below :data:`MIN_GPU_MEMORY` a call raises
:class:`~ckptzip.errors.GpuMemoryError` before it allocates anything.

Everything a call allocates on a GPU (its batches, and nvCOMP's scratch and outputs, which go
through torch's allocator too, see :mod:`ckptzip.codecs.nvcomp`) comes from a private pool of torch's caching
allocator, released when the call returns: reserved memory is back where it was, and no block
is left cached for a stream nothing uses again. Tensors a call returns are allocated outside it.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from ..errors import CkptzipError, GpuMemoryError

MIN_GPU_MEMORY = 256 << 20
ENV = "CKPTZIP_GPU_MEMORY_MB"
_MIB = 1 << 20
_MIN_BATCH = 8 << 20


def cap(gpu_memory: int | None) -> int | None:
    """The caller's cap in bytes: ``gpu_memory``, else ``CKPTZIP_GPU_MEMORY_MB``, else none."""
    if gpu_memory is None:
        text = os.environ.get(ENV, "").strip()
        if not text:
            return None
        if not text.isdigit() or int(text) == 0:
            raise CkptzipError(f"{ENV}={text!r}: expected a whole number of MiB above 0")
        return int(text) * _MIB
    if type(gpu_memory) is not int or gpu_memory <= 0:
        raise CkptzipError(f"gpu_memory must be a number of bytes above 0 (an int) or None, got {gpu_memory!r}")
    return gpu_memory


def releasable(device: torch.device) -> int:
    """Bytes torch's allocator caches on ``device`` in whole free segments (it releases them when
    an allocation would otherwise fail)."""
    stats = torch.cuda.memory_stats(device)
    cached = stats.get("reserved_bytes.all.current", 0) - stats.get("allocated_bytes.all.current", 0)
    return max(0, int(cached - stats.get("inactive_split_bytes.all.current", 0)))


def available(device: torch.device) -> int:
    """GPU memory a call can have on ``device``: free, plus what torch's cache would release."""
    free, _ = torch.cuda.mem_get_info(device)
    return free + releasable(device)


@dataclass(frozen=True)
class Budget:
    """The GPU memory one call may use on one device."""

    device: torch.device
    nbytes: int

    def batch_bytes(self, working_sets: int, largest: int) -> int:
        """A batch size such that ``working_sets`` batches fit (at most ``largest``, whole MiB)."""
        return max(_MIN_BATCH, min(largest, self.nbytes // working_sets) // _MIB * _MIB)


def budget(device: torch.device, gpu_memory: int | None, what: str) -> Budget:
    """What a call (``what``: "save", "load", ...) may use on ``device``; ``GpuMemoryError``
    naming the numbers when it is below :data:`MIN_GPU_MEMORY`."""
    limit = cap(gpu_memory)
    have = available(device)
    nbytes = have if limit is None else min(limit, have)
    if nbytes < MIN_GPU_MEMORY:
        capped = f", capped at {limit / _MIB:.0f} MiB (gpu_memory or {ENV})" if limit is not None and limit < have else ""
        raise GpuMemoryError(
            f"{what} on {device} needs at least {MIN_GPU_MEMORY // _MIB} MiB of GPU memory beside the state; "
            f"{have / _MIB:.0f} MiB can be had there (free, plus what torch's cache can release){capped}. "
            "Nothing was written or changed. Free GPU memory (smaller activations, torch.cuda.empty_cache()), "
            "or move the state to the CPU first"
        )
    return Budget(device, nbytes)


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is a GPU allocation failure (torch's, or nvCOMP's RuntimeError)."""
    return isinstance(exc, torch.OutOfMemoryError) or (
        isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower())


class Pools:
    """Private allocator pools, one per device, that one thread at a time allocates from while
    in :meth:`routed` (torch routes a pool to one thread); :meth:`release` gives them back."""

    def __init__(self, devices: Iterable[torch.device]) -> None:
        mem_pool = getattr(torch.cuda, "MemPool", None)
        self._pools = {d: mem_pool() for d in devices} if mem_pool is not None else {}

    @contextlib.contextmanager
    def routed(self) -> Iterator[None]:
        """Route this thread's allocations on the pools' devices to them."""
        with contextlib.ExitStack() as stack:
            for device, pool in self._pools.items():
                stack.enter_context(torch.cuda.use_mem_pool(pool, device))
            yield

    def release(self) -> None:
        """Give the pools' memory back: torch frees their segments once the blocks still
        awaiting other streams' work are done with (blocks still held stay until freed)."""
        self._pools.clear()


@contextlib.contextmanager
def private_pools(devices: Iterable[torch.device]) -> Iterator[Pools]:
    """Allocate this thread's GPU memory on ``devices`` from fresh private pools for the duration;
    release them afterwards."""
    cuda = sorted({d for d in devices if d.type == "cuda"}, key=str)
    pools = Pools(cuda)
    try:
        with pools.routed():
            yield pools
    finally:
        pools.release()
