"""Whole-state save: a state's batches coded (:mod:`.pipeline`), their stored bytes moved to the
host (:mod:`.stager`) and written to the file in order by a writer thread (:class:`Sink`), which
builds their index entries; the index last.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO

import numpy as np
import torch

from ..checksum import format_wsum64
from ..errors import GpuMemoryError
from ..format import DTYPE_NAMES, Chunk, ContainerWriter, StreamEntry, TensorEntry, digest_hexes
from ..memory import gpu
from ..memory.pinned import PinnedPool, pinned_pool
from ..storage.writeback import Writeback
from .ahead import InOrder
from .encode import Part
from .pipeline import encode_all
from .plan import GpuLimits
from .policy import Policy
from .sources import DeltaBase, Table, rewrite_table
from .stager import Job, Record, Stager

def _nothing(_: int) -> None:
    pass


@dataclass(frozen=True)
class SaveOptions:
    """How a save codes a state: the codec policy, the base its tensors may be stored as XOR
    deltas against (:mod:`.sources`), a cap on the GPU memory it uses
    (:func:`ckptzip.memory.gpu.budget`), and what it tells of its progress (the bytes of the
    tensors coded, as they are)."""

    policy: Policy
    base: DeltaBase | None = None
    gpu_memory: int | None = None
    on_progress: Callable[[int], object] = _nothing


def write_state(f: BinaryIO, names: list[str], tensors: list[torch.Tensor], tree: Any, options: SaveOptions
                ) -> list[TensorEntry]:
    """Write a whole container to ``f``: every tensor, then the index and trailer. Returns the
    tensor table. Duplicates and casts are stored as references; with a base, tensors may be
    stored as XOR deltas against it (:mod:`.sources`). GPU work stays within each GPU's budget
    (:func:`ckptzip.memory.gpu.budget`, the options cap it), on the caller's current stream."""
    limits = GpuLimits.of(tensors, options.policy, options.gpu_memory)
    table = rewrite_table(names, tensors, options.base)
    writer = ContainerWriter(f, table.version)
    pool = pinned_pool() if any(t.is_cuda for t in table.tensors) else None
    sink = Sink(writer, pool, f, len(table.tensors))
    with out_of_memory_named("save", limits):
        run_pipeline(lambda stager: encode_all(table, options.policy, stager, limits, on_progress=options.on_progress),
                     Stager(pool, sink.put), sink)
    return finish(writer, sink, tree, table)


@contextlib.contextmanager
def out_of_memory_named(what: str, limits: GpuLimits) -> Iterator[None]:
    """Turn a GPU allocation failure that no batch could work around (one outside the batches,
    say) into :class:`~ckptzip.errors.GpuMemoryError` with the numbers."""
    try:
        yield
    except (torch.OutOfMemoryError, RuntimeError) as exc:
        if not gpu.is_out_of_memory(exc):
            raise
        have = ", ".join(f"{gpu.available(d) >> 20} MiB on {d} (budget {n >> 20} MiB)"
                         for d, n in limits.budget.items()) or "no GPU budget"
        raise GpuMemoryError(f"{what} ran out of GPU memory ({gpu.failure_line(exc)}); {have} can be had "
                             "now. Nothing was written in place of the previous checkpoint. Free GPU memory, "
                             "or pass a smaller gpu_memory") from exc



class Sink(InOrder[Job]):
    """Writes staged batches on its own thread, in order, and records their entries."""

    def __init__(self, writer: ContainerWriter, pool: PinnedPool | None, f: BinaryIO, count: int) -> None:
        self._writer = writer
        self.entries: list[TensorEntry | None] = [None] * count
        self._batch_start = 0
        self._parts: dict[int, list[StreamEntry]] = {}  # tensors coded in parts: their streams so far
        self._pool = pool
        self._writeback = Writeback(f)
        super().__init__("ckptzip-writer", max(8, pool.count if pool else 0))

    def _handle(self, job: Job) -> None:
        self._write(job)

    def _finish(self, job: Job) -> None:
        if self._pool is not None and job.release is not None:
            self._pool.release(job.release)

    def _write(self, job: Job) -> None:
        if job.ready is not None:
            job.ready.synchronize()
        if job.first:
            self._batch_start = self._writer.offset
        buffer, n = job.piece
        self._writer.append(buffer.numpy().data[:n])
        if job.record is not None:
            self._record(job.record, self._batch_start)
        self._writeback.wrote()

    def _record(self, record: Record, start: int) -> None:
        coded = record.coded
        batch, table = coded.batch, coded.batch.chunks
        meta = record.meta.numpy().view(np.uint64)
        digests, checksums = meta[: table.length.size], meta[table.length.size :]
        offsets = (start + table.offset).tolist()
        lengths, raws = table.length.tolist(), table.raw.tolist()
        hexes = digest_hexes(digests)
        c = 0
        for t, (position, name, tensor) in enumerate(zip(coded.positions, coded.names, coded.layouts)):
            recipe = batch.recipes[t]
            streams = []
            for stream in recipe.streams:
                chunks = [Chunk(offsets[i], lengths[i], raws[i], hexes[i]) for i in range(c, c + stream.chunks)]
                c += stream.chunks
                streams.append(StreamEntry(stream.codec, stream.nbytes, chunks))
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


def run_pipeline(encode: Callable[[Stager], None], stager: Stager, sink: Sink | None) -> None:
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


def finish(writer: ContainerWriter, sink: Sink, tree: Any, table: Table | None = None) -> list[TensorEntry]:
    """Write the index (the table's entries, every one written) and the trailer; return the
    tensor table."""
    written = [entry for entry in sink.entries if entry is not None]
    if len(written) != len(sink.entries):
        raise AssertionError("a tensor of the table was never written")
    for entry in written if table is None else table.complete(written):
        writer.add_tensor(entry)
    writer.finish(tree, None if table is None else table.bases)
    return writer.tensors
