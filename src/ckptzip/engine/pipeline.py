"""The encode pipeline of a save: a state's batches (:func:`~.plan.save_batches`) coded in file
order and handed to a stager (:class:`~.stager.Stager`).

GPU batches are coded one after another on the caller's current stream (two at once on lane
threads where the budget holds them, :attr:`~.plan.GpuLimits.lanes`); where their entropies are
read ahead, each is started before the previous one is finished. CPU batches are coded on a
thread pool, several at once. A GPU batch that runs out of memory is coded smaller
(:meth:`_Coder.encode`), and later batches of the save as large are split before they are tried.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import logging
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import torch

from ..codecs import codec_threads
from ..memory import blocks, gpu
from .ahead import Task, run_ahead
from .encode import EncodedBatch, PendingBatch, encode_batch, start_batch, tensor_bytes
from .estimate import sampled_plane_entropies
from .parts import Ranged, encode_part, quarters, worth_parts
from .plan import BatchKey, GpuLimits, halving, save_batches
from .policy import Policy
from .sources import Table
from .stager import Coded, Stager
from .threads import cpu_workers

T = TypeVar("T")
_LOG = logging.getLogger("ckptzip")
_CPU = torch.device("cpu")

# A batch coded: ``[(positions in the batch, encoded)]``, one part unless a GPU ran out of memory.
_Encoded = Iterable[tuple[list[int], EncodedBatch]]


def _nothing(_: int) -> None:
    pass


@dataclass
class _Ceiling:
    """The smallest GPU batch of one save that ran out of memory: later batches that large are
    coded smaller before they are tried, so a filled GPU costs a save one failed attempt, not one
    per batch."""

    nbytes: int = sys.maxsize


@dataclass(frozen=True)
class _Todo:
    """A batch to code: its tensors, their non-zero counts where they are coded sparse (XOR
    residues, :func:`~.encode.encode_batch`), and their plane entropies where they were read
    ahead (:func:`_entropies_ahead`; the batch's codecs are then only queued when it is started)."""

    tensors: list[torch.Tensor]
    sparse: list[int | None]
    entropies: np.ndarray | None = None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)

    def halves(self) -> tuple[int, _Todo, _Todo]:
        """Where this batch is cut in two of the most even bytes, and the two halves."""
        half = halving([t.numel() * t.element_size() for t in self.tensors])
        ahead = (None, None) if self.entropies is None else (self.entropies[:half], self.entropies[half:])
        return (half, _Todo(self.tensors[:half], self.sparse[:half], ahead[0]),
                _Todo(self.tensors[half:], self.sparse[half:], ahead[1]))


@dataclass(frozen=True)
class _Coder:
    """How a save codes the batches of one key: the policy for its device, the threads a CPU
    batch's codecs use (``share``, :func:`~.threads.cpu_workers`), the save's ceiling, and the
    size of the blocks a GPU batch's buffers are views of (None: buffers of their own sizes,
    :func:`~ckptzip.memory.blocks.uniform`)."""

    key: BatchKey
    policy: Policy
    share: int
    ceiling: _Ceiling
    block: int | None = None

    def encode(self, todo: _Todo) -> _Encoded:
        """Code one batch: one part, unless a GPU ran out of memory (:meth:`_smaller`, whose
        buffers are of their own sizes). With the entropies read ahead, a GPU batch's codecs are
        only queued here, and the batch is finished when the result is iterated
        (:meth:`_finished`), after the caller has started the next."""
        tensors = todo.tensors
        if self.key.backend != "cuda":
            with codec_threads(self.share):
                return [(list(range(len(tensors))), encode_batch(_moved(tensors, _CPU), self.policy, "cpu", todo.sparse))]
        if todo.nbytes < self.ceiling.nbytes:
            pending = self._on_gpu(todo, lambda: start_batch(_moved(tensors, self.key.device), self.policy, "cuda",
                                                             todo.sparse, todo.entropies))
            if pending is not None:
                finished = self._finished(pending, todo)
                return finished if todo.entropies is not None else list(finished)
        return self._smaller(todo)

    def _on_gpu(self, todo: _Todo, attempt: Callable[[], T]) -> T | None:
        """``attempt()`` on the batch's GPU, its buffers in blocks; None where it ran out of
        memory (later batches as large as ``todo`` are then coded smaller: the ceiling)."""
        try:
            with _on(self.key.device), blocks.uniform(self.block):
                return attempt()
        except (torch.OutOfMemoryError, RuntimeError) as exc:
            if not gpu.is_out_of_memory(exc):
                raise
            failure = gpu.failure_line(exc)
        # out of the except block: the failed attempt's memory is freed with its frames
        nbytes = todo.nbytes
        self.ceiling.nbytes = nbytes
        _LOG.info("ckptzip: a GPU batch of %d tensors (%d MiB) ran out of memory on %s (%s); coding batches "
                  "that large smaller from now on", len(todo.tensors), nbytes >> 20, self.key.device, failure)
        return None

    def _finished(self, pending: PendingBatch, todo: _Todo) -> Iterator[tuple[list[int], EncodedBatch]]:
        """A started GPU batch, finished (or, where that runs out of memory, coded smaller)."""
        batch = self._on_gpu(todo, pending.finish)
        del pending  # a failed batch's buffers freed before it is coded smaller
        if batch is None:
            yield from self._smaller(todo)
        else:
            yield list(range(len(todo.tensors))), batch

    def _smaller(self, todo: _Todo) -> Iterator[tuple[list[int], EncodedBatch]]:
        """A GPU batch too large for the memory at hand, coded smaller, lazily (each piece leaves
        the GPU before the next is coded): in halves of the most even bytes; a lone tensor in
        element ranges a quarter of the size that failed (as byte planes, sparse or not), or on
        the host when it is too small for ranges."""
        tensors, own = todo.tensors, dataclasses.replace(self, block=None)
        if len(tensors) > 1:
            half, first, second = todo.halves()
            yield from own.encode(first)
            for positions, batch in own.encode(second):
                yield [half + p for p in positions], batch
        elif tensors[0].is_cuda and worth_parts(tensors[0]):
            yield from own.in_ranges(tensors[0], self.ceiling.nbytes // 4)
        else:
            yield from dataclasses.replace(own, key=BatchKey("cpu", _CPU)).encode(_Todo(tensors, todo.sparse))

    def in_ranges(self, tensor: torch.Tensor, range_bytes: int) -> Iterator[tuple[list[int], EncodedBatch]]:
        """A lone tensor coded on its GPU in element ranges of about ``range_bytes`` (:mod:`.parts`),
        one range at a time, in file order. A range that runs out of memory is coded in quarters
        (:func:`~.parts.quarters`), in buffers of their own sizes, down to the smallest range."""
        block, device = self.block, self.key.device
        with _on(device):
            ranged = Ranged.of(tensor, self.policy, self.key.backend)
            left = collections.deque(ranged.ranges(range_bytes))
            last = left[-1]
            while left:
                part = left.popleft()
                try:
                    with blocks.uniform(block):
                        coded = encode_part(ranged, part, (part.stream, part.end) == (last.stream, last.end))
                except (torch.OutOfMemoryError, RuntimeError) as exc:
                    if not gpu.is_out_of_memory(exc) or not quarters(part):
                        raise
                    failure = gpu.failure_line(exc)
                else:
                    yield [0], coded
                    continue
                # out of the except block: the failed attempt's memory is freed with its frames
                _LOG.info("ckptzip: a range of %d MiB of a %d MiB tensor ran out of memory on %s (%s); coding it in "
                          "quarters", (part.end - part.first) >> 20, tensor.nbytes >> 20, device, failure)
                block = None
                left.extendleft(reversed(quarters(part)))

    def ranges_of(self, tensor: torch.Tensor, range_bytes: int) -> _Encoded:
        """:meth:`in_ranges`: on a GPU lazily, each range coded as the caller's thread takes it
        (and off the GPU before the next); on the host (a pool thread's task) at once."""
        coded = self.in_ranges(tensor, range_bytes)
        return coded if self.key.backend == "cuda" else list(coded)


def _on(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """``device`` current for GPU work (nothing to do for the CPU)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _moved(tensors: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """``tensors`` on ``device`` (those already there as they are: ``Tensor.to`` costs a call's
    overhead even then, which a state of many small tensors pays per tensor)."""
    return [t if t.device == device else t.to(device) for t in tensors]


def encode_all(table: Table, policy: Policy, stager: Stager, limits: GpuLimits | None = None,
               only: list[int] | None = None, on_progress: Callable[[int], object] = _nothing) -> None:
    """Encode every batch of the table's tensors (of tensors ``only``, where given) and hand it
    to ``stager``, in file order. Each entry records its tensor's layout in the state
    (:attr:`.sources.Table.recorded`); a tensor the table codes sparse
    (:attr:`.sources.Table.sparse`) is, unless it is coded in element ranges."""
    names, tensors, recorded = table.names, table.tensors, table.recorded
    chosen = list(range(len(tensors))) if only is None else only
    counts = table.sparse or [None] * len(tensors)
    plan = [(key, [chosen[i] for i in idx])
            for key, idx in save_batches([tensors[i] for i in chosen], policy, limits)]
    entropies = _entropies_ahead(tensors, plan, limits)
    workers, share = cpu_workers(sum(key.backend == "cpu" for key, _ in plan))
    ceiling = _Ceiling()
    # GPU work runs on the caller's current stream (from a lane thread too): after what the caller
    # queued, before what it queues next (so it may change the tensors at once), in the blocks
    # the caller's stream caches
    streams = {key.device: torch.cuda.current_stream(key.device) for key, _ in plan if key.backend == "cuda"}
    coders = {key: _Coder(key, limits.policy_on(key.device, policy) if limits else policy, share, ceiling,
                          limits.block.get(key.device) if limits else None) for key, _ in plan}
    tasks = (
        Task((key, idx), functools.partial(coders[key].ranges_of, tensors[idx[0]], limits.batch[key.device])
             if key.parts and limits else
             functools.partial(_on_stream, streams.get(key.device), functools.partial(coders[key].encode, _Todo(
                 [tensors[i] for i in idx], [counts[i] for i in idx],
                 entropies[idx] if key.device in entropies.devices else None))),
             inline=key.backend == "cuda")
        for key, idx in plan
    )
    for (_, idx), parts in run_ahead(tasks, workers, limits.lanes if limits else 1):
        for positions, batch in parts:
            part = [idx[p] for p in positions]
            layouts = [recorded[i] for i in part]
            stager.stage(Coded(part, [names[i] for i in part], layouts, batch))
            on_progress(sum(m.nbytes for m in layouts))


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
    before the previous one is finished (:meth:`_Coder.encode`). A GPU without room for the
    sampling's counts (about 100 MiB) codes its batches one after another, as where they do not
    overlap."""
    rows = np.zeros((len(tensors), 8), dtype=np.float32)
    devices: set[torch.device] = set()
    for device in {key.device for key, _ in plan if limits and key.device in limits.overlap and not key.parts}:
        on = [i for key, idx in plan if key.device == device and not key.parts for i in idx]
        try:
            with _on(device):
                rows[on] = sampled_plane_entropies([tensor_bytes(tensors[i]) for i in on],
                                                   np.array([tensors[i].element_size() for i in on]))
        except (torch.OutOfMemoryError, RuntimeError) as exc:  # its batches then wait for their splits
            if not gpu.is_out_of_memory(exc):
                raise
            continue
        devices.add(device)
    return _Entropies(frozenset(devices), rows)


def _on_stream(stream: torch.cuda.Stream | None, encode: Callable[[], _Encoded]) -> _Encoded:
    """``encode()`` with ``stream`` current (a CPU batch: none)."""
    if stream is None:
        return encode()
    with torch.cuda.stream(stream):
        return encode()
