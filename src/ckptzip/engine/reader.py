"""Whole-state load: stored bytes in batches from the file to :func:`~.decode.decode_batch`.

GPU batches: a reader thread fills pinned buffers (positioned reads, several at a time) and copies
each to the GPU on the copy stream as soon as it is full, a batch or more ahead of the decoder.
CPU batches decode on a thread pool, several at once, from zero-copy views where the file is
already in memory. Every tensor checksum is verified before anything is returned.
"""

from __future__ import annotations

import collections
import ctypes
import functools
import gc
import itertools
import os
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent import futures
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from ..checksum import format_wsum64
from ..codecs import codec_threads, cpu_threads
from ..errors import CorruptCheckpointError, GpuMemoryError
from ..format import DTYPES, ContainerReader, StreamEntry, TensorEntry
from ..format.reader import verify_xxh3
from ..transforms import BytePlanes
from . import memory
from . import plan as _plan
from .ahead import Task, run_ahead
from .decode import Runs, decode_batch
from .plan import Limit, cpu_batch_bytes, decode_backend, load_batches, packed
from .plan import work_device as _work_device
from .scratch import scratch
from .sources import LoadPlan
from .staging import copy_stream, pinned_pool, to_host
from .threads import cpu_workers

# A GPU batch's region, its decode buffers and the regions the uploader fills ahead: budget / 6.
LOAD_WORKING_SETS = 6
# Two GPU batches decode at once (two lanes, as saves code them) where every GPU's budget holds
# this many batches of a load's full size.
TWO_LANE_LOAD_WORKING_SETS = LOAD_WORKING_SETS + 3
_AHEAD = 2  # device regions the uploader fills before a decoder takes them
RETRY_SHRINK = (1, 4, 16)  # batch sizes (fractions of the budget's) a load tries in turn
# Larger tensors decode in parts straight into their output, a part a batch (on a GPU: the batch
# its budget allows), so a load needs about the decoded size plus a batch per worker (a part's
# stored bytes, decode buffer, planes).
CPU_SLICE_BYTES = _plan.LOAD_BATCH_BYTES["cpu"]
# Reads in flight: one thread copies into a pinned buffer at a fraction of the host-to-device
# link's speed, so a dozen keep the link fed from memory too (results: "Save and load on a GPU").
_READ_THREADS = max(1, min(12, os.cpu_count() or 1))


def _chunk_list(entries: list[TensorEntry]) -> list[tuple[TensorEntry, int, int, Any]]:
    return [(e, j, k, c) for e in entries for j, s in enumerate(e.streams) for k, c in enumerate(s.chunks)]


def _verify_xxh3(data: np.ndarray, runs: Runs, entries: list[TensorEntry]) -> None:
    """Check format-1 chunk digests of a region laid out as ``runs`` say."""
    chunks = _chunk_list(entries)
    for file, region, length in zip(runs.file.tolist(), runs.region.tolist(), runs.length.tolist()):
        inside = [c for c in chunks if file <= c[3].offset < file + length]
        verify_xxh3(data[region : region + length], file, inside)


def _host_region(reader: ContainerReader, entries: list[TensorEntry]) -> tuple[torch.Tensor, Runs]:
    """The stored bytes of a CPU batch: a view of the span of its runs where the file is in memory
    (the writer's batches put a reader's batch in several runs: copying them back to back cost a
    pass over every stored byte), else read run by run."""
    runs = Runs.of(entries)
    data = reader.ranges.view(int(runs.file[0]), runs.span)
    if data is not None and data.size == runs.span:
        runs = runs.in_place()
    else:
        data = scratch("stored", runs.total).numpy()
        for file, region, length in zip(runs.file.tolist(), runs.region.tolist(), runs.length.tolist()):
            reader.read_into(data[region : region + length], file, f"tensor {entries[0].name!r}")
    if not reader.digest_is_wsum64:
        _verify_xxh3(data, runs, entries)
    return torch.from_numpy(data if data.flags.writeable else _writable_alias(data)), runs


def _writable_alias(data: np.ndarray) -> np.ndarray:
    """Read-only bytes in memory as a writable array over the same memory, no copy: torch takes
    only writable arrays, and the decoder only reads a batch's stored bytes (a copy cost a memory
    pass over every stored byte of a load from ``bytes``)."""
    alias = (ctypes.c_uint8 * data.size).from_address(data.ctypes.data)
    alias._source = data  # type: ignore[attr-defined]  # the memory lives as long as the alias
    return np.ctypeslib.as_array(alias)


def _decode_cpu(reader: ContainerReader, entries: list[TensorEntry], outs: list[torch.Tensor | None], share: int,
                first_words: np.ndarray) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Read and decode one CPU batch, its codecs on ``share`` threads (:func:`batch_share`)."""
    if not any(s.chunks for e in entries for s in e.streams):
        region, runs = torch.empty(0, dtype=torch.uint8), Runs.of([])
    else:
        region, runs = _host_region(reader, entries)
    with codec_threads(share):
        return decode_batch(entries, region, runs, "cpu", digests=reader.digest_is_wsum64, outs=outs,
                            first_words=first_words)


class _Uploader:
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
        self._reads = ThreadPoolExecutor(max_workers=_READ_THREADS, thread_name_prefix="ckptzip-read")
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
        chunks = None if self._reader.digest_is_wsum64 else [_chunk_list(entries) for _, entries, _ in plans]
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
               chunks: list[list[tuple[TensorEntry, int, int, Any]]] | None) -> list[list[tuple[int, int]]]:
        """Per batch, the file ranges read into one pinned buffer each (whole chunks where
        ``chunks`` are given, so each is checked in one piece)."""
        size = self._pool.buffer_bytes
        if chunks is not None:
            return [_chunk_spans(batch, size) for batch in chunks]
        return [[(o, min(size, start + length - o))
                 for start, length in zip(runs.file.tolist(), runs.length.tolist())
                 for o in range(start, start + length, size)] for _, _, runs in plans]

    def _pieces(self, plans: list[tuple[torch.device, list[TensorEntry], Runs]], spans: list[list[tuple[int, int]]],
                chunks: list[list[tuple[TensorEntry, int, int, Any]]] | None,
                pending: collections.deque[tuple[torch.cuda.Event, torch.Tensor]]
                ) -> Iterator[tuple[int, int, int, torch.Tensor]]:
        """(batch, file offset, size, pinned buffer holding those bytes) for every span of every
        batch, in order, with reads in flight across batch boundaries, so the copying threads
        never wait for a batch to be handed over."""
        size = self._pool.buffer_bytes
        flat = [(b, offset, n) for b, batch in enumerate(spans) for offset, n in batch]
        reads: collections.deque[tuple[int, int, int, torch.Tensor, Any]] = collections.deque()
        in_flight = max(1, min(_READ_THREADS, self._pool.count - 4))  # a few buffers wait for their copy
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

    def _finish(self, read: tuple[int, int, int, torch.Tensor, Any], chunks: list[list[tuple[TensorEntry, int, int, Any]]] | None
                ) -> tuple[int, int, int, torch.Tensor]:
        """The filled buffer of a read; format-1 chunks in it are checked against their XXH3."""
        b, offset, n, buffer, future = read
        try:
            future.result()
            if chunks is not None:
                verify_xxh3(buffer.numpy()[:n], offset, [c for c in chunks[b] if offset <= c[3].offset < offset + n])
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


def _chunk_spans(chunks: list[tuple[TensorEntry, int, int, Any]], size: int) -> list[tuple[int, int]]:
    """Runs of whole chunks of at most ``size`` bytes (a larger chunk alone)."""
    spans: list[tuple[int, int]] = []
    for _, _, _, c in chunks:
        if spans and spans[-1][0] + spans[-1][1] == c.offset and spans[-1][1] + c.length <= size:
            spans[-1] = (spans[-1][0], spans[-1][1] + c.length)
        else:
            spans.append((c.offset, c.length))
    return spans


def _decode_gpu(uploader: _Uploader | None, batch: int, stream: torch.cuda.Stream, entries: list[TensorEntry],
                device: torch.device, digests: bool, outs: list[torch.Tensor | None], first_words: np.ndarray
                ) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Decode GPU batch ``batch`` on ``stream`` (the caller's, from a lane thread too)."""
    assert uploader is not None  # made for every plan with GPU batches
    region, runs, ready = uploader.get(batch)
    with torch.cuda.device(device), torch.cuda.stream(stream):
        stream.wait_event(ready)
        return decode_batch(entries, region, runs, "cuda", digests=digests, outs=outs, first_words=first_words)


def verify_checksums(entries: list[TensorEntry], found: list[int]) -> None:
    """Raise ``CorruptCheckpointError`` naming the first tensor whose decoded bytes do not match."""
    for entry, value in zip(entries, found):
        got = format_wsum64(value)
        if got != entry.checksum:
            raise CorruptCheckpointError(
                f"tensor {entry.name!r}: decoded bytes have checksum {got}, expected {entry.checksum}; "
                "the file is damaged or a codec misbehaved"
            )


def _slices(entry: TensorEntry, limit: int) -> list[tuple[TensorEntry, int]] | None:
    """A tensor larger than ``limit`` (its byte planes, or its one stream) as element ranges cut
    where every stream has a chunk boundary, so each range decodes on its own into its part of the output: (an entry for
    the range, its byte offset in the tensor) each. None when no cut is needed or possible (sparse
    tensors, whose streams are not element ranges: they decode whole)."""
    k = len(entry.streams)
    planes = isinstance(entry.transform, BytePlanes)
    if entry.nbytes <= limit or not ((planes and k > 1) or (entry.transform is None and k == 1)):
        return None
    ends = [np.cumsum(s.columns.raw_length) for s in entry.streams]
    common = functools.reduce(np.intersect1d, ends)
    common = common[common * k % 8 == 0]  # parts start at whole words: their checksums add up (decode_batch)
    cuts = [0]
    for boundary in common.tolist():
        if boundary - cuts[-1] >= limit // k or boundary == ends[0][-1]:
            cuts.append(boundary)
    if len(cuts) <= 2:
        return None
    out = []
    for a, b in itertools.pairwise(cuts):
        streams = [StreamEntry(s.codec, b - a, [c for c, end in zip(s.chunks, e.tolist()) if a < end <= b])
                   for s, e in zip(entry.streams, ends)]
        part = TensorEntry(entry.name, "uint8", ((b - a) * k,), (b - a) * k, entry.checksum, entry.transforms,
                           streams, entry.device)
        out.append((part, a * k))
    return out


def read_tensors(reader: ContainerReader, indices: list[int], devices: list[torch.device],
                 on_progress: Callable[[int], object],
                 base_tensors: Sequence[Mapping[str, torch.Tensor]] | None = None,
                 gpu_memory: int | None = None,
                 into: Sequence[torch.Tensor | None] | None = None) -> list[torch.Tensor]:
    """Decode and verify tensors ``indices`` of the container onto ``devices`` (one each).
    Copies and casts are rebuilt from the entries they refer to, XOR deltas from ``base_tensors``
    (by base, the base's tensors by name). GPU work stays within each GPU's budget beside the
    tensors returned (:func:`.memory.budget`; ``gpu_memory`` caps it).

    ``into``: per index, a tensor to decode into instead of a new one (returned in its place),
    used where it fits (a stored entry decoded where the tensor is, contiguous, of its dtype and
    size); its bytes are overwritten before they are verified."""
    plan = LoadPlan(reader.tensors, reader.index.bases, indices, devices, base_tensors)
    entries, devices = plan.entries, plan.devices
    works = [_work_device(decode_backend(entry, device), device) for entry, device in zip(entries, devices)]
    wanted = dict(zip(indices, into)) if into is not None else {}
    given = [_fitting(wanted.get(i), entry, work) for i, entry, work in zip(plan.stored, entries, works)]
    decoded = _read_within_memory(reader, entries, devices, works, on_progress, gpu_memory, given)
    return plan.finish(decoded, indices)


def _fitting(target: torch.Tensor | None, entry: TensorEntry, work: torch.device) -> torch.Tensor | None:
    """``target``'s bytes (1-D uint8) where ``entry``, decoded on ``work``, can be decoded straight
    into it."""
    if (target is None or entry.source_kind == "xor" or target.device != work or not target.is_contiguous()
            or target.dtype != DTYPES[entry.dtype] or target.numel() * target.element_size() != entry.nbytes):
        return None
    return target.reshape(-1).view(torch.uint8)


def _rounds(devices: list[torch.device], works: list[torch.device], nbytes: list[int], gpu_memory: int | None
            ) -> list[list[int]]:
    """Entries read together. Tensors decoded on a GPU for the host (GPU-only codecs, loaded to
    the CPU) have their outputs on the GPU until the read ends: where they would not fit in half
    the GPU's budget, they are read in rounds that do, each copied to the host before the next."""
    through = [i for i, (w, d) in enumerate(zip(works, devices)) if w.type == "cuda" and d.type != "cuda"]
    if not through:
        return [list(range(len(works)))]
    limits: dict[torch.device | None, Limit] = {
        w: Limit(within=memory.budget(w, gpu_memory, "load").nbytes // 2) for w in {works[i] for i in through}}
    limits[None] = Limit()  # the others ride along
    chosen = set(through)
    rest = [i for i in range(len(works)) if i not in chosen]  # read in the first round
    return packed(rest + through, nbytes, [works[i] if i in chosen else None for i in range(len(works))], limits,
                  shared=True)


def _read_within_memory(reader: ContainerReader, entries: list[TensorEntry], devices: list[torch.device],
                        works: list[torch.device], on_progress: Callable[[int], object], gpu_memory: int | None,
                        given: list[torch.Tensor | None]) -> list[torch.Tensor]:
    """:func:`_read_retrying` in :func:`_rounds`."""
    rounds = _rounds(devices, works, [e.nbytes for e in entries], gpu_memory)
    if len(rounds) == 1:
        return _read_retrying(reader, entries, devices, works, on_progress, gpu_memory, given)
    out: list[torch.Tensor | None] = [None] * len(entries)
    for members in rounds:
        values = _read_retrying(reader, [entries[i] for i in members], [devices[i] for i in members],
                                [works[i] for i in members], on_progress, gpu_memory, [given[i] for i in members])
        for i, value in zip(members, values):
            out[i] = value
    return [t for t in out if t is not None]


def _read_retrying(reader: ContainerReader, entries: list[TensorEntry], devices: list[torch.device],
                   works: list[torch.device], on_progress: Callable[[int], object], gpu_memory: int | None,
                   given: list[torch.Tensor | None]) -> list[torch.Tensor]:
    """:func:`_read_stored` on ``works`` (where each entry is decoded) into ``given`` outputs
    (uint8, or None: new ones); where a GPU runs out of memory anyway (other allocations than the
    budget saw), again in batches a quarter and a sixteenth the size, then ``GpuMemoryError``."""
    # outputs first, on this thread (host memory a previous load freed is reused from this thread's
    # heap instead of being paged in afresh by worker threads), and once: a retry reuses them
    outs = [torch.empty(entry.nbytes, dtype=torch.uint8, device=work) if out is None else out
            for entry, work, out in zip(entries, works, given)]
    failures: list[str] = []
    for shrink in RETRY_SHRINK:
        try:
            return _read_stored(reader, entries, devices, works, outs, on_progress, gpu_memory, shrink=shrink)
        except (torch.OutOfMemoryError, RuntimeError) as exc:
            if not memory.is_out_of_memory(exc):
                raise
            failures.append(memory.failure_line(exc))
        # out of the except block: the failed attempt's buffers are freed with its frames
        gc.collect()  # and with any cycle that holds them (a worker's future, the uploader's queue)
    failure = failures[0] + (f"; at last: {failures[-1]}" if failures[-1] != failures[0] else "")
    cuda = sorted({d for d in devices if d.type == "cuda"}, key=str)
    have = ", ".join(f"{memory.available(d) >> 20} MiB on {d}" for d in cuda) or "none"
    raise GpuMemoryError(
        f"load ran out of GPU memory even in batches {RETRY_SHRINK[-1]} times smaller ({failure}); beside the "
        f"tensors it returns, {have} can be had. Free GPU memory, or load to the CPU (map_location='cpu')")


def _decode_all(tasks: Iterator[Task[list[int], tuple[list[torch.Tensor], torch.Tensor]]], workers: int, lanes: int,
                into: list[tuple[int, int] | None], items: list[TensorEntry], item_entry: list[int],
                data: dict[int, torch.Tensor], sums: list[tuple[list[TensorEntry], torch.Tensor]],
                parts: dict[int, list[torch.Tensor]], on_progress: Callable[[int], object]) -> None:
    """Run the decode tasks in order; whole tensors go to ``data``, their checksums to ``sums``;
    the checksums of parts of larger tensors to ``parts`` (by tensor: they add up to its own);
    ``lanes`` GPU batches at once."""
    for idx, (datas, checksums) in run_ahead(tasks, workers, lanes):
        kept = [n for n, j in enumerate(idx) if into[j] is None]
        for n in kept:
            data[item_entry[idx[n]]] = datas[n]
        if kept:
            sums.append(([items[idx[n]] for n in kept], checksums[kept] if len(kept) < len(idx) else checksums))
        for n, j in enumerate(idx):
            if (at := into[j]) is not None:
                parts.setdefault(at[0], []).append(checksums[n : n + 1])
        on_progress(sum(items[j].nbytes for j in idx))


def _read_stored(reader: ContainerReader, entries: list[TensorEntry], devices: list[torch.device],
                 works: list[torch.device], outs_of: list[torch.Tensor], on_progress: Callable[[int], object],
                 gpu_memory: int | None = None, shrink: int = 1) -> list[torch.Tensor]:
    """Decode and verify stored entries onto ``devices``, through their outputs ``outs_of``
    (uint8, on ``works``, where each is decoded).

    The GPU's budget left beside the outputs (:mod:`.memory`) sets the batch size. Tensors larger
    than a batch decode in parts straight into their output, so decoding needs about the decoded
    size plus a few batches, not twice the largest tensor."""
    budgets = {work: memory.budget(work, gpu_memory, "load") for work in {w for w in works if w.type == "cuda"}}
    gpu_batch = {work: b.batch_bytes(LOAD_WORKING_SETS * shrink, _plan.LOAD_BATCH_BYTES["cuda"]) for work, b in budgets.items()}
    items: list[TensorEntry] = []
    item_works: list[torch.device] = []
    into: list[tuple[int, int] | None] = []  # (tensor, byte offset) where an item decodes into a part
    item_entry: list[int] = []
    whole: dict[int, torch.Tensor] = {}
    cpu_batch = cpu_batch_bytes(sum(max(e.compressed_nbytes, e.nbytes) for e, w in zip(entries, works) if w.type == "cpu"),
                                cpu_threads())
    for i, (entry, work) in enumerate(zip(entries, works)):
        parts = _slices(entry, gpu_batch[work] if work.type == "cuda" else min(CPU_SLICE_BYTES, cpu_batch))
        if parts is None:
            items.append(entry)
            item_works.append(work)
            into.append(None)
            item_entry.append(i)
            continue
        whole[i] = outs_of[i]
        for part, offset in parts:
            items.append(part)
            item_works.append(work)
            into.append((i, offset))
            item_entry.append(i)

    first_words = np.array([0 if at is None else at[1] // 8 for at in into], dtype=np.int64)

    def outputs(idx: list[int]) -> list[torch.Tensor | None]:
        return [outs_of[item_entry[j]] if (at := into[j]) is None else whole[at[0]][at[1] : at[1] + items[j].nbytes]
                for j in idx]

    plan = load_batches(items, item_works, gpu_batch, cpu_batch)
    gpu = [(work, [items[j] for j in idx]) for backend, work, idx in plan if backend == "cuda"]
    uploader = _Uploader(reader, gpu) if gpu else None
    digests = reader.digest_is_wsum64
    workers, share = cpu_workers(sum(backend == "cpu" for backend, _, _ in plan))
    streams = {work: torch.cuda.current_stream(work) for work in gpu_batch}
    gpu_number = itertools.count()
    tasks = (
        Task(idx, functools.partial(_decode_gpu, uploader, next(gpu_number), streams[work], [items[j] for j in idx],
                                    work, digests, outputs(idx), first_words[idx]), inline=True)
        if backend == "cuda" else
        Task(idx, functools.partial(_decode_cpu, reader, [items[j] for j in idx], outputs(idx), share, first_words[idx]))
        for backend, work, idx in plan
    )
    # a retry after running out of memory decodes one batch at a time
    lanes = 2 if shrink == 1 and gpu_batch and all(
        b.nbytes >= TWO_LANE_LOAD_WORKING_SETS * _plan.LOAD_BATCH_BYTES["cuda"] for b in budgets.values()) else 1
    data: dict[int, torch.Tensor] = {}
    sums: list[tuple[list[TensorEntry], torch.Tensor]] = []
    part_sums: dict[int, list[torch.Tensor]] = {}
    try:
        _decode_all(tasks, workers, lanes, into, items, item_entry, data, sums, part_sums, on_progress)
    finally:
        if uploader is not None:
            uploader.close()
    data.update(whole)
    for group, checksums in sums:  # one sync per batch, after all of them are queued
        verify_checksums(group, checksums.tolist())
    for i in whole:  # a tensor decoded in parts: the sum of its parts' checksums (modulo 2**64)
        verify_checksums([entries[i]], [sum(torch.cat(part_sums[i]).tolist())])
    out = []
    to_cpu = [i for i, device in enumerate(devices) if device.type == "cpu" and data[i].is_cuda]
    data.update(zip(to_cpu, to_host([data[i] for i in to_cpu])))
    for i, (entry, device) in enumerate(zip(entries, devices)):
        raw = data[i]
        dtype = DTYPES[entry.dtype]
        tensor = raw.view(dtype) if entry.nbytes else torch.empty(0, dtype=dtype, device=raw.device)
        tensor = tensor.reshape(entry.shape)
        out.append(tensor if tensor.device == device else tensor.to(device))
    return out
