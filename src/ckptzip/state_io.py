"""Whole-state save and restore: batches of GPU tensors through nvCOMP, overlapped with transfers
and file I/O; CPU tensors through the CPU codecs; everything in file order."""

from __future__ import annotations

import contextlib
import functools
import json
import queue
import threading
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import BinaryIO

import torch

from .checksum import wsum64_tensor
from .codecs import Codec, get_codec
from .encode import encode_gpu_batch, encode_tensor, gpu_batchable
from .errors import CkptzipError, CorruptCheckpointError
from .format import DTYPES, ContainerReader, ContainerWriter, TensorEntry
from .kernels.planes import fused_available, merge_many, merge_planes
from .pipeline import decode_backend, read_tensor, verify_checksum
from .staging import BackgroundWriter, Stager, pinned_pool
from .tree import FlatTensor

BATCH_BYTES = 256 << 20  # uncompressed bytes of GPU tensors encoded per nvCOMP batch
READ_PIECE_BYTES = 64 << 20


@contextlib.contextmanager
def _side_stream(device: torch.device | None) -> Iterator[None]:
    """Run on a fresh stream of ``device`` that first waits for the work already queued there."""
    if device is None:
        yield
        return
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        yield


def _save_groups(tensors: list[FlatTensor], codec: str) -> Iterator[tuple[bool, list[FlatTensor]]]:
    """Consecutive GPU tensors of one device in batches of about BATCH_BYTES; others one by one."""
    batch: list[FlatTensor] = []
    size = 0
    for item in tensors:
        t = item.tensor
        if gpu_batchable(t, codec) and (not batch or batch[0].tensor.device == t.device):
            batch.append(item)
            size += t.numel() * t.element_size()
            if size >= BATCH_BYTES:
                yield True, batch
                batch, size = [], 0
            continue
        if batch:
            yield True, batch
            batch, size = [], 0
        if gpu_batchable(t, codec):
            batch, size = [item], t.numel() * t.element_size()
        else:
            yield False, [item]
    if batch:
        yield True, batch


def write_state(f: BinaryIO, tensors: list[FlatTensor], tree: object, codec: str,
                on_progress: Callable[[int], None]) -> None:
    """Write a whole container: every tensor, then the index and trailer."""
    writer = ContainerWriter(f)
    first_cuda = next((t.tensor.device for t in tensors if t.tensor.is_cuda), None)
    pool = pinned_pool() if first_cuda is not None else None
    background = BackgroundWriter(writer, pool, f)
    stager = Stager(background, pool)
    try:
        with _side_stream(first_cuda):
            for gpu, group in _save_groups(tensors, codec):
                items = [(g.name, g.tensor) for g in group]
                encoded = encode_gpu_batch(items, codec) if gpu else [encode_tensor(*items[0], codec)]
                for enc in encoded:
                    stager.add_tensor(enc)
                stager.flush()
                on_progress(sum(g.tensor.numel() * g.tensor.element_size() for g in group))
    except BaseException:
        with contextlib.suppress(BaseException):
            background.close()
        raise
    background.close()
    writer.finish(tree)


def _read_groups(entries: list[TensorEntry], devices: list[torch.device]) -> Iterator[tuple[str, list[int]]]:
    """Consecutive tensors decoded on one GPU, in batches of about BATCH_BYTES stored; others alone."""
    batch: list[int] = []
    size = 0
    for i, (entry, device) in enumerate(zip(entries, devices)):
        gpu = decode_backend(entry, device) == "cuda" and entry.nbytes > 0
        if gpu and batch and devices[batch[0]] == device and size < BATCH_BYTES:
            batch.append(i)
            size += entry.compressed_nbytes
            continue
        if batch:
            yield "cuda", batch
            batch, size = [], 0
        if gpu:
            batch, size = [i], entry.compressed_nbytes
        else:
            yield "cpu", [i]
    if batch:
        yield "cuda", batch


class _Prefetcher:
    """Reads and verifies the stored bytes of GPU batches on a thread, one batch ahead, in pieces of
    whole chunks no larger than a pinned buffer."""

    def __init__(self, reader: ContainerReader, batches: list[list[TensorEntry]]) -> None:
        self._reader = reader
        self._pool = pinned_pool()
        self._queue: queue.Queue = queue.Queue(maxsize=4)
        self._thread = threading.Thread(target=self._run, args=(batches,), name="ckptzip-reader", daemon=True)
        self._stop = False
        self._thread.start()

    def _run(self, batches: list[list[TensorEntry]]) -> None:
        try:
            for entries in batches:
                for piece in self._pieces(entries):
                    if self._stop:
                        return
                    self._queue.put(piece)
                self._queue.put(None)  # end of batch
        except BaseException as exc:
            self._queue.put(exc)

    def _pieces(self, entries: list[TensorEntry]) -> Iterator[tuple[int, int, torch.Tensor]]:
        chunks = [(e, j, k, c) for e in entries for j, s in enumerate(e.streams) for k, c in enumerate(s.chunks)]
        start = chunks[0][3].offset
        i = 0
        while i < len(chunks):
            first = chunks[i][3].offset
            n = 0
            group = []
            while i < len(chunks) and (not group or n + chunks[i][3].length <= self._pool.buffer_bytes):
                group.append(chunks[i])
                n += chunks[i][3].length
                i += 1
            buffer = self._pool.acquire() if n <= self._pool.buffer_bytes else torch.empty(n, dtype=torch.uint8)
            self._reader.read_into(buffer[:n], first, group)
            yield first - start, n, buffer

    def get(self) -> tuple[int, int, torch.Tensor] | None:
        item = self._queue.get()
        if isinstance(item, BaseException):
            raise item
        return item

    def release(self, buffer: torch.Tensor) -> None:
        if buffer.is_pinned() and buffer.numel() == self._pool.buffer_bytes:
            self._pool.release(buffer)

    def close(self) -> None:
        self._stop = True
        while self._thread.is_alive():
            with contextlib.suppress(queue.Empty):
                item = self._queue.get(timeout=0.05)
                if isinstance(item, tuple):
                    self.release(item[2])
        self._thread.join()


def _decode_gpu_batch(entries: list[TensorEntry], region: torch.Tensor, backend: str = "cuda") -> list[torch.Tensor]:
    """Decode tensors whose stored bytes lie in ``region`` (a GPU buffer starting at the first
    chunk): raw streams copied in place (a run of adjacent raw streams in one copy), one nvCOMP
    call per codec for all coded chunks, then one fused merge per item size that also computes
    the checksums, verified with one host sync. ``backend`` "cpu" runs it with CPU codecs (tests)."""
    base = entries[0].streams[0].chunks[0].offset if entries[0].streams and entries[0].streams[0].chunks else 0
    outputs = [torch.empty(e.nbytes, dtype=torch.uint8, device=region.device) for e in entries]
    jobs: dict[str, list[tuple[torch.Tensor, TensorEntry, int]]] = defaultdict(list)
    codecs: dict[str, Codec] = {}
    for entry, out in zip(entries, outputs):
        plane = entry.streams[0].nbytes if entry.transforms else entry.nbytes
        run_start = None  # first stream of the current run of raw streams
        for j, stream in enumerate([*entry.streams, None]):
            if stream is not None and stream.codec["id"] == "raw" and stream.chunks:
                run_start = j if run_start is None else run_start
                continue
            if run_start is not None:  # raw streams run_start..j-1 lie back to back in file and output
                lo = entry.streams[run_start].chunks[0].offset - base
                n = (j - run_start) * plane
                out[run_start * plane : run_start * plane + n].copy_(region[lo : lo + n])
                run_start = None
            if stream is None or not stream.chunks:
                continue
            try:
                codec = _decoder(stream.codec, backend)
            except CkptzipError as exc:
                raise type(exc)(f"tensor {entry.name!r} stream {j}: {exc}") from exc
            key = repr(codec)
            codecs[key] = codec
            jobs[key].append((out[j * plane : (j + 1) * plane], entry, j))
    for key, work in jobs.items():
        pieces = [
            region[c.offset - base : c.offset - base + c.length] for _, e, j in work for c in e.streams[j].chunks
        ]
        raw = [c.raw_length for _, e, j in work for c in e.streams[j].chunks]
        try:
            decoded = codecs[key].decode(pieces, raw)
        except CorruptCheckpointError as exc:
            names = sorted({e.name for _, e, _ in work})
            raise CorruptCheckpointError(f"tensors {names}: {exc}") from exc
        start = 0
        for slot, entry, j in work:
            count = len(entry.streams[j].chunks)
            torch.cat(decoded[start : start + count], out=slot)
            start += count
    results: list[torch.Tensor] = list(outputs)
    checksums = torch.zeros(len(entries), dtype=torch.int64, device=region.device)
    by_itemsize: dict[int, list[int]] = defaultdict(list)
    for i, entry in enumerate(entries):
        k = len(entry.streams) if entry.transforms else 1
        if k > 1 and fused_available(region.device, entry.nbytes, k):
            by_itemsize[k].append(i)
        elif k > 1:
            results[i], checksums[i] = merge_planes(list(outputs[i].split(entry.nbytes // k)), k)
        else:
            checksums[i] = wsum64_tensor(outputs[i])
    for k, idx in by_itemsize.items():
        merged, sums = merge_many([outputs[i] for i in idx], k)
        checksums[idx] = sums
        for i, data in zip(idx, merged):
            results[i] = data
    for entry, value in zip(entries, checksums.tolist()):  # one host sync
        verify_checksum(entry, value)
    return [d.view(DTYPES[e.dtype]).reshape(e.shape) for e, d in zip(entries, results)]


@functools.lru_cache(maxsize=64)
def _cached_decoder(config: str, backend: str) -> Codec:
    return get_codec(json.loads(config), backend)


def _decoder(config: dict, backend: str) -> Codec:
    """The decoder of a stream's codec configuration (codec objects are reused)."""
    return _cached_decoder(json.dumps(config, sort_keys=True), backend)


def read_state(reader: ContainerReader, devices: list[torch.device],
               on_progress: Callable[[int], None]) -> list[torch.Tensor]:
    """Decode every tensor of the container onto its device, in file order."""
    entries = reader.tensors
    groups = list(_read_groups(entries, devices))
    gpu_batches = [[entries[i] for i in idx] for kind, idx in groups if kind == "cuda"]
    prefetch = _Prefetcher(reader, gpu_batches) if gpu_batches else None
    tensors: list[torch.Tensor] = [None] * len(entries)  # type: ignore[list-item]
    try:
        for kind, idx in groups:
            if kind == "cpu":
                tensors[idx[0]] = read_tensor(reader, entries[idx[0]], devices[idx[0]])
            else:
                batch = [entries[i] for i in idx]
                work = devices[idx[0]] if devices[idx[0]].type == "cuda" else torch.device("cuda")
                region = torch.empty(sum(e.compressed_nbytes for e in batch), dtype=torch.uint8, device=work)
                pending = []
                while (piece := prefetch.get()) is not None:
                    offset, n, buffer = piece
                    region[offset : offset + n].copy_(buffer[:n], non_blocking=True)
                    event = torch.cuda.Event()
                    event.record()
                    pending.append((event, buffer))
                for event, buffer in pending:
                    event.synchronize()
                    prefetch.release(buffer)
                for i, t in zip(idx, _decode_gpu_batch(batch, region)):
                    tensors[i] = t.to(devices[i])
            on_progress(sum(entries[i].nbytes for i in idx))
    finally:
        if prefetch is not None:
            prefetch.close()
    return tensors
