"""Moving coded chunks from the GPU to the file: a pool of pinned host buffers, a stager that fills
them with asynchronous device→host copies, and a writer thread that writes them in file order.

Host memory is bounded by the pool (``CKPTZIP_PINNED_MB`` in all, default 512 MiB in 64 MiB
buffers), never by the size of the state: when every buffer waits for the disk, the GPU side
waits too (back-pressure).
"""

from __future__ import annotations

import os
import queue
import threading
from dataclasses import dataclass, field
from typing import BinaryIO, Union

import torch

from .encode import EncodedStream, EncodedTensor
from .format import ContainerWriter

BUFFER_BYTES = 64 << 20
WRITEBACK_BYTES = 64 << 20


def _file_descriptor(f: BinaryIO | None) -> int | None:
    """The OS file descriptor behind ``f`` when early writeback can use it, else None."""
    if f is None or not hasattr(os, "posix_fadvise"):
        return None
    try:
        return f.fileno()
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is an OSError
        return None


def _pool_buffers() -> int:
    total = int(os.environ.get("CKPTZIP_PINNED_MB", "512")) << 20
    return max(2, total // BUFFER_BYTES)


class PinnedPool:
    """A fixed number of pinned host buffers, created on first use and reused across saves."""

    def __init__(self, buffer_bytes: int = BUFFER_BYTES, count: int | None = None) -> None:
        self.buffer_bytes = buffer_bytes
        self.count = count or _pool_buffers()
        self._free: queue.Queue[torch.Tensor] = queue.Queue()
        self._created = 0
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

    def release(self, buffer: torch.Tensor) -> None:
        self._free.put(buffer)


_POOL: PinnedPool | None = None
_POOL_LOCK = threading.Lock()


def pinned_pool() -> PinnedPool:
    """The process-wide pool (pinned memory is slow to allocate, so it is kept)."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = PinnedPool()
        return _POOL


@dataclass
class _Chunk:
    data: torch.Tensor  # host bytes
    raw_length: int
    stream: EncodedStream


@dataclass
class _Job:
    """Items to write in order; host data valid once ``ready`` has completed."""

    items: list[Union[_Chunk, EncodedTensor]] = field(default_factory=list)
    ready: torch.cuda.Event | None = None
    buffer: torch.Tensor | None = None


_STOP = object()


class BackgroundWriter:
    """Writes jobs to a :class:`ContainerWriter` on its own thread, in submission order."""

    def __init__(self, writer: ContainerWriter, pool: PinnedPool | None, f: BinaryIO | None = None) -> None:
        self._writer = writer
        self._pool = pool
        self._fd = _file_descriptor(f)
        self._flushed_to = 0
        self._queue: queue.Queue = queue.Queue(maxsize=64)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="ckptzip-writer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (job := self._queue.get()) is not _STOP:
            try:
                if self._error is None:
                    self._write(job)
            except BaseException as exc:  # surfaced to the submitting thread
                self._error = exc
            finally:
                if job.buffer is not None and self._pool is not None:
                    self._pool.release(job.buffer)

    def _write(self, job: _Job) -> None:
        if job.ready is not None:
            job.ready.synchronize()
        for item in job.items:
            if isinstance(item, _Chunk):
                item.stream.entry.chunks.append(self._writer.write_chunk(item.data, item.raw_length))
            else:
                self._writer.add_tensor(item.table_entry())
        self._start_writeback()

    def _start_writeback(self) -> None:
        """Ask the kernel to start writing what was written so far, so the disk works while the
        GPU encodes the next batch instead of all at the final fsync (Linux; a no-op elsewhere)."""
        end = self._writer.offset
        if self._fd is None or end - self._flushed_to < WRITEBACK_BYTES:
            return
        self._writer.flush()
        os.posix_fadvise(self._fd, self._flushed_to, end - self._flushed_to, os.POSIX_FADV_DONTNEED)
        self._flushed_to = end

    def submit(self, job: _Job) -> None:
        self.check()
        self._queue.put(job)

    def check(self) -> None:
        """Raise the writer thread's error, if it had one."""
        if self._error is not None:
            raise self._error

    def close(self) -> None:
        """Wait for every job; raise the first error."""
        self._queue.put(_STOP)
        self._thread.join()
        self.check()


class Stager:
    """Collects chunks in file order; copies device chunks into pinned buffers and submits a job to
    the writer whenever a buffer fills (and at :meth:`flush`)."""

    def __init__(self, writer: BackgroundWriter, pool: PinnedPool | None) -> None:
        self._writer = writer
        self._pool = pool
        self._job = _Job()
        self._used = 0

    def add_tensor(self, encoded: EncodedTensor) -> None:
        """Queue every chunk of a tensor, then its index entry."""
        for stream in encoded.streams:
            for piece, raw_length in zip(stream.pieces, stream.raw_lengths):
                host = self._to_host(piece)  # may submit the current job and start a new one
                self._job.items.append(_Chunk(host, raw_length, stream))
            stream.pieces = []  # drop device references as soon as their copies are queued
        self._job.items.append(encoded)

    def _to_host(self, piece: torch.Tensor) -> torch.Tensor:
        if not piece.is_cuda:
            return piece
        if self._pool is None or piece.numel() > self._pool.buffer_bytes:
            return piece.cpu()
        if self._job.buffer is not None and self._used + piece.numel() > self._pool.buffer_bytes:
            self.flush()
        if self._job.buffer is None:
            self._job.buffer = self._pool.acquire()
            self._used = 0
        host = self._job.buffer[self._used : self._used + piece.numel()]
        host.copy_(piece, non_blocking=True)
        self._used += piece.numel()
        return host

    def flush(self) -> None:
        """Submit what was collected (recording an event after its copies)."""
        if not self._job.items and self._job.buffer is None:
            return
        if self._job.buffer is not None:
            self._job.ready = torch.cuda.Event()
            self._job.ready.record()
        self._writer.submit(self._job)
        self._job = _Job()
        self._used = 0
