"""Pinned host memory for device↔host copies: a bounded pool of buffers, reused across saves and
loads, a copy stream per device, and GPU tensors brought to new host tensors through them.

Host memory is bounded by the pool (``CKPTZIP_PINNED_MB`` in all, default 1024 MiB in 64 MiB
buffers, created on first use), never by the size of the state: when every buffer waits for the
disk, the GPU side waits too (back-pressure). Pools that grow with the state (snapshot staging)
reserve their buffers in slabs (at most :data:`SLAB_BYTES` unless the pool says otherwise), so they
can shrink again by whole slabs (:meth:`PinnedPool.trim`) once a smaller state, or a better ratio,
needs less.

A slab is registered with CUDA a piece at a time (:data:`REGISTER_BYTES`): page-locking holds
driver-wide locks for as long as one registration pins, and every CUDA call of the process's
other threads (the training's launches) that needs them waits, so a piece holds them a few
milliseconds at a time. A reservation made while training runs
(``paced``) also rests after each piece (:data:`PACE`). A copy between a GPU and a slab
stays inside one piece (the pools' buffers divide it; :func:`piece_ends` cuts longer copies): a
range across two registrations is not one the driver registered as a whole.
"""

from __future__ import annotations

import logging
import mmap
import os
import queue
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from .. import settings
from ..errors import CheckpointWriteError
from .shared import shared_empty

BUFFER_BYTES = 64 << 20
SLAB_BYTES = 1 << 30
# the most one cudaHostRegister call pins (a slab rounds it up to a whole number of its buffers)
REGISTER_BYTES = 64 << 20
# a paced registration rests this long per second its last piece took: the driver's locks are free
# for the training's calls at least half the time
PACE = 1.0
# GPU tensors at least this large come to the host through the pool (smaller ones: Tensor.to)
STAGED_TO_HOST_BYTES = 1 << 20
_COPY_OUT_THREADS = max(1, min(8, os.cpu_count() or 1))
_LOG = logging.getLogger("ckptzip")


def _pool_buffers() -> int:
    return max(2, settings.pinned_bytes() // BUFFER_BYTES)


def _mapped(nbytes: int, shared: bool = False) -> torch.Tensor:
    """``nbytes`` of host memory, its pages not faulted in here: on Linux an anonymous mapping advised
    to take transparent huge pages, whose first touches run two to three times faster and which
    leave fewer pages to pin (results: "Host snapshots and the manager").
    ``shared``: torch's shared memory instead, which ``torch.multiprocessing`` hands to another
    process without a copy, where it has room (else private memory, which a handover copies)."""
    if shared:
        try:
            return shared_empty(nbytes)
        except CheckpointWriteError as exc:
            _LOG.debug("ckptzip: private host memory instead of shared: %s", exc)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        region.madvise(mmap.MADV_HUGEPAGE)
        return torch.frombuffer(region, dtype=torch.uint8)  # keeps the mapping alive
    return torch.empty(nbytes, dtype=torch.uint8)


def _fresh_memory(nbytes: int, shared: bool = False) -> torch.Tensor:
    """:func:`_mapped` memory with every page in, zeroed: faulted in on torch's thread pool, several
    threads at once (registering it would fault it in on one)."""
    return _mapped(nbytes, shared).fill_(0)


class Slab:
    """Pageable memory made pinned by registering it with CUDA: for gigabytes several times faster
    than allocating pinned memory (pages are touched by torch's thread pool, then registered). It
    is registered in pieces of :data:`REGISTER_BYTES` rounded up to a multiple of ``unit`` (so
    buffers of ``unit`` bytes each lie in one piece); ``paced``: resting between pieces, for a
    reservation that overlaps training. Unregistered when dropped, so nothing may use its memory
    after that."""

    def __init__(self, nbytes: int, shared: bool = False, *, unit: int = 1, paced: bool = False) -> None:
        self._pieces: list[int] = []  # addresses registered so far (first: __del__ runs after a failed __init__)
        self.nbytes = nbytes
        self.memory = _fresh_memory(nbytes, shared)
        self.piece_bytes = -(-REGISTER_BYTES // unit) * unit
        self._cudart = _cudart()
        start = self.memory.data_ptr()
        try:
            for offset in range(0, nbytes, self.piece_bytes):
                began = time.perf_counter()
                n = min(self.piece_bytes, nbytes - offset)
                error = int(self._cudart.cudaHostRegister(start + offset, n, 0))
                if error != 0:
                    raise RuntimeError(f"cudaHostRegister of {n} bytes (of a slab of {nbytes}) failed with CUDA "
                                       f"error {error}")
                self._pieces.append(start + offset)
                if paced:
                    time.sleep(PACE * (time.perf_counter() - began))
        except BaseException:
            self._unregister()
            raise

    def holds(self, buffer: torch.Tensor) -> bool:
        start = self.memory.data_ptr()
        return start <= buffer.data_ptr() < start + self.nbytes

    def _unregister(self) -> None:
        while self._pieces:
            self._cudart.cudaHostUnregister(self._pieces.pop())

    def __del__(self) -> None:
        self._unregister()


def _cudart() -> Any:
    """CUDA's runtime API as torch binds it (one place, so tests can stand in for it)."""
    return torch.cuda.cudart()


def piece_ends(offset: int, nbytes: int, piece_bytes: int) -> Iterator[tuple[int, int]]:
    """``(start, end)`` ranges that cover ``nbytes`` from ``offset`` of a slab, each inside one of
    its pieces of ``piece_bytes`` (the first and last may be shorter): copies so cut stay
    inside one registration."""
    at, end = offset, offset + nbytes
    while at < end:
        cut = min(end, (at // piece_bytes + 1) * piece_bytes)
        yield at, cut
        at = cut


class PinnedPool:
    """Pinned host buffers, created on first use (at most ``count``) and reused. ``slab_bytes``:
    the most one registration pins; a pool holds up to a slab more than it was asked for.
    ``shared``: slabs in shared memory where it has room, so that staged bytes reach a checkpoint process without a
    copy (:meth:`~ckptzip.engine.staged.StagedState.portable`)."""

    def __init__(self, buffer_bytes: int = BUFFER_BYTES, count: int | None = None, slab_bytes: int = SLAB_BYTES,
                 shared: bool = False) -> None:
        self.buffer_bytes = buffer_bytes
        self.count = count or _pool_buffers()  # sys.maxsize: a pool that grows as needed
        self.slab_bytes = slab_bytes
        self.shared = shared
        self._free: queue.Queue[torch.Tensor] = queue.Queue()
        self._created = 0
        self._slabs: list[Slab] = []
        self._lock = threading.Lock()

    def acquire(self) -> torch.Tensor:
        """A free buffer; blocks while all are in use. A pool short of buffers grows by a slab as
        large as what it holds (1, 1, 2, 4... buffers, at most ``slab_bytes``): registering
        a slab costs a fraction of pinning its buffers one by one, a fresh process's first save
        and load included, and a state that needs few buffers pins few."""
        try:
            return self._free.get_nowait()
        except queue.Empty:
            pass
        with self._lock:
            if self._created < self.count:
                first, *rest = self._add_slab(min(self.count - self._created, max(1, self._created), self._per_slab))
                for buffer in rest:
                    self._free.put(buffer)
                return first
        return self._free.get()

    @property
    def _per_slab(self) -> int:
        return max(1, self.slab_bytes // self.buffer_bytes)

    def _add_slab(self, n: int, paced: bool = False) -> list[torch.Tensor]:
        """``n`` new buffers, in one slab (the caller holds the lock); pinned one by one where host
        memory cannot be registered (the driver refuses cudaHostRegister), so saves and loads still run."""
        try:
            slab = Slab(n * self.buffer_bytes, self.shared, unit=self.buffer_bytes, paced=paced)
        except RuntimeError as exc:
            _LOG.debug("ckptzip: pinning host buffers one by one: %s", exc)
            buffers = [torch.empty(self.buffer_bytes, dtype=torch.uint8, pin_memory=True) for _ in range(n)]
        else:
            self._slabs.append(slab)
            buffers = [slab.memory[i * self.buffer_bytes : (i + 1) * self.buffer_bytes] for i in range(n)]
        self._created += n
        return buffers

    @property
    def reserved(self) -> int:
        """Bytes of pinned buffers the pool holds (free or in use)."""
        return self._created * self.buffer_bytes

    def reserve(self, nbytes: int, paced: bool = False) -> None:
        """Make sure about ``nbytes`` of buffers are free, creating the missing ones in slabs
        (``paced``: registered as :class:`Slab` says, while training runs)."""
        with self._lock:
            missing = min(-(-nbytes // self.buffer_bytes) - self._free.qsize(), self.count - self._created)
            while missing > 0:
                n = min(missing, self._per_slab)
                for buffer in self._add_slab(n, paced):
                    self._free.put(buffer)
                missing -= n

    def trim(self, keep: int) -> None:
        """Give back whole slabs whose buffers are all free while the pool still holds ``keep``
        bytes without them (the newest slabs first)."""
        with self._lock:
            free = []
            while not self._free.empty():
                free.append(self._free.get_nowait())
            for slab in reversed(list(self._slabs)):
                if self.reserved - slab.nbytes < keep:
                    break
                inside = [b for b in free if slab.holds(b)]
                if len(inside) * self.buffer_bytes != slab.nbytes:
                    continue  # a buffer of it is in use
                free = [b for b in free if not slab.holds(b)]
                self._slabs.remove(slab)
                self._created -= len(inside)
            for buffer in free:
                self._free.put(buffer)

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


def to_host(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Contiguous 1-D uint8 GPU tensors as new host tensors. Those of :data:`STAGED_TO_HOST_BYTES`
    or more come down a pool buffer at a time on their device's copy stream, each piece copied out
    into its pageable output on a thread while the next ones come down: ``Tensor.to("cpu")`` into
    pageable memory is staged by the driver one small piece at a time, an order of magnitude slower."""
    outs = [torch.empty(t.numel(), dtype=torch.uint8) for t in tensors]
    staged = []
    for t, out in zip(tensors, outs):
        if t.numel() >= STAGED_TO_HOST_BYTES:
            staged.append((t, out))
        else:
            out.copy_(t)
    if not staged:
        return outs
    for device in {t.device for t, _ in staged}:
        copy_stream(device).wait_stream(torch.cuda.current_stream(device))
    pool = pinned_pool()
    with ThreadPoolExecutor(_COPY_OUT_THREADS, thread_name_prefix="ckptzip-to-host") as workers:
        jobs = []
        for t, out in staged:
            stream = copy_stream(t.device)
            for start in range(0, t.numel(), pool.buffer_bytes):
                n = min(pool.buffer_bytes, t.numel() - start)
                buffer = pool.acquire()  # blocks while every buffer waits to be copied out
                try:
                    with torch.cuda.stream(stream):
                        buffer[:n].copy_(t[start : start + n], non_blocking=True)
                        down = torch.cuda.Event()
                        down.record(stream)
                except BaseException:
                    stream.synchronize()  # nothing queued may still write into it
                    pool.release(buffer)
                    raise
                jobs.append(workers.submit(_copy_out, down, buffer, out[start : start + n], pool))
        for job in jobs:
            job.result()
    return outs


def _copy_out(down: torch.cuda.Event, buffer: torch.Tensor, out: torch.Tensor, pool: PinnedPool) -> None:
    try:
        down.synchronize()
        out.copy_(buffer[: out.numel()])
    finally:
        pool.release(buffer)
