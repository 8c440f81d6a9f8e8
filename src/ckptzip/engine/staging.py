"""Pinned host memory for device↔host copies: a bounded pool of buffers, reused across saves and
loads, and a copy stream per device.

Host memory is bounded by the pool (``CKPTZIP_PINNED_MB`` in all, default 1024 MiB in 64 MiB
buffers, created on first use), never by the size of the state: when every buffer waits for the
disk, the GPU side waits too (back-pressure).
"""

from __future__ import annotations

import os
import queue
import threading

import torch

BUFFER_BYTES = 64 << 20


def _pool_buffers() -> int:
    total = int(os.environ.get("CKPTZIP_PINNED_MB", "1024")) << 20
    return max(2, total // BUFFER_BYTES)


class _Slab:
    """Pageable memory made pinned by registering it with CUDA: for gigabytes several times faster
    than allocating pinned memory (pages are touched by torch's thread pool, then registered at
    about 40 GB/s). Unregistered when dropped, so nothing may use its memory after that."""

    def __init__(self, nbytes: int) -> None:
        self.memory = torch.empty(nbytes, dtype=torch.uint8)
        self.memory.fill_(0)  # fault every page in, on several threads
        self._cudart = torch.cuda.cudart()
        error = self._cudart.cudaHostRegister(self.memory.data_ptr(), nbytes, 0)
        if int(error) != 0:
            raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed with CUDA error {int(error)}")

    def __del__(self) -> None:
        self._cudart.cudaHostUnregister(self.memory.data_ptr())


class PinnedPool:
    """Pinned host buffers, created on first use (at most ``count``) and reused."""

    def __init__(self, buffer_bytes: int = BUFFER_BYTES, count: int | None = None) -> None:
        self.buffer_bytes = buffer_bytes
        self.count = count or _pool_buffers()  # sys.maxsize: a pool that grows as needed
        self._free: queue.Queue[torch.Tensor] = queue.Queue()
        self._created = 0
        self._slabs: list[_Slab] = []
        self._lock = threading.Lock()

    def acquire(self) -> torch.Tensor:
        """A free buffer; blocks while all are in use."""
        try:
            return self._free.get_nowait()
        except queue.Empty:
            pass
        with self._lock:
            if self._created < self.count:
                self._created += 1
                return torch.empty(self.buffer_bytes, dtype=torch.uint8, pin_memory=True)
        return self._free.get()

    def reserve(self, nbytes: int) -> None:
        """Make sure about ``nbytes`` of buffers are free, creating the missing ones in one slab."""
        with self._lock:
            missing = min(-(-nbytes // self.buffer_bytes) - self._free.qsize(), self.count - self._created)
            if missing <= 0:
                return
            slab = _Slab(missing * self.buffer_bytes)
            self._slabs.append(slab)
            self._created += missing
            for i in range(missing):
                self._free.put(slab.memory[i * self.buffer_bytes : (i + 1) * self.buffer_bytes])

    def release(self, buffer: torch.Tensor) -> None:
        """Take back a buffer of this pool (other tensors are ignored)."""
        if buffer.is_pinned() and buffer.numel() == self.buffer_bytes:
            self._free.put(buffer)

    def clear(self) -> None:
        """Give the pinned memory back; only when no buffer is in use (else nothing is dropped)."""
        with self._lock:
            if self._free.qsize() != self._created:
                return
            while not self._free.empty():
                self._free.get_nowait()
            self._created = 0
            self._slabs.clear()


_POOL: PinnedPool | None = None
_STREAMS: dict[torch.device, torch.cuda.Stream] = {}
_LOCK = threading.Lock()


def pinned_pool() -> PinnedPool:
    """The process-wide pool (pinned memory is slow to allocate, so it is kept)."""
    global _POOL
    with _LOCK:
        if _POOL is None:
            _POOL = PinnedPool()
        return _POOL


def copy_stream(device: torch.device) -> torch.cuda.Stream:
    """The process-wide stream for host↔device copies of ``device`` (copies overlap compute)."""
    with _LOCK:
        stream = _STREAMS.get(device)
        if stream is None:
            stream = _STREAMS[device] = torch.cuda.Stream(device)
        return stream
