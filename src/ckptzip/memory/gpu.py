"""A call's GPU budget: how much GPU memory one call may use, and how much work beside training may
hold. The engine divides a budget into batches (:class:`ckptzip.engine.GpuLimits` for a save, the
engine's reader for a load).

A training job fills its GPU, so every GPU path sizes its batches from what can really be had,
capped by the caller (``gpu_memory=``) or ``CKPTZIP_GPU_MEMORY_MB``, and by torch's per-process
memory fraction where one is set. What can be had depends on when the work runs:

- Work that runs in the caller and is done when the call returns (``ckptzip.save`` and ``load``,
  a blocking snapshot, DCP's staging) may *borrow* what torch's caching allocator holds unused
  (:func:`available`): between two training steps that is the training's own working set (the
  activations it frees after backward and takes again in the next forward), which the call
  gives back to the cache before it returns. Below :data:`MIN_GPU_MEMORY` such a call raises
  :class:`~ckptzip.errors.GpuMemoryError` before it allocates anything.
- Work that holds memory while training runs (a device snapshot, its coding in the background, a
  read that overlaps the next forward and backward) may take only what the training leaves
  unused *at its peak* (:func:`beside_training`): torch's peak of reserved memory (since the
  process started, or since the caller last reset it) is what the training needs, whatever is
  free between two steps. Such work is given its share when the save is taken (:func:`capped`);
  where that share is too small the engine codes on the host instead, never in the training's
  memory.

The engine allocates on the caller's current stream, where a training job's freed blocks are
cached, and gives its blocks back to that cache when it is done with them: a save or load uses
the training job's cached memory and leaves it where it was, and nvCOMP's scratch and outputs go
through torch's allocator too (:mod:`ckptzip.codecs.nvcomp`), so nothing asks the driver for
memory that torch holds.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from .. import settings
from .._local import ThreadSetting
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


def _fraction(device: torch.device) -> float:
    """The share of ``device`` torch's allocator may reserve (1.0 unless the process set one)."""
    query = getattr(torch.cuda, "get_per_process_memory_fraction", None)  # torch >= 2.6
    return 1.0 if query is None else float(query(device))


def _free(device: torch.device) -> int:
    """Bytes torch's allocator could still reserve on ``device``: the device's free memory, within
    the per-process memory fraction where one is set (torch refuses to reserve beyond it)."""
    free, total = torch.cuda.mem_get_info(device)
    fraction = _fraction(device)
    if fraction < 1:
        free = min(free, max(0, int(fraction * total) - torch.cuda.memory_reserved(device)))
    return int(free)


def available(device: torch.device) -> int:
    """GPU memory a call that is done when it returns can borrow on ``device``: free, plus what
    torch's cache holds unused (the training's working set between two steps)."""
    device = _indexed(device)
    return _free(device) + cached(device)


# What work beside training leaves unused on top of the training's peak: the allocator's
# fragmentation grows when memory is tight, and libraries allocate outside torch (NCCL's buffers
# at a first collective); the larger of these two.
TRAINING_MARGIN_BYTES = 1 << 30
TRAINING_MARGIN_SHARE = 0.02


def beside_training(device: torch.device) -> int:
    """GPU memory work may hold on ``device`` while training runs: what the training leaves unused
    at its peak (free memory, plus what torch reserves now, less torch's peak of reserved memory),
    less a margin (:data:`TRAINING_MARGIN_BYTES`, :data:`TRAINING_MARGIN_SHARE` of the GPU)."""
    device = _indexed(device)
    reserved = torch.cuda.memory_reserved(device)
    peak = max(reserved, torch.cuda.max_memory_reserved(device))
    total = torch.cuda.get_device_properties(device).total_memory
    margin = max(TRAINING_MARGIN_BYTES, int(TRAINING_MARGIN_SHARE * total))
    return max(0, _free(device) + reserved - peak - margin)


_CAPS: ThreadSetting[dict[torch.device, int]] = ThreadSetting()


def capped(caps: dict[torch.device, int] | None) -> contextlib.AbstractContextManager[None]:
    """Within the block, this thread's GPU work holds at most ``caps[device]`` on each device
    (work beside training: its share of :func:`beside_training`, taken when the save was). Such
    a budget never raises: below the minimum, the engine codes on the host."""
    return _CAPS.within(None if caps is None else {_indexed(d): n for d, n in caps.items()})


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
    beside = (_CAPS.get() or {}).get(device)
    if beside is not None:
        return Budget(device, min(nbytes, beside))
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
