"""Whole-state save: tensors in batches through :func:`~.encode.encode_batch`, stored bytes to the
file in order, the index last.

GPU batches are encoded one after another on a side stream of their device; each batch's stored
bytes leave the GPU in a few large copies into pinned buffers, on a copy stream, while the next
batch encodes. CPU batches are encoded on a thread pool, several at once. A writer thread writes
every batch in file order and builds its index entries.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import logging
import os
import queue
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO, Generic, TypeVar

import numpy as np
import torch

from .. import blocks
from ..checksum import format_wsum64
from ..codecs import codec_threads
from ..errors import GpuMemoryError
from ..format import DTYPE_NAMES, Chunk, ContainerWriter, StreamEntry, TensorEntry, digest_hexes
from . import memory
from .ahead import Task, run_ahead
from .encode import EncodedBatch, Part, PendingBatch, encode_batch, start_batch, tensor_bytes
from .estimate import sampled_plane_entropies
from .parts import encode_part, plane_count, quarters, ranges, stream_codecs, worth_parts
from .plan import SAVE_BATCH_BYTES, BatchKey, GpuLimits, gpu_coded, halving, save_batches
from .policy import Policy
from .sources import DeltaBase, Layout, Table, rewrite_table
from .staging import PinnedPool, copy_stream, pinned_pool, shared_copy, shared_empty
from .threads import cpu_workers

WRITEBACK_BYTES = 64 << 20
T = TypeVar("T")
_LOG = logging.getLogger("ckptzip")


def _in_ranges(tensor: torch.Tensor, key: BatchKey, policy: Policy, range_bytes: int, block: int | None = None
               ) -> Iterator[tuple[list[int], EncodedBatch]]:
    """A lone tensor coded on its GPU in element ranges of about ``range_bytes`` (:mod:`.parts`),
    one range at a time, in file order; its buffers in blocks of ``block`` bytes where given
    (:func:`~ckptzip.blocks.uniform`). A range that runs out of memory is coded in quarters
    (:func:`~.parts.quarters`), in buffers of their own sizes, down to the smallest range."""
    with _on(key.device):
        streams = plane_count(tensor, policy)
        configs = stream_codecs(tensor_bytes(tensor), tensor, streams, policy, key.backend)
        todo = collections.deque(ranges(tensor, streams, range_bytes))
        last = todo[-1]
        while todo:
            part = todo.popleft()
            j, a, b = part
            try:
                with blocks.uniform(block):
                    coded = encode_part(tensor, streams, j, a, b, configs[j], policy, key.backend,
                                        (j, b) == (last[0], last[2]))
            except (torch.OutOfMemoryError, RuntimeError) as exc:
                if not memory.is_out_of_memory(exc) or not quarters(part):
                    raise
                failure = memory.failure_line(exc)
            else:
                yield [0], coded
                continue
            # out of the except block: the failed attempt's memory is freed with its frames
            _LOG.info("ckptzip: a range of %d MiB of a %d MiB tensor ran out of memory on %s (%s); coding it in "
                      "quarters", (b - a) >> 20, tensor.nbytes >> 20, key.device, failure)
            block = None
            todo.extendleft(reversed(quarters(part)))


def _on(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """``device`` current for GPU work (nothing to do for the CPU)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _ranges_of(tensor: torch.Tensor, key: BatchKey, policy: Policy, range_bytes: int, block: int | None
               ) -> _Encoded:
    """:func:`_in_ranges`: on a GPU lazily, each range coded as the caller's thread takes it (and
    off the GPU before the next); on the host (a pool thread's task) at once."""
    coded = _in_ranges(tensor, key, policy, range_bytes, block)
    return coded if key.backend == "cuda" else list(coded)


@dataclass
class _Ceiling:
    """The smallest GPU batch of one save that ran out of memory: later batches that large are
    coded smaller before they are tried, so a filled GPU costs a save one failed attempt, not one
    per batch."""

    nbytes: int = sys.maxsize


_Encoded = Iterable[tuple[list[int], EncodedBatch]]


def _encode(tensors: list[torch.Tensor], key: BatchKey, policy: Policy, share: int, ceiling: _Ceiling,
            sparse: list[int | None], block: int | None = None, entropies: np.ndarray | None = None) -> _Encoded:
    """Encode one batch: ``[(positions in the batch, encoded)]``, one part unless a GPU ran out of
    memory (:func:`_smaller`, whose buffers are of their own sizes). A CPU batch's codecs use
    ``share`` threads (:func:`batch_share`). ``sparse``: the tensors' non-zero counts where they
    are coded sparse (:func:`encode_batch`). ``block``: a GPU batch's buffers in blocks of that
    size (:func:`~ckptzip.blocks.uniform`). ``entropies``: the tensors' plane entropies, known
    ahead: the GPU batch's codecs are then only queued here, and the batch is finished when the
    result is iterated (:func:`_finished`), after the caller has started the next."""
    if key.backend != "cuda":
        with codec_threads(share):
            return [(list(range(len(tensors))), encode_batch(_moved(tensors, _CPU), policy, "cpu", sparse))]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    if nbytes < ceiling.nbytes:
        pending = _on_gpu(key, block, ceiling, tensors,
                          lambda: start_batch(_moved(tensors, key.device), policy, "cuda", sparse, entropies))
        if pending is not None:
            finished = _finished(pending, tensors, key, policy, share, ceiling, sparse, block, entropies)
            return finished if entropies is not None else list(finished)
    return _smaller(tensors, key, policy, share, ceiling, sparse, entropies)


def _on_gpu(key: BatchKey, block: int | None, ceiling: _Ceiling, tensors: list[torch.Tensor],
            attempt: Callable[[], T]) -> T | None:
    """``attempt()`` on the batch's GPU, its buffers in blocks of ``block``; None where it ran out
    of memory (later batches as large as ``tensors`` are then coded smaller: ``ceiling``)."""
    try:
        with _on(key.device), blocks.uniform(block):
            return attempt()
    except (torch.OutOfMemoryError, RuntimeError) as exc:
        if not memory.is_out_of_memory(exc):
            raise
        failure = memory.failure_line(exc)
    # out of the except block: the failed attempt's memory is freed with its frames
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    ceiling.nbytes = nbytes
    _LOG.info("ckptzip: a GPU batch of %d tensors (%d MiB) ran out of memory on %s (%s); coding batches "
              "that large smaller from now on", len(tensors), nbytes >> 20, key.device, failure)
    return None


def _finished(pending: PendingBatch, tensors: list[torch.Tensor], key: BatchKey, policy: Policy, share: int,
              ceiling: _Ceiling, sparse: list[int | None], block: int | None, entropies: np.ndarray | None
              ) -> Iterator[tuple[list[int], EncodedBatch]]:
    """A started GPU batch, finished (or, where that runs out of memory, coded smaller)."""
    batch = _on_gpu(key, block, ceiling, tensors, pending.finish)
    del pending  # a failed batch's buffers freed before it is coded smaller
    if batch is None:
        yield from _smaller(tensors, key, policy, share, ceiling, sparse, entropies)
    else:
        yield list(range(len(tensors))), batch


_CPU = torch.device("cpu")


def _moved(tensors: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """``tensors`` on ``device`` (those already there as they are: ``Tensor.to`` costs a call's
    overhead even then, which a state of many small tensors pays per tensor)."""
    return [t if t.device == device else t.to(device) for t in tensors]


def _smaller(tensors: list[torch.Tensor], key: BatchKey, policy: Policy, share: int, ceiling: _Ceiling,
             sparse: list[int | None], entropies: np.ndarray | None = None
             ) -> Iterator[tuple[list[int], EncodedBatch]]:
    """A GPU batch too large for the memory at hand, coded smaller, lazily (each piece leaves the
    GPU before the next is coded): in halves of the most even bytes; a lone tensor in element ranges a quarter of the
    size that failed (as byte planes, sparse or not), or on the host when it is too small for ranges."""
    if len(tensors) > 1:
        half = halving([t.numel() * t.element_size() for t in tensors])
        parts = (None, None) if entropies is None else (entropies[:half], entropies[half:])
        yield from _encode(tensors[:half], key, policy, share, ceiling, sparse[:half], None, parts[0])
        for positions, batch in _encode(tensors[half:], key, policy, share, ceiling, sparse[half:], None, parts[1]):
            yield [half + p for p in positions], batch
    elif tensors[0].is_cuda and worth_parts(tensors[0]):
        yield from _in_ranges(tensors[0], key, policy, ceiling.nbytes // 4)
    else:
        yield from _encode(tensors, BatchKey("cpu", torch.device("cpu")), policy, share, ceiling, sparse)


@dataclass
class _Record:
    """What the index needs of a batch once its bytes are written."""

    positions: list[int]  # table positions of the batch's tensors
    names: list[str]
    tensors: list[Layout]
    batch: EncodedBatch
    meta: torch.Tensor  # int64: chunk digests, then tensor checksums (host)


@dataclass
class _Job:
    """One piece of a batch on its way to the file, valid once ``ready`` has completed; the
    batch's first piece marks where it starts, its last carries the record. ``release``: the
    pool buffer this piece is the last to use (batches are packed into the buffers back to back,
    :class:`_Packing`), given back once the piece is written."""

    piece: tuple[torch.Tensor, int]
    first: bool
    record: _Record | None = None
    ready: torch.cuda.Event | None = None
    release: torch.Tensor | None = None


@dataclass
class _Packing:
    """The pool buffer a save's staged batches are filling: the next batch's stored bytes go on
    where the last one's ended, so the pool holds the stored bytes and not a partly used buffer
    a batch (a host snapshot's 256 MiB batches in 16 MiB buffers: 4 % more host memory)."""

    buffer: torch.Tensor | None = None
    fill: int = 0

    def take(self, limit: int, pool: PinnedPool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Up to ``limit`` bytes of the buffer being filled (a new one from ``pool`` when none is),
        and the buffer where they fill it."""
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


def _stage(positions: list[int], names: list[str], tensors: list[Layout], batch: EncodedBatch,
           pool: PinnedPool | None, encoded: torch.cuda.Event | None, packing: _Packing) -> Iterator[_Job]:
    """Move a batch's stored bytes and checksums to the host, into the pool's buffers where
    ``packing`` left off (device batches: large async copies on the copy stream, after
    ``encoded``; host batches: nothing to move)."""
    stored = batch.stored
    if not stored.is_cuda:
        meta = torch.cat([batch.digests, batch.checksums])
        yield _Job((stored, stored.numel()), True, _Record(positions, names, tensors, batch, meta))
        return
    assert pool is not None and encoded is not None
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
    batch = dataclasses.replace(batch, stored=nothing, digests=nothing, checksums=nothing)
    start, first = 0, True
    while first or start < stored.numel():
        piece, release = packing.take(stored.numel() - start, pool)
        n = piece.numel()
        record = None
        with torch.cuda.stream(stream):
            piece.copy_(stored[start : start + n], non_blocking=True)
            if start + n == stored.numel():
                host_meta = torch.empty(meta.shape, dtype=meta.dtype, pin_memory=True)
                host_meta.copy_(meta, non_blocking=True)
                record = _Record(positions, names, tensors, batch, host_meta)
            ready = torch.cuda.Event()
            ready.record(stream)
        yield _Job((piece, n), first, record, ready, release)
        start, first = start + n, False


class _InOrder(Generic[T]):
    """A thread that handles items in the order they are put. Its first error is raised in the
    putting thread (by ``put``, ``check`` or ``close``); items after it are only finished."""

    def __init__(self, name: str, maxsize: int) -> None:
        self._queue: queue.Queue[T | None] = queue.Queue(maxsize=maxsize)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            try:
                if self._error is None:
                    self._handle(item)
            except BaseException as exc:  # surfaced to the putting thread
                self._error = exc
            finally:
                self._finish(item)

    def _handle(self, item: T) -> None:
        raise NotImplementedError

    def _finish(self, item: T) -> None:
        """After each item, handled or not."""

    def put(self, item: T) -> None:
        self.check()
        self._queue.put(item)

    def check(self) -> None:
        """Raise the thread's error, if it had one."""
        if self._error is not None:
            raise self._error

    def close(self) -> None:
        """Wait for every item; raise the first error."""
        self._queue.put(None)
        self._thread.join()
        self.check()


class _Sink(_InOrder[_Job]):
    """Writes staged batches on its own thread, in order, and records their entries."""

    def __init__(self, writer: ContainerWriter, pool: PinnedPool | None, f: BinaryIO, count: int) -> None:
        self._writer = writer
        self.entries: list[TensorEntry | None] = [None] * count
        self._batch_start = 0
        self._parts: dict[int, list[StreamEntry]] = {}  # tensors coded in parts: their streams so far
        self._pool = pool
        self._fd = _file_descriptor(f)
        self._flushed_to = 0
        super().__init__("ckptzip-writer", max(8, pool.count if pool else 0))

    def _handle(self, job: _Job) -> None:
        self._write(job)

    def _finish(self, job: _Job) -> None:
        if self._pool is not None and job.release is not None:
            self._pool.release(job.release)

    def _write(self, job: _Job) -> None:
        if job.ready is not None:
            job.ready.synchronize()
        if job.first:
            self._batch_start = self._writer.offset
        buffer, n = job.piece
        self._writer.append(buffer.numpy().data[:n])
        if job.record is not None:
            self._record(job.record, self._batch_start)
        self._writeback()

    def _record(self, job: _Record, start: int) -> None:
        batch = job.batch
        meta = job.meta.numpy().view(np.uint64)
        digests, checksums = meta[: batch.lengths.size], meta[batch.lengths.size :]
        offsets = (start + batch.offsets).tolist()
        lengths, raws = batch.lengths.tolist(), batch.raw_lengths.tolist()
        hexes = digest_hexes(digests)
        c = 0
        for t, (position, name, tensor) in enumerate(zip(job.positions, job.names, job.tensors)):
            recipe = batch.recipes[t]
            streams = []
            for record in recipe.streams:
                chunks = [Chunk(offsets[i], lengths[i], raws[i], hexes[i]) for i in range(c, c + record.chunks)]
                c += record.chunks
                streams.append(StreamEntry(record.codec, record.nbytes, chunks))
            if batch.part is not None:  # one range of one stream: joined to the stream's earlier ranges
                streams = self._join(position, batch.part, streams[0])
                if not batch.part.last:
                    continue
            self.entries[position] = TensorEntry(
                name=name,
                dtype=DTYPE_NAMES[tensor.dtype],
                shape=tensor.shape,
                nbytes=tensor.nbytes,
                checksum=format_wsum64(int(checksums[t])),
                transforms=recipe.transforms,
                streams=streams,
                device=tensor.device,
            )

    def _join(self, position: int, part: Part, piece: StreamEntry) -> list[StreamEntry]:
        """A tensor's streams so far, with ``piece`` (the next range of stream ``part.stream``)."""
        streams = self._parts.setdefault(position, [])
        if len(streams) == part.stream:
            streams.append(StreamEntry(piece.codec, 0, []))
        stream = streams[part.stream]
        stream.chunks.extend(piece.chunks)
        stream.nbytes += piece.nbytes
        if part.last:
            del self._parts[position]
        return streams

    def _writeback(self) -> None:
        """Ask the kernel to start writing what was written so far, so the disk works during encoding."""
        end = self._writer.offset
        if self._fd is None or end - self._flushed_to < WRITEBACK_BYTES:
            return
        self._writer.flush()
        os.posix_fadvise(self._fd, self._flushed_to, end - self._flushed_to, os.POSIX_FADV_DONTNEED)
        self._flushed_to = end


def _file_descriptor(f: BinaryIO) -> int | None:
    """The OS file descriptor behind ``f`` when early writeback can use it, else None."""
    if not hasattr(os, "posix_fadvise"):
        return None
    try:
        return f.fileno()
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is an OSError
        return None


_Batch = tuple[list[int], list[str], list[Layout], EncodedBatch, "torch.cuda.Event | None"]


class _End:
    """The stager's last item: the buffer its batches were filling is handed on with a last job."""


class _Stager(_InOrder[_Batch | _End]):
    """Moves encoded batches to host memory (:func:`_stage`) on a thread of its own, handing each
    piece to ``deliver`` in order, so the encoding thread goes on to the next batch at once. At
    most one batch waits in line (device memory stays bounded). Batches fill the pool's buffers
    back to back (:class:`_Packing`); :meth:`close` hands on the last one."""

    def __init__(self, pool: PinnedPool | None, deliver: Callable[[_Job], None]) -> None:
        self._pool = pool
        self._deliver = deliver
        self._packing = _Packing()
        super().__init__("ckptzip-stage", 1)

    def _handle(self, item: _Batch | _End) -> None:
        if isinstance(item, _End):
            last = self._packing.buffer
            if last is not None:
                self._deliver(_Job((last[:0], 0), False, release=last))
                self._packing.buffer = None  # handed on (else _finish gives it back)
            return
        positions, names, metas, batch, encoded = item
        for job in _stage(positions, names, metas, batch, self._pool, encoded, self._packing):
            self._deliver(job)

    def _finish(self, item: _Batch | _End) -> None:
        if isinstance(item, _End) and self._packing.buffer is not None and self._pool is not None:
            self._pool.release(self._packing.buffer)  # not handed on (an error came first): back to the pool
            self._packing.buffer = None

    def close(self) -> None:
        self._queue.put(_End())  # after every batch, an error or not
        super().close()

    def stage(self, positions: list[int], names: list[str], metas: list[Layout], batch: EncodedBatch) -> None:
        """Queue a batch whose encoding was queued on the current stream."""
        encoded = None
        if batch.stored.is_cuda:
            encoded = torch.cuda.Event()
            encoded.record(torch.cuda.current_stream(batch.stored.device))
        self.put((positions, names, metas, batch, encoded))


def _encode_all(names: list[str], tensors: list[torch.Tensor], policy: Policy, stager: _Stager,
                on_progress: Callable[[int], object], recorded: list[Layout], limits: GpuLimits | None = None,
                only: list[int] | None = None, sparse: list[int | None] | None = None) -> None:
    """Encode every batch of the state (of tensors ``only``, where given) and hand it to
    ``stager``, in file order. ``recorded``: per tensor, the layout its entry records
    (:attr:`.sources.Table.recorded`). ``sparse``: per tensor, its non-zero
    count where it is coded sparse (:attr:`.sources.Table.sparse`); a tensor coded in element
    ranges is not."""
    chosen = list(range(len(tensors))) if only is None else only
    counts = sparse or [None] * len(tensors)
    plan = [(key, [chosen[i] for i in idx])
            for key, idx in save_batches([tensors[i] for i in chosen], policy, limits)]
    entropies = _entropies_ahead(tensors, plan, limits)
    workers, share = cpu_workers(sum(key.backend == "cpu" for key, _ in plan))
    ceiling = _Ceiling()
    # GPU work runs on the caller's current stream (from a lane thread too): after what the caller
    # queued, before what it queues next (so it may change the tensors at once), in the blocks
    # the caller's stream caches
    streams = {key.device: torch.cuda.current_stream(key.device) for key, _ in plan if key.backend == "cuda"}
    policies = {key.device: limits.policy_on(key.device, policy) if limits else policy for key, _ in plan}
    tasks = (
        Task((key, idx), functools.partial(_ranges_of, tensors[idx[0]], key, policies[key.device],
                                           limits.batch[key.device], limits.block.get(key.device))
             if key.parts and limits else
             functools.partial(_on_stream, streams.get(key.device), _encode, [tensors[i] for i in idx], key,
                               policies[key.device], share, ceiling, [counts[i] for i in idx],
                               limits.block.get(key.device) if limits else None,
                               entropies[idx] if key.device in entropies.devices else None),
             inline=key.backend == "cuda")
        for key, idx in plan
    )
    for (_, idx), parts in run_ahead(tasks, workers, limits.lanes if limits else 1):
        for positions, batch in parts:
            part = [idx[p] for p in positions]
            metas = [recorded[i] for i in part]
            stager.stage(part, [names[i] for i in part], metas, batch)
            on_progress(sum(m.nbytes for m in metas))


@dataclass
class _Entropies:
    """Plane entropies of the tensors batched on ``devices``, by the tensor's position (rows of
    the others: 0)."""

    devices: frozenset[torch.device]
    rows: np.ndarray

    def __getitem__(self, positions: list[int]) -> np.ndarray:
        return self.rows[positions]


def _entropies_ahead(tensors: list[torch.Tensor], plan: list[tuple[BatchKey, list[int]]], limits: GpuLimits | None
                     ) -> _Entropies:
    """Where a GPU's batches overlap (:attr:`~.plan.GpuLimits.overlap`), the plane entropies of
    its batches' tensors, read in one wait before the first batch, so that each batch is started
    before the previous one is finished (:func:`_encode`). A GPU without room for the sampling's
    counts (about 100 MiB) codes its batches one after another, as where they do not overlap."""
    rows = np.zeros((len(tensors), 8), dtype=np.float32)
    devices: set[torch.device] = set()
    for device in {key.device for key, _ in plan if limits and key.device in limits.overlap and not key.parts}:
        on = [i for key, idx in plan if key.device == device and not key.parts for i in idx]
        try:
            with _on(device):
                rows[on] = sampled_plane_entropies([tensor_bytes(tensors[i]) for i in on],
                                                   np.array([tensors[i].element_size() for i in on]))
        except (torch.OutOfMemoryError, RuntimeError) as exc:  # its batches then wait for their splits
            if not memory.is_out_of_memory(exc):
                raise
            continue
        devices.add(device)
    return _Entropies(frozenset(devices), rows)


def _on_stream(stream: torch.cuda.Stream | None, encode: Callable[..., _Encoded], *args: Any) -> _Encoded:
    """``encode(*args)`` with ``stream`` current (a CPU batch: none)."""
    if stream is None:
        return encode(*args)
    with torch.cuda.stream(stream):
        return encode(*args)


def _run_pipeline(encode: Callable[[_Stager], None], stager: _Stager, sink: _Sink | None) -> None:
    """Run ``encode`` into ``stager`` (which feeds ``sink``); on any error stop both, raise it."""
    try:
        encode(stager)
        stager.close()
    except BaseException:
        with contextlib.suppress(BaseException):
            stager.close()
        if sink is not None:
            with contextlib.suppress(BaseException):
                sink.close()
        raise
    if sink is not None:
        sink.close()


def _finish(writer: ContainerWriter, sink: _Sink, tree: Any, table: Table | None = None) -> list[TensorEntry]:
    written = [entry for entry in sink.entries if entry is not None]
    if len(written) != len(sink.entries):
        raise AssertionError("a tensor of the table was never written")
    for entry in written if table is None else table.complete(written):
        writer.add_tensor(entry)
    writer.finish(tree, None if table is None else table.bases)
    return writer.tensors


def write_state(f: BinaryIO, names: list[str], tensors: list[torch.Tensor], tree: Any, policy: Policy,
                base: DeltaBase | None = None, gpu_memory: int | None = None, *,
                on_progress: Callable[[int], object] = lambda _: None) -> list[TensorEntry]:
    """Write a whole container to ``f``: every tensor, then the index and trailer. Returns the
    tensor table. Duplicates and casts are stored as references; with ``base``, tensors may be
    stored as XOR deltas against it (:mod:`.sources`). GPU work stays within each GPU's budget
    (:func:`.memory.budget`, ``gpu_memory`` caps it), on the caller's current stream."""
    limits = GpuLimits.of(tensors, policy, gpu_memory)
    table = rewrite_table(names, tensors, base)
    names, tensors = table.names, table.tensors
    writer = ContainerWriter(f, table.version)
    pool = pinned_pool() if any(t.is_cuda for t in tensors) else None
    sink = _Sink(writer, pool, f, len(tensors))
    with _out_of_memory_named("save", limits):
        _run_pipeline(lambda stager: _encode_all(names, tensors, policy, stager, on_progress, table.recorded, limits,
                                                 sparse=table.sparse),
                      _Stager(pool, sink.put), sink)
    return _finish(writer, sink, tree, table)


@contextlib.contextmanager
def _out_of_memory_named(what: str, limits: GpuLimits) -> Iterator[None]:
    """Turn a GPU allocation failure that no batch could work around (one outside the batches,
    say) into :class:`~ckptzip.errors.GpuMemoryError` with the numbers."""
    try:
        yield
    except (torch.OutOfMemoryError, RuntimeError) as exc:
        if not memory.is_out_of_memory(exc):
            raise
        have = ", ".join(f"{memory.available(d) >> 20} MiB on {d} (budget {n >> 20} MiB)"
                         for d, n in limits.budget.items()) or "no GPU budget"
        raise GpuMemoryError(f"{what} ran out of GPU memory ({memory.failure_line(exc)}); {have} can be had "
                             "now. Nothing was written in place of the previous checkpoint. Free GPU memory, "
                             "or pass a smaller gpu_memory") from exc


@dataclass
class StagedState:
    """A state's table (:func:`~.sources.rewrite_table`) whose CUDA tensors are encoded on their
    devices, their stored bytes waiting in host memory (pinned buffers of ``pool``) for
    :func:`write_staged`, which writes them with the rest of the table, later and on another
    thread if need be."""

    jobs: list[_Job]
    pool: PinnedPool | None  # None: a portable staging's bytes belong to no pool
    table: Table
    rest: list[int]  # positions in ``table.tensors`` not staged (host tensors)

    @property
    def nbytes(self) -> int:
        """Stored bytes staged in the pool's buffers."""
        return sum(job.piece[1] for job in self.jobs)

    @property
    def occupied_bytes(self) -> int:
        """Bytes of the pool's buffers the staged bytes occupy (the last one partly used)."""
        if self.pool is None:
            return self.nbytes
        return sum(job.release is not None for job in self.jobs) * self.pool.buffer_bytes

    def release(self) -> None:
        """Return the buffers to the pool (a write does this as it goes)."""
        for job in self.jobs:
            if job.ready is not None:
                job.ready.synchronize()
            if job.release is not None and self.pool is not None:
                self.pool.release(job.release)
        self.jobs = []

    def portable(self) -> StagedState:
        """This staging as another process can take it (pickled by ``torch.multiprocessing``,
        which hands shared memory over without a copy): no CUDA tensor or event, no pool. Waits
        until the stored bytes are on the host. Bytes already in shared memory (a shared pool's
        buffers) are handed over as they are, so this staging must keep its buffers until the
        other process has written them; other bytes are copied into one shared buffer, after
        which :meth:`release` may give them back at once. The table's GPU tensors, which the
        write no longer reads, become meta tensors of their shapes and dtypes."""
        for job in self.jobs:
            if job.ready is not None:
                job.ready.synchronize()
        # a view of private memory would be moved into shared memory whole (its pool's slab) by
        # the pickler: every piece is either shared already or copied into one shared buffer
        private = [job.piece for job in self.jobs if job.piece[1] and not job.piece[0].is_shared()]
        copy = shared_empty(sum(n for _, n in private))
        start, moved = 0, {}
        for buffer, n in private:
            moved[id(buffer)] = copy[start : start + n].copy_(buffer[:n])
            start += n
        jobs = []
        for job in self.jobs:
            buffer, n = job.piece
            if not n and job.record is None and not job.first:
                continue  # only gave a buffer back
            record = job.record
            if record is not None:  # its checksums, off pinned memory
                record = dataclasses.replace(record, meta=torch.from_numpy(record.meta.numpy().copy()))
            piece = moved.get(id(buffer), buffer if n else torch.empty(0, dtype=torch.uint8))
            jobs.append(_Job((piece, n), job.first, record))
        tensors = [torch.empty_like(t, device="meta") if t.is_cuda else t if t.is_shared() else shared_copy(t)
                   for t in self.table.tensors]
        return StagedState(jobs, None, dataclasses.replace(self.table, tensors=tensors), list(self.rest))


def stage_state(names: list[str], tensors: list[torch.Tensor], policy: Policy, pool: PinnedPool,
                gpu_batch_bytes: int, base: DeltaBase | None = None, gpu_memory: int | None = None,
                expected: int | None = None, host_copies: dict[int, torch.Tensor] | None = None,
                on_table: Callable[[], object] | None = None) -> StagedState:
    """Rewrite the state's table as :func:`write_state` does, encode its CUDA tensors in batches
    of about ``gpu_batch_bytes`` (so the GPU needs little memory beyond the state and the XOR
    residues) and start copying their stored bytes into ``pool``'s buffers, which must not run
    out (a growing pool, first made to hold ``expected`` bytes, by default the raw size).
    Returns once the work is queued: the caller's current streams wait for it, so its later
    kernels may change the tensors without a host sync. The host tensors of ``tensors`` are
    encoded by :func:`write_staged`: they must not change until then. ``host_copies``: CUDA
    tensors of ``tensors`` (by position) that are being copied to the host, not yet complete: the
    table is rewritten from the CUDA tensors, and those it keeps as they are are encoded from
    their copies by :func:`write_staged`, once the copies are complete. ``on_table`` is called
    once the table is rewritten, before anything is encoded (where a host snapshot starts those
    copies: queued earlier, the rewrite's small reads would wait behind them)."""
    limits = GpuLimits.of(tensors, policy, gpu_memory, gpu_batch_bytes)
    table = rewrite_table(names, tensors, base)
    copies = host_copies or {}
    for k, position in enumerate(table.positions):
        copy = copies.get(position)
        if copy is not None and table.tensors[k] is tensors[position]:  # not a residue: the copy is its bytes
            table.tensors[k] = copy  # its entry still records the CUDA tensor's device (Table.recorded)
    if on_table is not None:
        on_table()
    # every CUDA tensor is coded now (those the budget sends to the host, copied there now): the
    # caller may change them once this returns
    cuda = [i for i, t in enumerate(table.tensors) if t.is_cuda]
    # stored bytes are at most about the raw size: slabs for them are quicker than many buffers
    pool.reserve(sum(table.tensors[i].numel() * table.tensors[i].element_size() for i in cuda)
                 if expected is None else expected)
    jobs: list[_Job] = []
    chosen = set(cuda)
    staged = StagedState(jobs, pool, table, [i for i in range(len(table.tensors)) if i not in chosen])
    try:
        with _out_of_memory_named("snapshot", limits):
            _run_pipeline(lambda stager: _encode_all(table.names, table.tensors, policy, stager, lambda _: None,
                                                     table.recorded, limits, cuda, table.sparse),
                          _Stager(pool, jobs.append), None)
    except BaseException:
        staged.release()  # the buffers the batches before the failure took, back to the pool
        raise
    return staged


def stage_coded(names: list[str], tensors: list[torch.Tensor], policy: Policy, pool: PinnedPool,
                gpu_memory: int | None = None, *, shared: bool = False) -> StagedState:
    """A snapshot of a state's tensors as a stager takes it, so the caller may change them once
    this returns: those its GPUs code are coded there now (:func:`stage_state`, in batches of
    :data:`~.plan.SAVE_BATCH_BYTES`); every other tensor (a host tensor, or one the GPU cannot
    code: no nvCOMP, or over its budget) is copied to the host now, into shared memory where
    ``shared``, and coded by :func:`write_staged`."""
    on_gpu = gpu_coded(tensors, policy, GpuLimits.of(tensors, policy, gpu_memory))
    copied = [t if coded else shared_copy(t) if shared else t.to("cpu", copy=True) for t, coded in zip(tensors, on_gpu)]
    return stage_state(names, copied, policy, pool, SAVE_BATCH_BYTES["cuda"], gpu_memory=gpu_memory)


def write_staged(f: BinaryIO, staged: StagedState, tree: Any, policy: Policy) -> list[TensorEntry]:
    """Write a container: the staged tensors' stored bytes (their buffers go back to the pool as
    they are written), then the table's host tensors, encoded now."""
    table = staged.table
    writer = ContainerWriter(f, table.version)
    sink = _Sink(writer, staged.pool, f, len(table.tensors))
    jobs, staged.jobs = staged.jobs, []

    def encode(stager: _Stager) -> None:
        for job in jobs:
            sink.put(job)
        if staged.rest:
            _encode_all(table.names, table.tensors, policy, stager, lambda _: None, table.recorded, only=staged.rest,
                        sparse=table.sparse)

    _run_pipeline(encode, _Stager(None, sink.put), sink)
    return _finish(writer, sink, tree, table)
