"""Coded batches on their way to the file: each batch's stored bytes moved off its GPU into pinned
host buffers, in large copies on a copy stream, while the next batch encodes (:class:`Stager`),
as pieces (:class:`Job`) that a writer (:class:`~.writer.Sink`) or a staging
(:class:`~.staged.StagedState`) takes in order.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from ..memory.pinned import PinnedPool, copy_stream
from .ahead import InOrder
from .encode import EncodedBatch
from .sources import Layout


@dataclass(frozen=True)
class Coded:
    """A coded batch: its tensors' table positions and names, the layouts their entries record
    (:attr:`~.sources.Table.recorded`), and the batch."""

    positions: list[int]
    names: list[str]
    layouts: list[Layout]
    batch: EncodedBatch


@dataclass
class Record:
    """What the index needs of a batch once its bytes are written: the batch (its device columns
    emptied once staged) and ``meta``, its chunk digests then its tensor checksums (int64, host)."""

    coded: Coded
    meta: torch.Tensor


@dataclass
class Job:
    """One piece of a batch on its way to the file, valid once ``ready`` has completed; the
    batch's first piece marks where it starts, its last carries the record. ``release``: the
    pool buffer this piece is the last to use (batches are packed into the buffers back to back,
    :class:`Packing`), given back once the piece is written."""

    piece: tuple[torch.Tensor, int]
    first: bool
    record: Record | None = None
    ready: torch.cuda.Event | None = None
    release: torch.Tensor | None = None


@dataclass
class Packing:
    """The buffer of ``pool`` a save's staged batches are filling: the next batch's stored bytes
    go on where the last one's ended, so the pool holds the stored bytes and not a partly used
    buffer a batch (a host snapshot's 256 MiB batches in 16 MiB buffers: 4 % more host memory)."""

    pool: PinnedPool
    buffer: torch.Tensor | None = None
    fill: int = 0

    def take(self, limit: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Up to ``limit`` bytes of the buffer being filled (a new one from the pool when none
        is), and the buffer where they fill it."""
        pool = self.pool
        if self.buffer is None:
            self.buffer, self.fill = pool.acquire(), 0  # waits while the writer holds every buffer
        buffer = self.buffer
        n = min(limit, pool.buffer_bytes - self.fill)
        piece = buffer[self.fill : self.fill + n]
        self.fill += n
        if self.fill < pool.buffer_bytes:
            return piece, None
        self.buffer = None
        return piece, buffer


def stage(coded: Coded, encoded: torch.cuda.Event | None, packing: Packing | None) -> Iterator[Job]:
    """Move a batch's stored bytes and checksums to the host, into the pool's buffers where
    ``packing`` left off (device batches: large async copies on the copy stream, after
    ``encoded``; host batches: nothing to move)."""
    batch = coded.batch
    stored = batch.stored
    if not stored.is_cuda:
        meta = torch.cat([batch.digests, batch.checksums])
        yield Job((stored, stored.numel()), True, Record(coded, meta))
        return
    assert packing is not None and encoded is not None
    # Everything below runs on the copy stream, after the encoding: this thread's own current
    # stream is not the one the batch was encoded on, so nothing here may read the batch outside it.
    stream = copy_stream(stored.device)
    stream.wait_event(encoded)
    for t in (stored, batch.digests, batch.checksums):
        t.record_stream(stream)
    with torch.cuda.stream(stream):
        meta = torch.cat([batch.digests, batch.checksums])
    # the record keeps the host columns only: device memory is freed once the copies have run
    nothing = torch.empty(0, dtype=torch.uint8)
    coded = dataclasses.replace(coded, batch=dataclasses.replace(batch, stored=nothing, digests=nothing,
                                                                 checksums=nothing))
    start, first = 0, True
    while first or start < stored.numel():
        piece, release = packing.take(stored.numel() - start)
        n = piece.numel()
        record = None
        with torch.cuda.stream(stream):
            piece.copy_(stored[start : start + n], non_blocking=True)
            if start + n == stored.numel():
                host_meta = torch.empty(meta.shape, dtype=meta.dtype, pin_memory=True)
                host_meta.copy_(meta, non_blocking=True)
                record = Record(coded, host_meta)
            ready = torch.cuda.Event()
            ready.record(stream)
        yield Job((piece, n), first, record, ready, release)
        start, first = start + n, False


class _End:
    """The stager's last item: the buffer its batches were filling is handed on with a last job."""


_Queued = tuple[Coded, "torch.cuda.Event | None"]


class Stager(InOrder[_Queued | _End]):
    """Moves encoded batches to host memory (:func:`stage`) on a thread of its own, handing each
    piece to ``deliver`` in order, so the encoding thread goes on to the next batch at once. At
    most one batch waits in line (device memory stays bounded). Batches fill the pool's buffers
    back to back (:class:`Packing`); :meth:`close` hands on the last one."""

    def __init__(self, pool: PinnedPool | None, deliver: Callable[[Job], None]) -> None:
        self._deliver = deliver
        self._packing = None if pool is None else Packing(pool)
        super().__init__("ckptzip-stage", 1)

    def _handle(self, item: _Queued | _End) -> None:
        packing = self._packing
        if isinstance(item, _End):
            last = None if packing is None else packing.buffer
            if packing is not None and last is not None:
                self._deliver(Job((last[:0], 0), False, release=last))
                packing.buffer = None  # handed on (else _finish gives it back)
            return
        coded, encoded = item
        for job in stage(coded, encoded, packing):
            self._deliver(job)

    def _finish(self, item: _Queued | _End) -> None:
        packing = self._packing
        if isinstance(item, _End) and packing is not None and packing.buffer is not None:
            packing.pool.release(packing.buffer)  # not handed on (an error came first): back to the pool
            packing.buffer = None

    def close(self) -> None:
        self._queue.put(_End())  # after every batch, an error or not
        super().close()

    def stage(self, coded: Coded) -> None:
        """Queue a batch whose encoding was queued on the current stream."""
        stored = coded.batch.stored
        encoded = None
        if stored.is_cuda:
            encoded = torch.cuda.Event()
            encoded.record(torch.cuda.current_stream(stored.device))
        self.put((coded, encoded))
