"""Small host arrays (kernels' address tables, codecs' chunk tables, indices) onto a GPU without
waiting for it: staged through one pinned ring, since a copy from pageable memory waits for all
work queued before it, and pinning a fresh buffer per upload costs about a millisecond."""

from __future__ import annotations

import collections
import threading

import numpy as np
import torch

__all__ = ["to_device"]


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
