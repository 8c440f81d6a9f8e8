"""Batched data-parallel kernels of the engine: byte-plane split/merge with checksums
(:mod:`.planes`) and checksummed gathers of many byte segments (:mod:`.segments`).

Each runs as Triton kernels on a CUDA device (one launch for a whole batch, programs find their
data through small address tables) and as NumPy on the CPU, which releases the GIL so the CPU
backend runs batches on several threads. ``TRITON_INTERPRET=1`` runs the Triton versions on CPU
tensors (tests).
"""

from __future__ import annotations

import collections
import os
import threading

import numpy as np
import torch

__all__ = ["INTERPRET", "THREAD_SAFE", "distinct", "to_device", "triton", "use_triton"]

try:
    import triton
except ImportError:  # pragma: no cover - depends on the environment
    triton = None

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# Triton's interpreter keeps global state: under it, batches run on one thread.
THREAD_SAFE = not INTERPRET


def _hash_triton_ahead() -> None:
    """Start Triton's once-per-process hash of its own compiler (its cache key: some hundred MB of
    files, about 0.35 s) on a background thread, so the first save does not wait for it. Only
    where kernels will run on a GPU; pure host work (no CUDA call), and it releases the GIL."""
    if triton is None or INTERPRET or not torch.cuda.is_available():
        return
    try:
        from triton.runtime.cache import triton_key
    except ImportError:  # another Triton layout: the first launch hashes, as it would anyway
        return
    threading.Thread(target=triton_key, name="ckptzip-triton-key", daemon=True).start()


_hash_triton_ahead()


def use_triton(device: torch.device) -> bool:
    """Whether the Triton versions run for data on ``device``."""
    return triton is not None and (device.type == "cuda" or INTERPRET)


class _UploadRing:
    """Pinned host memory for the small tables kernels read (addresses, indices), reused as a ring.

    Pinning a fresh buffer per upload costs about a millisecond (the caching host allocator can
    reuse a block only once the copy that read it has run, and the GPU runs behind the host), so
    tables are staged in one pinned buffer instead: each upload records an event, and a region is
    written again only after the copies that read it have completed.
    """

    ALIGN = 256

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self._buffer: torch.Tensor | None = None
        self._head = 0
        self._pending: collections.deque[tuple[int, int, torch.cuda.Event]] = collections.deque()
        self._lock = threading.Lock()

    def upload(self, host: torch.Tensor, device: torch.device) -> torch.Tensor:
        n = host.numel() * host.element_size()
        with self._lock:
            if self._buffer is None:
                self._buffer = torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=True)
            start = -(-self._head // self.ALIGN) * self.ALIGN
            if start + n > self.nbytes:
                start = 0
            end = start + n
            while self._pending and (self._pending[0][2].query() or _overlaps(self._pending[0], start, end)):
                self._pending.popleft()[2].synchronize()
            for region in self._pending:  # a later region still in use (rare): wait for it
                if _overlaps(region, start, end):
                    region[2].synchronize()
            staged = self._buffer[start:end].view(host.dtype).view(host.shape)
            staged.copy_(host)
            out = staged.to(device, non_blocking=True)
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(device))
            self._pending.append((start, end, done))
            self._head = end
            return out


def _overlaps(region: tuple[int, int, object], start: int, end: int) -> bool:
    return region[0] < end and start < region[1]


_RING = _UploadRing(64 << 20)


def to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array on ``device`` without waiting for the device: staged through pinned memory
    (a copy from pageable memory would wait for all work queued before it)."""
    host = torch.from_numpy(np.ascontiguousarray(array))
    if device.type != "cuda":
        return host
    if host.numel() * host.element_size() > _RING.nbytes // 4:
        return host.pin_memory().to(device, non_blocking=True)
    return _RING.upload(host, device)


def distinct(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct values of a 1-D integer array, ascending, and where each first occurs: what
    ``np.unique(values, return_index=True)`` gives, without the import of ``numpy.ma`` (20 ms)
    that NumPy's first ``unique`` call of a process costs."""
    order = np.argsort(values, kind="stable")
    ordered = values[order]
    head = np.ones(ordered.size, dtype=bool)
    head[1:] = ordered[1:] != ordered[:-1]
    return ordered[head], order[head]
