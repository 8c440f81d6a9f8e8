"""A staged state's two halves in the engine (:func:`stage_table`, :func:`write_staged`): a state's
CUDA tensors coded on their GPUs now and their stored bytes staged in pinned host memory, the
container written later, on another thread or in another process (:meth:`StagedState.portable`).
How a snapshot is staged, and with what plan, is :mod:`ckptzip.staging`'s.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, BinaryIO

import torch

from ..format import ContainerWriter, TensorEntry
from ..memory.pinned import PinnedPool
from ..memory.shared import shared_copy, shared_empty, unmap_pages
from .pipeline import encode_all
from .plan import GpuLimits
from .policy import Policy
from .sources import DeltaBase, Table, rewrite_table
from .stager import Job, Stager
from .writer import Sink, finish, out_of_memory_named, run_pipeline


@dataclass
class StagedState:
    """A state's table (:func:`~.sources.rewrite_table`) whose CUDA tensors are encoded on their
    devices, their stored bytes waiting in host memory (pinned buffers of ``pool``) for
    :func:`write_staged`, which writes them with the rest of the table, later and on another
    thread if need be."""

    jobs: list[Job]
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

    @property
    def shared(self) -> bool:
        """Whether every byte it holds on the host lies in shared memory already, so that
        :meth:`portable` copies nothing."""
        return (all(job.piece[0].is_shared() for job in self.jobs if job.piece[1])
                and all(t.is_shared() for t in self.table.tensors if t.device.type == "cpu" and t.numel()))

    def wait(self) -> None:
        """Until the stored bytes are in host memory (nothing reads the GPU tensors after that)."""
        for job in self.jobs:
            if job.ready is not None:
                job.ready.synchronize()

    def release(self) -> None:
        """Return the buffers to the pool (a write does this as it goes)."""
        self.wait()
        for job in self.jobs:
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
        unmap_pages(copy)  # the other process reads it: dropping it later then costs this one nothing
        jobs = []
        for job in self.jobs:
            buffer, n = job.piece
            if not n and job.record is None and not job.first:
                continue  # only gave a buffer back
            record = job.record
            if record is not None:  # its checksums, off pinned memory
                record = dataclasses.replace(record, meta=torch.from_numpy(record.meta.numpy().copy()))
            piece = moved.get(id(buffer), buffer if n else torch.empty(0, dtype=torch.uint8))
            jobs.append(Job((piece, n), job.first, record))
        tensors = [torch.empty_like(t, device="meta") if t.is_cuda else t if t.is_shared() else _handed_copy(t)
                   for t in self.table.tensors]
        return StagedState(jobs, None, dataclasses.replace(self.table, tensors=tensors), list(self.rest))


def _handed_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A shared copy of a host tensor for another process, unmapped here (:func:`unmap_pages`)."""
    copy = shared_copy(tensor)
    unmap_pages(copy)
    return copy


def staged_table(names: list[str], tensors: list[torch.Tensor], base: DeltaBase | None,
                 copies: Mapping[int, torch.Tensor] | None = None) -> Table:
    """The state's table rewritten as :func:`~.writer.write_state` rewrites it (against ``base``),
    for :func:`stage_table`. ``copies``: host copies of some of the CUDA tensors, by position,
    which may still be in flight (the caller starts them after this returns: started earlier, the
    rewrite's small reads would wait behind them); the table is rewritten from the CUDA tensors,
    and each it keeps as it is is coded from its copy by :func:`write_staged` (its entry still
    records the CUDA tensor's device, :attr:`~.sources.Table.recorded`)."""
    table = rewrite_table(names, tensors, base)
    in_flight = copies or {}
    for k, position in enumerate(table.positions):
        copy = in_flight.get(position)
        if copy is not None and table.tensors[k] is tensors[position]:  # not a residue: the copy is its bytes
            table.tensors[k] = copy
    return table


def stage_table(table: Table, policy: Policy, limits: GpuLimits, pool: PinnedPool, expected: int | None = None
                ) -> StagedState:
    """Encode the table's CUDA tensors in batches within ``limits`` (a host snapshot's small ones,
    so the GPU needs little memory beyond the state and the XOR residues) and start copying their
    stored bytes into ``pool``'s buffers, which must not run out (a growing pool, first made to
    hold ``expected`` bytes, by default the raw size). Returns once the work is queued: the
    caller's current streams wait for it, so its later kernels may change the tensors without a
    host sync. The table's host tensors are encoded by :func:`write_staged`: they must not
    change until then."""
    # every CUDA tensor is coded now (those the limits send to the host were copied there): the
    # caller may change them once this returns
    cuda = [i for i, t in enumerate(table.tensors) if t.is_cuda]
    # stored bytes are at most about the raw size: slabs for them are quicker than many buffers
    pool.reserve(sum(table.tensors[i].numel() * table.tensors[i].element_size() for i in cuda)
                 if expected is None else expected)
    jobs: list[Job] = []
    chosen = set(cuda)
    staged = StagedState(jobs, pool, table, [i for i in range(len(table.tensors)) if i not in chosen])
    try:
        with out_of_memory_named("snapshot", limits):
            run_pipeline(lambda stager: encode_all(table, policy, stager, limits, cuda), Stager(pool, jobs.append), None)
    except BaseException:
        staged.release()  # the buffers the batches before the failure took, back to the pool
        raise
    return staged


def write_staged(f: BinaryIO, staged: StagedState, tree: Any, policy: Policy) -> list[TensorEntry]:
    """Write a container: the staged tensors' stored bytes (their buffers go back to the pool as
    they are written), then the table's host tensors, encoded now."""
    table = staged.table
    writer = ContainerWriter(f, table.version)
    sink = Sink(writer, staged.pool, f, len(table.tensors))
    jobs, staged.jobs = staged.jobs, []

    def encode(stager: Stager) -> None:
        for job in jobs:
            sink.put(job)
        if staged.rest:
            encode_all(table, policy, stager, only=staged.rest)

    run_pipeline(encode, Stager(None, sink.put), sink)
    return finish(writer, sink, tree, table)
