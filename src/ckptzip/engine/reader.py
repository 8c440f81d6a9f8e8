"""Whole-state load: stored bytes in batches from the file to :func:`~.decode.decode_batch`.

GPU batches: a reader thread fills pinned buffers (positioned reads, several at a time) and copies
each to the GPU on the copy stream as soon as it is full, a batch or more ahead of the decoder.
CPU batches decode on a thread pool, several at once, from zero-copy views where the file is
already in memory. Every tensor checksum is verified before anything is returned.
"""

from __future__ import annotations

import ctypes
import functools
import gc
import itertools
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..checksum import format_wsum64
from ..codecs import codec_threads, cpu_threads
from ..errors import CorruptCheckpointError, DecodeBudgetError, GpuMemoryError
from ..format import DTYPES, ContainerReader, TensorEntry
from ..memory import gpu
from ..memory.pages import prefer_huge_pages
from ..memory.pinned import to_host
from ..memory.scratch import scratch
from . import plan as _plan
from .ahead import Task, run_ahead
from .chunks import Listed
from .decode import Outputs, Runs, decode_batch
from .parts import stored_ranges
from .plan import Limit, cpu_batch_bytes, decode_backend, load_batches, packed
from .plan import work_device as _work_device
from .sources import LoadPlan
from .threads import cpu_workers
from .upload import Uploader

# A GPU batch's region, its decode buffers and the regions the uploader fills ahead: budget / 6.
LOAD_WORKING_SETS = 6
# Two GPU batches decode at once (two lanes, as saves code them) where every GPU's budget holds
# this many batches of a load's full size.
TWO_LANE_LOAD_WORKING_SETS = LOAD_WORKING_SETS + 3
RETRY_SHRINK = (1, 4, 16)  # batch sizes (fractions of the budget's) a load tries in turn
# Larger tensors decode in parts straight into their output, a part a batch (on a GPU: the batch
# its budget allows), so a load needs about the decoded size plus a batch per worker (a part's
# stored bytes, decode buffer, planes).
CPU_SLICE_BYTES = _plan.LOAD_BATCH_BYTES["cpu"]


def _verify_xxh3(data: np.ndarray, runs: Runs, entries: list[TensorEntry]) -> None:
    """Check format-1 chunk digests of a region laid out as ``runs`` say."""
    listed = Listed.of(entries)
    for file, region, length in zip(runs.file.tolist(), runs.region.tolist(), runs.length.tolist()):
        listed.verify_xxh3(data[region : region + length], file)


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


@dataclass(frozen=True)
class _Batch:
    """A batch of a load: the entries decoded together, where (``work``), and into what."""

    entries: list[TensorEntry]
    work: torch.device
    into: Outputs


def _decode_cpu(reader: ContainerReader, batch: _Batch, share: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Read and decode one CPU batch, its codecs on ``share`` threads (:func:`batch_share`)."""
    entries = batch.entries
    if not any(s.chunks for e in entries for s in e.streams):
        region, runs = torch.empty(0, dtype=torch.uint8), Runs.of([])
    else:
        region, runs = _host_region(reader, entries)
    with codec_threads(share):
        return decode_batch(entries, region, runs, "cpu", digests=reader.digest_is_wsum64, into=batch.into)


def _decode_gpu(uploader: Uploader | None, number: int, stream: torch.cuda.Stream, batch: _Batch, digests: bool
                ) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Decode GPU batch ``number`` on ``stream`` (the caller's, from a lane thread too)."""
    assert uploader is not None  # made for every plan with GPU batches
    region, runs, ready = uploader.get(number)
    with torch.cuda.device(batch.work), torch.cuda.stream(stream):
        stream.wait_event(ready)
        return decode_batch(batch.entries, region, runs, "cuda", digests=digests, into=batch.into)


def verify_checksums(entries: list[TensorEntry], found: list[int]) -> None:
    """Raise ``CorruptCheckpointError`` naming the first tensor whose decoded bytes do not match."""
    for entry, value in zip(entries, found):
        got = format_wsum64(value)
        if got != entry.checksum:
            raise CorruptCheckpointError(
                f"tensor {entry.name!r}: decoded bytes have checksum {got}, expected {entry.checksum}; "
                "the file is damaged or a codec misbehaved"
            )


def _nothing(_: int) -> None:
    pass


@dataclass(frozen=True)
class LoadOptions:
    """How a load decodes: the tensors of the bases its XOR deltas need (by base, the base's
    tensors by name), a cap on the GPU memory it uses (:func:`ckptzip.memory.gpu.budget`), and what it tells
    of its progress (decoded bytes, as they are)."""

    base_tensors: Sequence[Mapping[str, torch.Tensor]] | None = None
    gpu_memory: int | None = None
    on_progress: Callable[[int], object] = _nothing


@dataclass(slots=True)  # not frozen: made per tensor, where a frozen one costs several times more
class _Target:
    """A stored entry a load decodes: where it is returned (``device``), where it is decoded
    (``work``), and the uint8 tensor it is decoded into (None: a new one, made before the first
    attempt)."""

    entry: TensorEntry
    device: torch.device
    work: torch.device
    out: torch.Tensor | None = None

    def output(self) -> torch.Tensor:
        assert self.out is not None  # made before the first attempt (_read_retrying)
        return self.out


def read_tensors(reader: ContainerReader, indices: list[int], devices: list[torch.device],
                 options: LoadOptions = LoadOptions(), *, into: Sequence[torch.Tensor | None] | None = None
                 ) -> list[torch.Tensor]:
    """Decode and verify tensors ``indices`` of the container onto ``devices`` (one each).
    Copies and casts are rebuilt from the entries they refer to, XOR deltas from the options'
    base tensors. GPU work stays within each GPU's budget beside the tensors returned
    (:func:`ckptzip.memory.gpu.budget`; the options' ``gpu_memory`` caps it).

    ``into``: per index, a tensor to decode into instead of a new one (returned in its place),
    used where it fits (a stored entry decoded where the tensor is, contiguous, of its dtype and
    size); its bytes are overwritten before they are verified."""
    plan = LoadPlan(reader.tensors, reader.index.bases, indices, devices, options.base_tensors)
    wanted = dict(zip(indices, into)) if into is not None else {}
    targets = []
    for i, entry, device in zip(plan.stored, plan.entries, plan.devices):
        work = _work_device(decode_backend(entry, device), device)
        targets.append(_Target(entry, device, work, _fitting(wanted.get(i), entry, work)))
    return plan.finish(_read_within_memory(reader, targets, options), indices)


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
        w: Limit(within=gpu.budget(w, gpu_memory, "load").nbytes // 2) for w in {works[i] for i in through}}
    limits[None] = Limit()  # the others ride along
    chosen = set(through)
    rest = [i for i in range(len(works)) if i not in chosen]  # read in the first round
    return packed(rest + through, nbytes, [works[i] if i in chosen else None for i in range(len(works))], limits,
                  shared=True)


def _read_within_memory(reader: ContainerReader, targets: list[_Target], options: LoadOptions) -> list[torch.Tensor]:
    """:func:`_read_retrying` in :func:`_rounds`."""
    rounds = _rounds([t.device for t in targets], [t.work for t in targets], [t.entry.nbytes for t in targets],
                     options.gpu_memory)
    if len(rounds) == 1:
        return _read_retrying(reader, targets, options)
    out: list[torch.Tensor | None] = [None] * len(targets)
    for members in rounds:
        values = _read_retrying(reader, [targets[i] for i in members], options)
        for i, value in zip(members, values):
            out[i] = value
    return [t for t in out if t is not None]


def _read_retrying(reader: ContainerReader, targets: list[_Target], options: LoadOptions) -> list[torch.Tensor]:
    """:func:`_read_stored` into the targets' outputs (new ones where they have none); where a
    GPU runs out of memory anyway (other allocations than the budget saw), again in batches a
    quarter and a sixteenth the size, then ``GpuMemoryError``."""
    # outputs first, on this thread (host memory a previous load freed is reused from this thread's
    # heap instead of being paged in afresh by worker threads), and once: a retry reuses them; new
    # host outputs in huge pages where the kernel gives them on request (the batches fault them in)
    made = [_Target(t.entry, t.device, t.work, _output(t.entry, t.work)) if t.out is None else None for t in targets]
    prefer_huge_pages(m.output() for m in made if m is not None)
    targets = [t if m is None else m for t, m in zip(targets, made)]
    failures: list[str] = []
    for shrink in RETRY_SHRINK:
        try:
            return _read_stored(reader, targets, options, shrink=shrink)
        except (torch.OutOfMemoryError, RuntimeError) as exc:
            if not gpu.is_out_of_memory(exc):
                raise
            failures.append(gpu.failure_line(exc))
        # out of the except block: the failed attempt's buffers are freed with its frames
        gc.collect()  # and with any cycle that holds them (a worker's future, the uploader's queue)
    failure = failures[0] + (f"; at last: {failures[-1]}" if failures[-1] != failures[0] else "")
    cuda = sorted({t.device for t in targets if t.device.type == "cuda"}, key=str)
    have = ", ".join(f"{gpu.available(d) >> 20} MiB on {d}" for d in cuda) or "none"
    raise GpuMemoryError(
        f"load ran out of GPU memory even in batches {RETRY_SHRINK[-1]} times smaller ({failure}); beside the "
        f"tensors it returns, {have} can be had. Free GPU memory, or load to the CPU (map_location='cpu')")


def _output(entry: TensorEntry, device: torch.device) -> torch.Tensor:
    """The uint8 output of ``entry`` on ``device``, of the size it declares; one the allocator
    refuses (a process's address-space limit, a host without the memory, even where the
    budget allowed it) is :class:`~ckptzip.errors.DecodeBudgetError`, before anything is decoded."""
    try:
        return torch.empty(entry.nbytes, dtype=torch.uint8, device=device)
    except (RuntimeError, MemoryError) as exc:
        if not (isinstance(exc, MemoryError) or gpu.is_out_of_memory(exc) or "allocate" in str(exc)):
            raise
        raise DecodeBudgetError(
            f"tensor {entry.name!r} declares {entry.nbytes} bytes ({entry.nbytes / 2**30:.1f} GiB) for {device}, which "
            f"cannot be allocated there ({gpu.failure_line(exc)}); nothing was decoded. Load it where there is "
            "room (map_location), or with a smaller max_bytes to refuse such files before allocating") from exc


@dataclass(slots=True)  # not frozen: made per tensor, as _Target
class _Item:
    """What a load decodes as one: a target's entry, or an element range of it (an entry of its
    own, :func:`~.parts.stored_ranges`, at byte ``at`` of the target's output; None: the whole entry)."""

    entry: TensorEntry
    work: torch.device
    target: int  # its target's position
    at: int | None = None

    def output(self, targets: list[_Target]) -> torch.Tensor:
        out = targets[self.target].output()
        return out if self.at is None else out[self.at : self.at + self.entry.nbytes]


class _Results:
    """What a load's batches decoded: whole targets' bytes, and the checksums to verify: by batch
    for whole targets, by target for the ranges of those decoded in ranges (which add up to
    the target's own)."""

    def __init__(self, items: list[_Item]) -> None:
        self._items = items
        self.data: dict[int, torch.Tensor] = {}
        self._sums: list[tuple[list[TensorEntry], torch.Tensor]] = []
        self._ranges: dict[int, list[torch.Tensor]] = {}

    def add(self, idx: list[int], datas: list[torch.Tensor], checksums: torch.Tensor) -> int:
        """A batch decoded: items ``idx``, their bytes and checksums; returns its decoded bytes."""
        items = self._items
        kept = [n for n, j in enumerate(idx) if items[j].at is None]
        for n in kept:
            self.data[items[idx[n]].target] = datas[n]
        if kept:
            self._sums.append(([items[idx[n]].entry for n in kept], checksums[kept] if len(kept) < len(idx) else checksums))
        for n, j in enumerate(idx):
            if items[j].at is not None:
                self._ranges.setdefault(items[j].target, []).append(checksums[n : n + 1])
        return sum(items[j].entry.nbytes for j in idx)

    def verify(self, targets: list[_Target]) -> None:
        """Every checksum, one sync per batch, after all of them are queued."""
        for group, checksums in self._sums:
            verify_checksums(group, checksums.tolist())
        for i, sums in self._ranges.items():  # the sum of its ranges' checksums (modulo 2**64)
            verify_checksums([targets[i].entry], [sum(torch.cat(sums).tolist())])


def _decode_all(tasks: Iterator[Task[list[int], tuple[list[torch.Tensor], torch.Tensor]]], workers: int, lanes: int,
                results: _Results, on_progress: Callable[[int], object]) -> None:
    """Run the decode tasks in order into ``results``; ``lanes`` GPU batches at once."""
    for idx, (datas, checksums) in run_ahead(tasks, workers, lanes):
        on_progress(results.add(idx, datas, checksums))


def _items(targets: list[_Target], gpu_batch: dict[torch.device, int], cpu_batch: int) -> list[_Item]:
    """The targets as a load decodes them: those larger than a batch in element ranges."""
    items: list[_Item] = []
    for i, target in enumerate(targets):
        work = target.work
        parts = stored_ranges(target.entry, gpu_batch[work] if work.type == "cuda" else min(CPU_SLICE_BYTES, cpu_batch))
        if parts is None:
            items.append(_Item(target.entry, work, i))
        else:
            items.extend(_Item(part, work, i, offset) for part, offset in parts)
    return items


def _read_stored(reader: ContainerReader, targets: list[_Target], options: LoadOptions, shrink: int = 1
                 ) -> list[torch.Tensor]:
    """Decode and verify stored entries onto their targets' devices, through their outputs
    (uint8, on their ``work`` devices, where each is decoded).

    The GPU's budget left beside the outputs (:mod:`ckptzip.memory.gpu`) sets the batch size. Tensors larger
    than a batch decode in parts straight into their output, so decoding needs about the decoded
    size plus a few batches, not twice the largest tensor."""
    budgets = {w: gpu.budget(w, options.gpu_memory, "load") for w in {t.work for t in targets if t.work.type == "cuda"}}
    gpu_batch = {work: b.batch_bytes(LOAD_WORKING_SETS * shrink, _plan.LOAD_BATCH_BYTES["cuda"]) for work, b in budgets.items()}
    cpu_batch = cpu_batch_bytes(sum(max(t.entry.compressed_nbytes, t.entry.nbytes) for t in targets if t.work.type == "cpu"),
                                cpu_threads())
    items = _items(targets, gpu_batch, cpu_batch)
    first_words = np.array([0 if item.at is None else item.at // 8 for item in items], dtype=np.int64)

    def batch(work: torch.device, idx: list[int]) -> _Batch:
        outs: list[torch.Tensor | None] = [items[j].output(targets) for j in idx]
        return _Batch([items[j].entry for j in idx], work, Outputs(outs, first_words[idx]))

    plan = load_batches([item.entry for item in items], [item.work for item in items], gpu_batch, cpu_batch)
    uploaded = [(work, [items[j].entry for j in idx]) for backend, work, idx in plan if backend == "cuda"]
    uploader = Uploader(reader, uploaded) if uploaded else None
    digests = reader.digest_is_wsum64
    workers, share = cpu_workers(sum(backend == "cpu" for backend, _, _ in plan))
    streams = {work: torch.cuda.current_stream(work) for work in gpu_batch}
    gpu_number = itertools.count()
    tasks = (
        Task(idx, functools.partial(_decode_gpu, uploader, next(gpu_number), streams[work], batch(work, idx), digests),
             inline=True)
        if backend == "cuda" else
        Task(idx, functools.partial(_decode_cpu, reader, batch(work, idx), share))
        for backend, work, idx in plan
    )
    # a retry after running out of memory decodes one batch at a time
    lanes = 2 if shrink == 1 and gpu_batch and all(
        b.nbytes >= TWO_LANE_LOAD_WORKING_SETS * _plan.LOAD_BATCH_BYTES["cuda"] for b in budgets.values()) else 1
    results = _Results(items)
    try:
        _decode_all(tasks, workers, lanes, results, options.on_progress)
    finally:
        if uploader is not None:
            uploader.close()
    data = results.data
    data.update((item.target, targets[item.target].output()) for item in items if item.at is not None)
    results.verify(targets)
    out = []
    to_cpu = [i for i, t in enumerate(targets) if t.device.type == "cpu" and data[i].is_cuda]
    data.update(zip(to_cpu, to_host([data[i] for i in to_cpu])))
    for i, target in enumerate(targets):
        raw, entry = data[i], target.entry
        dtype = DTYPES[entry.dtype]
        tensor = raw.view(dtype) if entry.nbytes else torch.empty(0, dtype=dtype, device=raw.device)
        tensor = tensor.reshape(entry.shape)
        out.append(tensor if tensor.device == target.device else tensor.to(target.device))
    return out
