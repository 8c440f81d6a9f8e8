"""How the engine divides its work, for a save and for a load: which device codes or decodes each
tensor (:func:`work_device`, a save's :class:`BatchKey`, a load's :func:`decode_backend`), the
bytes of a batch there (:func:`batch_bytes`, a save's :class:`GpuLimits`), and the one greedy
packer (:func:`packed`) that cuts items, in order, into groups within byte limits: a save's
batches (:func:`save_batches`), a load's (:func:`load_batches`) and its rounds, the DCP reader's
groups."""

from __future__ import annotations

import collections
import dataclasses
import logging
import sys
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import torch

from ..codecs import gpu_first_ids, has_codec
from ..format import TensorEntry
from ..memory import gpu
from .parts import worth_parts
from .policy import Policy

K = TypeVar("K", bound=Hashable)
_LOG = logging.getLogger("ckptzip")


def work_device(backend: str, device: torch.device) -> torch.device:
    """Where ``backend`` codes a tensor on (or bound for) ``device``: the CPU, or a GPU: that
    one, else the current one."""
    if backend == "cpu":
        return torch.device("cpu")
    return device if device.type == "cuda" else torch.device("cuda", torch.cuda.current_device())


def batch_bytes(device: torch.device, defaults: Mapping[str, int], on_gpu: Mapping[torch.device, int] | None) -> int:
    """The bytes of a batch coded on ``device``: on a GPU, ``on_gpu``'s for it (its budget's) where
    given; else ``defaults``' for the device type."""
    return (on_gpu or {}).get(device, defaults["cuda"]) if device.type == "cuda" else defaults["cpu"]


@dataclass(frozen=True)
class Limit:
    """Where a group is cut, by the bytes of one key in it: before an item that would take them
    over ``within``, after an item that takes them to ``fill`` or more (0: every item alone).
    None: never."""

    within: int | None = None
    fill: int | None = None


def packed(order: Iterable[int], nbytes: Sequence[int], keys: Sequence[K], limits: Mapping[K, Limit], *,
           shared: bool = False, open_groups: int = 1) -> list[list[int]]:
    """Positions ``order`` greedily in groups, in that order within each: a group per key, or
    (``shared``) groups of every key, each key's bytes counted apart; each cut where its key's
    limit says. Groups come in the order they are cut, then those left open in the order their
    keys opened them. With ``open_groups`` above one, up to that many groups of a key stay open
    where its limit has ``within``: an item goes to the first of them it fits (first fit), and a
    new one beyond them closes the oldest, so items of different sizes fill groups closer to
    ``within`` (and leave their order, by at most that many groups)."""
    if shared and open_groups != 1:
        raise ValueError("shared groups are packed one open group at a time")
    groups: list[list[int]] = []
    open_: dict[K | None, list[tuple[list[int], collections.Counter[K]]]] = {}
    for i in order:
        key, limit = keys[i], limits[keys[i]]
        candidates = open_.setdefault(None if shared else key, [])
        target = next((g for g in candidates if limit.within is None or _used_with(g, key, nbytes[i]) <= limit.within),
                      None)
        if target is None:
            target = ([], collections.Counter())
            candidates.append(target)
            if len(candidates) > open_groups:
                groups.append(candidates.pop(0)[0])
        members, used = target
        members.append(i)
        used[key] += nbytes[i]
        if limit.fill is not None and used[key] >= limit.fill:
            groups.append(members)
            candidates.remove(target)
            if not candidates:
                del open_[None if shared else key]  # its next group opens at the end
    groups.extend(members for candidates in open_.values() for members, _ in candidates)
    return groups


def _used_with(group: tuple[list[int], collections.Counter[K]], key: K, nbytes: int) -> int:
    """The bytes of ``key`` in ``group`` with ``nbytes`` more; an empty group takes any item."""
    members, used = group
    return used[key] + nbytes if members else 0


def halving(nbytes: Sequence[int]) -> int:
    """Where to cut items of these sizes (at least two) into two runs, in order, of the most even
    bytes: the larger run is as small as it can be (a count's half put a 64 MiB tensor with an
    8-byte one, so the half that failed was retried at nearly its size)."""
    total, before = sum(nbytes), 0
    best, cut = total, 1
    for k in range(1, len(nbytes)):
        before += nbytes[k - 1]
        if max(before, total - before) < best:
            best, cut = max(before, total - before), k
    return cut


# A save's batches: about this many bytes of tensors each, where a GPU's budget does not limit them.
SAVE_BATCH_BYTES = {"cuda": 2 << 30, "cpu": 8 << 20}
# A GPU batch's peak is about three times its bytes (planes, codec outputs, the stored chunks),
# and the pipeline holds up to two more batches' stored bytes besides: budget / 6 per batch. A
# tensor over budget / 6 is coded in element ranges of a batch's size (.parts).
SAVE_WORKING_SETS = 6
# Two GPU batches are coded at once (two lanes: one does its host work while the other waits for
# the device) where the budget holds a second batch's peak beside the others at the full batch
# size of a save: never on a filled GPU, where two lanes make torch's allocator free and retry.
TWO_LANE_WORKING_SETS = SAVE_WORKING_SETS + 3
# Where one lane runs and the budget limits the batches, a batch's buffers are blocks of one size
# (ckptzip.memory.blocks), a batch and BLOCK_SLACK each (the planes' alignment), so no tensor larger than
# a batch is coded whole and no batch holds more. There, and with one lane wherever the budget
# holds this many batches (a host snapshot's 256 MiB ones with 3 GiB free), a batch's codecs run
# while the host splits the next batch (the writer finishes each batch after starting the next,
# :func:`~.encode.start_batch`): beside a batch's planes, up to two codec outputs and its stored
# chunks, and the two batches' stored chunks the pipeline holds, the next batch's planes and codec
# outputs are held too, in blocks of a twelfth of the budget: the largest block that never ran a
# batch out of memory, and smaller ones only add batches (results: "A filled GPU, a training job's
# conditions").
BLOCK_SLACK = 2 << 20
OVERLAP_WORKING_SETS = 12
# GPU batches of at most this many bytes code their planes with the codecs' small-batch chunk
# sizes (Codec.small_batch_chunk_bytes): their sign/exponent planes hold fewer chunks than one
# launch runs at once (a GPU with a few GiB free; host snapshots' 256 MiB batches).
SMALL_BATCH_BYTES = 512 << 20
# Batches of blocks are packed first fit into up to this many open batches (:func:`packed`): in
# table order a tensor a little over half a block fills a block alone, and each batch costs the
# same host work whatever it holds (results: "A filled GPU, a training job's conditions").
OPEN_BATCHES = 8


@dataclass(frozen=True)
class BatchKey:
    """Where a batch is encoded: the backend and its device."""

    backend: str
    device: torch.device
    parts: bool = False  # one tensor, coded on its GPU in element ranges (:mod:`.parts`)


def _keys(tensors: list[torch.Tensor], policy: Policy, limits: GpuLimits | None = None) -> list[BatchKey]:
    """Where each tensor is encoded (:func:`_key`), the policy asked once per device."""
    backends: dict[torch.device, str] = {}
    keys = []
    for tensor in tensors:
        backend = backends.get(tensor.device)
        if backend is None:
            backend = backends[tensor.device] = policy.backend(tensor.device)
        keys.append(_key(tensor, backend, limits))
    return keys


def _key(tensor: torch.Tensor, backend: str, limits: GpuLimits | None) -> BatchKey:
    """Where ``tensor`` is encoded, given the backend of its device."""
    device = work_device(backend, tensor.device)
    if backend == "cuda" and limits is not None and device in limits.host:
        return BatchKey("cpu", torch.device("cpu"))
    if backend == "cuda" and limits is not None and not limits.fits(device, tensor):
        # more than a batch of the GPU's budget: in element ranges on it, or (small) on the host
        return BatchKey("cuda", device, True) if worth_parts(tensor) else BatchKey("cpu", torch.device("cpu"))
    return BatchKey(backend, device)


@dataclass(frozen=True)
class GpuLimits:
    """Per GPU, from its memory budget (:mod:`ckptzip.memory.gpu`): the batch size, and the largest tensor
    coded there whole (larger ones are coded there in element ranges, :mod:`.parts`)."""

    batch: dict[torch.device, int]
    largest: dict[torch.device, int]
    budget: dict[torch.device, int]
    lanes: int = 1  # GPU batches coded at once
    host: frozenset[torch.device] = frozenset()  # GPUs whose tensors are coded on the host
    # GPUs whose batches allocate their buffers in blocks of one size (:mod:`ckptzip.memory.blocks`): that size
    block: dict[torch.device, int] = field(default_factory=dict)
    # GPUs whose batches are each finished after the next is started (OVERLAP_WORKING_SETS): those
    # in blocks, and those whose budget holds that many of their batches (a host snapshot's)
    overlap: frozenset[torch.device] = frozenset()

    @classmethod
    def of(cls, tensors: list[torch.Tensor], policy: Policy, gpu_memory: int | None,
           batch_cap: int | None = None) -> GpuLimits:
        """The limits of a save's GPUs: each budget less the scratch the policy's GPU codecs need
        beside the batches; a GPU whose budget leaves less than half the minimum beside that
        scratch codes on the host. Where one lane runs and the budget, not ``batch_cap``, limits
        the batches, a batch is a twelfth of the budget and holds no more, and its buffers are
        blocks of one size (:data:`OVERLAP_WORKING_SETS`)."""
        batch_cap = SAVE_BATCH_BYTES["cuda"] if batch_cap is None else batch_cap
        devices = {key.device for key in _keys(tensors, policy) if key.backend == "cuda"}
        budgets = [gpu.budget(device, gpu_memory, "save") for device in sorted(devices, key=str)]
        scratch = policy.gpu_scratch_bytes() if budgets else 0
        host = frozenset(b.device for b in budgets if b.nbytes - scratch < gpu.MIN_GPU_MEMORY // 2)
        for b in budgets:
            if b.device in host:
                _LOG.info("ckptzip: coding the tensors of %s on the host: codec %s needs %d MiB of scratch there "
                          "beside its batches, and %d MiB can be had", b.device, policy, scratch >> 20, b.nbytes >> 20)
        budgets = [gpu.Budget(b.device, b.nbytes - scratch) for b in budgets if b.device not in host]
        count = lanes(budgets, batch_cap)
        tight = {b.device for b in budgets if count == 1 and b.nbytes // SAVE_WORKING_SETS < batch_cap}
        sets = {b.device: OVERLAP_WORKING_SETS if b.device in tight else SAVE_WORKING_SETS for b in budgets}
        batch = {b.device: b.batch_bytes(sets[b.device], batch_cap) for b in budgets}
        largest = {b.device: batch[b.device] if b.device in tight else b.nbytes // SAVE_WORKING_SETS for b in budgets}
        overlap = frozenset(b.device for b in budgets if count == 1 and (
            b.device in tight or b.nbytes >= OVERLAP_WORKING_SETS * batch[b.device]))
        return cls(batch, largest, {b.device: b.nbytes for b in budgets}, count, host,
                   {device: batch[device] + BLOCK_SLACK for device in tight}, overlap)

    def fits(self, device: torch.device, tensor: torch.Tensor) -> bool:
        return tensor.numel() * tensor.element_size() <= self.largest.get(device, sys.maxsize)

    def policy_on(self, device: torch.device, policy: Policy) -> Policy:
        """``policy`` for the batches of ``device``: with the codecs' small-batch chunk sizes
        where its batches are small (:data:`SMALL_BATCH_BYTES`)."""
        small = self.batch.get(device, sys.maxsize) <= SMALL_BATCH_BYTES
        return dataclasses.replace(policy, small_batches=True) if small else policy


def lanes(budgets: list[gpu.Budget], batch_cap: int) -> int:
    """GPU batches a save codes at once: two where every GPU's budget holds
    ``TWO_LANE_WORKING_SETS`` batches of a save's full size (and of ``batch_cap``), else one."""
    full = max(batch_cap, SAVE_BATCH_BYTES["cuda"])
    ample = bool(budgets) and all(b.nbytes >= TWO_LANE_WORKING_SETS * full for b in budgets)
    return 2 if ample else 1


def gpu_coded(tensors: list[torch.Tensor], policy: Policy, limits: GpuLimits | None = None) -> list[bool]:
    """Which of ``tensors`` a save codes on a GPU (the others: on the host)."""
    return [key.backend == "cuda" for key in _keys(tensors, policy, limits)]


def save_batches(tensors: list[torch.Tensor], policy: Policy, limits: GpuLimits | None = None
                 ) -> list[tuple[BatchKey, list[int]]]:
    """Tensors encoded alike, in table order within a batch, in batches of about ``SAVE_BATCH_BYTES``
    of their backend (on a GPU, what ``limits`` allow; a tensor coded in ranges alone; batches
    of blocks packed first fit, :data:`OPEN_BATCHES`). Tensors of other backends in between (an
    optimizer's CPU step counters among CUDA moments) do not cut a batch; the file holds batches
    in the order they fill."""
    keys = _keys(tensors, policy, limits)
    on_gpu = None if limits is None else limits.batch
    sizes = {key: _limit(key, batch_bytes(key.device, SAVE_BATCH_BYTES, on_gpu), limits) for key in set(keys)}
    nbytes = [t.numel() * t.element_size() for t in tensors]
    return [(keys[idx[0]], idx) for idx in packed(range(len(tensors)), nbytes, keys, sizes, open_groups=OPEN_BATCHES)]


def _limit(key: BatchKey, nbytes: int, limits: GpuLimits | None) -> Limit:
    """Where a batch of ``key`` is cut: alone (ranges), within ``nbytes`` where its buffers are
    blocks of one size, else once it holds ``nbytes``."""
    if key.parts:
        return Limit(fill=0)
    if limits is not None and key.device in limits.block:
        return Limit(within=nbytes)
    return Limit(fill=nbytes)


# A load's batches: about this many decoded bytes each. A CPU batch costs the same Python whatever
# its size: 16 MiB keeps that small beside its decode, and larger batches are no faster on many
# cores (results: "CPU path and the GDeflate decoder").
LOAD_BATCH_BYTES = {"cuda": 512 << 20, "cpu": 16 << 20}
MIN_CPU_BATCH_BYTES = 1 << 20  # a smaller batch's per-batch Python would cost more than its bytes


def decode_backend(entry: TensorEntry, device: torch.device) -> str:
    """Decode on the GPU when the target is a GPU, or a codec is best decoded there, and a GPU can run it."""
    ids = set(entry.codecs)
    if all(has_codec(i, "cuda") for i in ids) and (device.type == "cuda" or ids & gpu_first_ids()):
        return "cuda"
    return "cpu"


def cpu_batch_bytes(total: int, workers: int) -> int:
    """Decoded bytes per CPU batch of a load with ``total`` bytes to decode on the CPU: split evenly
    into a multiple of ``workers`` batches of at most ``LOAD_BATCH_BYTES["cpu"]``, so each worker thread
    gets the same bytes however many cores there are; at least ``MIN_CPU_BATCH_BYTES``."""
    cap = LOAD_BATCH_BYTES["cpu"]
    batches = workers * max(1, -(-total // (workers * cap)))
    return min(cap, max(MIN_CPU_BATCH_BYTES, -(-total // batches)))


def load_batches(entries: list[TensorEntry], works: list[torch.device],
                 gpu_batch: Mapping[torch.device, int] | None = None, cpu_batch: int | None = None
                 ) -> list[tuple[str, torch.device, list[int]]]:
    """Tensors decoded alike (where each is decoded: ``works``), in file order, about
    ``LOAD_BATCH_BYTES`` decoded each (on a GPU, ``gpu_batch`` where given; on the CPU, ``cpu_batch``,
    which a batch exceeds only with a tensor larger than it); a batch's stored bytes are one range
    of the file wherever the writer kept them so."""
    first = [e.streams[0].chunks[0].offset if e.streams and e.streams[0].chunks else -1 for e in entries]
    defaults = {**LOAD_BATCH_BYTES, "cpu": cpu_batch or LOAD_BATCH_BYTES["cpu"]}
    size = {w: batch_bytes(w, defaults, gpu_batch) for w in set(works)}
    limits = {w: Limit(within=n if w.type == "cpu" else None, fill=n) for w, n in size.items()}
    nbytes = [max(e.compressed_nbytes, e.nbytes) for e in entries]  # bounds the decode buffers too
    order = sorted(range(len(entries)), key=first.__getitem__)
    return [(works[idx[0]].type, works[idx[0]], idx) for idx in packed(order, nbytes, works, limits)]
