"""A load's GPU batches, their stored bytes read from the file into pinned buffers and copied to
their devices on a thread of its own, a batch or two ahead of the decoders
(:func:`~.reader.read_tensors`)."""

from __future__ import annotations

import collections
import os
import threading
from collections.abc import Iterator
from concurrent import futures
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from ..format import ContainerReader, TensorEntry
from ..memory.pinned import copy_stream, pinned_pool
from .chunks import Listed
from .decode import Runs

_AHEAD = 2  # device regions the uploader fills before a decoder takes them
# Reads in flight: one thread copies into a pinned buffer at a fraction of the host-to-device
# link's speed, so a dozen keep the link fed from memory too (results: "Save and load on a GPU").
READ_THREADS = max(1, min(12, os.cpu_count() or 1))


class Uploader:
    """Reads GPU batches' stored bytes into pinned buffers and copies them to their devices, in
    batch order, on a thread of its own; ``get(b)`` returns batch ``b``'s device region (from any
    thread), at most ``_AHEAD`` regions being filled before they are taken."""

    def __init__(self, reader: ContainerReader, batches: list[tuple[torch.device, list[TensorEntry]]]) -> None:
        self._reader = reader
        # regions are allocated on the caller's streams, where the decoder frees them: into the
        # blocks the caller's stream caches, and back there
        self._callers = {device: torch.cuda.current_stream(device) for device, _ in batches}
        self._pool = pinned_pool()
        self._handed: dict[int, Any] = {}  # batch -> (region, runs, ready), not yet taken
        self._taken = 0  # batches taken so far
        self._end: BaseException | None = None  # the upload's error, once it failed
        self._done = threading.Condition()
        self._stop = False
        self._reads = ThreadPoolExecutor(max_workers=READ_THREADS, thread_name_prefix="ckptzip-read")
        self._thread = threading.Thread(target=self._run, args=(batches,), name="ckptzip-upload", daemon=True)
        self._thread.start()

    def _read(self, buffer: torch.Tensor, offset: int, n: int, entries: list[TensorEntry]) -> torch.Tensor:
        data = buffer.numpy()[:n]
        self._reader.read_into(data, offset, f"tensor {entries[0].name!r}")
        return buffer

    def _run(self, batches: list[tuple[torch.device, list[TensorEntry]]]) -> None:
        pending: collections.deque[tuple[torch.cuda.Event, torch.Tensor]] = collections.deque()
        try:
            self._upload(batches, pending)
        except BaseException as exc:
            with self._done:
                self._end = exc
                self._done.notify_all()
        finally:
            for done, buffer in pending:
                done.synchronize()
                self._pool.release(buffer)

    def _upload(self, batches: list[tuple[torch.device, list[TensorEntry]]],
                pending: collections.deque[tuple[torch.cuda.Event, torch.Tensor]]) -> None:
        """Fill every batch's device region, handing each over once complete."""
        plans = [(device, entries, Runs.of(entries)) for device, entries in batches]
        # format-1 digests are checked on the host as the bytes arrive: those files' chunks by batch
        chunks = None if self._reader.digest_is_wsum64 else [Listed.of(entries) for _, entries, _ in plans]
        spans = self._spans(plans, chunks)
        left = [len(batch) for batch in spans]
        regions: dict[int, tuple[torch.Tensor, torch.cuda.Event]] = {}
        handed = 0  # batches put on the queue, in order (a batch without bytes as soon as it is next)
        for b, offset, n, buffer in self._pieces(plans, spans, chunks, pending):
            if self._stop:
                self._pool.release(buffer)
                return
            device, _, runs = plans[b]
            stream = copy_stream(device)
            try:
                with torch.cuda.device(device):
                    region = regions[b][0] if b in regions else self._region(device, runs.total, stream)
            except BaseException:
                self._pool.release(buffer)  # nothing was queued from it
                raise
            with torch.cuda.device(device), torch.cuda.stream(stream):
                at = int(runs.locate(np.array([offset]))[0])
                region[at : at + n].copy_(buffer[:n], non_blocking=True)
                done = torch.cuda.Event()
                done.record(stream)
                pending.append((done, buffer))
            regions[b] = (region, done)  # the last copy's event covers the batch's earlier ones
            left[b] -= 1
            handed = self._hand_over(plans, left, regions, handed)
        self._hand_over(plans, left, regions, handed)

    def _region(self, device: torch.device, nbytes: int, stream: torch.cuda.Stream) -> torch.Tensor:
        """A batch's device region: allocated on the caller's stream, written on ``stream``. Its
        block may have been freed by the caller while kernels queued there still read it (the
        allocator orders reuse on the caller's stream only), so ``stream`` first waits for them."""
        caller = self._callers[device]
        with torch.cuda.stream(caller):
            region = torch.empty(nbytes, dtype=torch.uint8, device=device)
        stream.wait_stream(caller)
        region.record_stream(stream)
        return region

    def _hand_over(self, plans: list[tuple[torch.device, list[TensorEntry], Runs]], left: list[int],
                   regions: dict[int, tuple[torch.Tensor, torch.cuda.Event]], handed: int) -> int:
        """Queue every complete batch from ``handed`` on, in order; return the next one to hand."""
        while handed < len(plans) and not left[handed]:
            device, _, runs = plans[handed]
            if handed in regions:
                region, ready = regions.pop(handed)
            else:
                region, ready = torch.empty(0, dtype=torch.uint8, device=device), torch.cuda.Event()
                ready.record(copy_stream(device))
            with self._done:  # back-pressure: at most _AHEAD regions wait for their decoder
                while not self._stop and handed - self._taken >= _AHEAD:
                    self._done.wait()
                self._handed[handed] = (region, runs, ready)
                self._done.notify_all()
            handed += 1
        return handed

    def _spans(self, plans: list[tuple[torch.device, list[TensorEntry], Runs]],
               chunks: list[Listed] | None) -> list[list[tuple[int, int]]]:
        """Per batch, the file ranges read into one pinned buffer each (whole chunks where
        ``chunks`` are given, so each is checked in one piece)."""
        size = self._pool.buffer_bytes
        if chunks is not None:
            return [batch.spans(size) for batch in chunks]
        return [[(o, min(size, start + length - o))
                 for start, length in zip(runs.file.tolist(), runs.length.tolist())
                 for o in range(start, start + length, size)] for _, _, runs in plans]

    def _pieces(self, plans: list[tuple[torch.device, list[TensorEntry], Runs]], spans: list[list[tuple[int, int]]],
                chunks: list[Listed] | None,
                pending: collections.deque[tuple[torch.cuda.Event, torch.Tensor]]
                ) -> Iterator[tuple[int, int, int, torch.Tensor]]:
        """(batch, file offset, size, pinned buffer holding those bytes) for every span of every
        batch, in order, with reads in flight across batch boundaries, so the copying threads
        never wait for a batch to be handed over."""
        size = self._pool.buffer_bytes
        flat = [(b, offset, n) for b, batch in enumerate(spans) for offset, n in batch]
        reads: collections.deque[tuple[int, int, int, torch.Tensor, Any]] = collections.deque()
        in_flight = max(1, min(READ_THREADS, self._pool.count - 4))  # a few buffers wait for their copy
        try:
            for b, offset, n in flat:
                while len(reads) >= in_flight:
                    yield self._finish(reads.popleft(), chunks)
                while pending and (pending[0][0].query() or len(pending) >= self._pool.count - in_flight):
                    done, buffer = pending.popleft()
                    done.synchronize()
                    self._pool.release(buffer)
                buffer = self._pool.acquire() if n <= size else torch.empty(n, dtype=torch.uint8)
                reads.append((b, offset, n, buffer, self._reads.submit(self._read, buffer, offset, n, plans[b][1])))
            while reads:
                yield self._finish(reads.popleft(), chunks)
        finally:  # an upload that stopped or failed: the reads in flight give their buffers back
            for *_, buffer, future in reads:
                futures.wait([future])
                self._pool.release(buffer)

    def _finish(self, read: tuple[int, int, int, torch.Tensor, Any], chunks: list[Listed] | None
                ) -> tuple[int, int, int, torch.Tensor]:
        """The filled buffer of a read; format-1 chunks in it are checked against their XXH3."""
        b, offset, n, buffer, future = read
        try:
            future.result()
            if chunks is not None:
                chunks[b].verify_xxh3(buffer.numpy()[:n], offset)
        except BaseException:
            self._pool.release(buffer)
            raise
        return b, offset, n, buffer

    def get(self, batch: int) -> tuple[torch.Tensor, Runs, torch.cuda.Event]:
        """Batch ``batch``'s device region, its runs and the event its copies complete."""
        with self._done:
            while batch not in self._handed and self._end is None:
                self._done.wait()
            if batch not in self._handed:
                assert self._end is not None
                raise self._end
            self._taken += 1
            self._done.notify_all()
            item: tuple[torch.Tensor, Runs, torch.cuda.Event] = self._handed.pop(batch)
            return item

    def close(self) -> None:
        with self._done:
            self._stop = True
            self._handed.clear()
            self._done.notify_all()
        self._thread.join()
        self._reads.shutdown(wait=True)
