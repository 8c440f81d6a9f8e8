"""GPU memory of the engine: how much one call may use.

A training job fills its GPU, so every GPU path sizes its batches from what can really be had:
the device's free memory plus what torch's caching allocator holds unused (blocks it hands out
again, or releases for an allocation that does not fit), capped by the caller (``gpu_memory=``)
or ``CKPTZIP_GPU_MEMORY_MB``. Below :data:`MIN_GPU_MEMORY` a call raises
:class:`~ckptzip.errors.GpuMemoryError` before it allocates anything.

The engine allocates on the caller's current stream, where a training job's freed blocks are
cached, and gives its blocks back to that cache when it is done with them: a save or load uses
the training job's cached memory and leaves it where it was, and nvCOMP's scratch and outputs go
through torch's allocator too (:mod:`ckptzip.codecs.nvcomp`), so nothing asks the driver for
memory that torch holds.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import settings
from ..errors import GpuMemoryError

MIN_GPU_MEMORY = 256 << 20
ENV = settings.GPU_MEMORY_MB
_MIB = 1 << 20
_MIN_BATCH = 8 << 20


def cap(gpu_memory: int | None) -> int | None:
    """The caller's cap in bytes: ``gpu_memory``, else ``CKPTZIP_GPU_MEMORY_MB``, else none."""
    return settings.gpu_memory(gpu_memory)


def _indexed(device: torch.device) -> torch.device:
    """``device`` with its index (``cuda``: the current device)."""
    return torch.device("cuda", torch.cuda.current_device()) if str(device) == "cuda" else device


def cached(device: torch.device) -> int:
    """Bytes torch's allocator holds on ``device`` but has not handed out."""
    device = _indexed(device)
    return max(0, torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))


def available(device: torch.device) -> int:
    """GPU memory a call can have on ``device``: free, plus what torch's cache holds unused."""
    device = _indexed(device)
    free, _ = torch.cuda.mem_get_info(device)
    return int(free) + cached(device)


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
    device = _indexed(device)
    limit = cap(gpu_memory)
    have = available(device)
    nbytes = have if limit is None else min(limit, have)
    if nbytes < MIN_GPU_MEMORY:
        capped = f", capped at {limit / _MIB:.0f} MiB (gpu_memory or {ENV})" if limit is not None and limit < have else ""
        raise GpuMemoryError(
            f"{what} on {device} needs at least {MIN_GPU_MEMORY // _MIB} MiB of GPU memory beside the state; "
            f"{have / _MIB:.0f} MiB can be had there (free, plus what torch's cache holds unused){capped}. "
            "Nothing was written or changed. Free GPU memory (smaller activations, torch.cuda.empty_cache()), "
            "or move the state to the CPU first"
        )
    return Budget(device, nbytes)


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is a GPU allocation failure (torch's, or nvCOMP's RuntimeError)."""
    return isinstance(exc, torch.OutOfMemoryError) or (
        isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower())


def failure_line(exc: BaseException) -> str:
    """An allocation failure in one line: the first line of its message (its type, where it has none)."""
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__
