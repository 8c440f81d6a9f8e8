"""A snapshot's plan, made once when the save is taken and handed to its staging: the GPU limits
its coding works within, which tensors its GPUs code, the share copied raw over the link instead,
and which tensors are copied into which buffers."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..engine import GpuLimits, Policy, gpu_coded
from ..memory import gpu
from .buffers import aligned

# GPU batch of a host snapshot: its encoding needs a few of these beside the state.
HOST_SNAPSHOT_BATCH_BYTES = 256 << 20
# A host snapshot copies this share of the bytes it would code on a GPU raw to pinned host memory
# instead, on a side stream while the GPU codes the rest (the copy engines and the GPU work at
# once), and codes those tensors on the host when the snapshot is written, in the background: the
# share at which the save blocked least, and at which a read overlapping training lost least of it:
# a larger share waits less for the GPU's coding but codes more on the host while training runs
# (results: "Host snapshots and the manager", "Training loop").
HOST_RAW_SHARE = 0.25
# ... and a read overlapping training whose host coding runs in a process of its own copies this
# share: copies take the copy engines, not the training's cores or interpreter lock.
OVERLAP_RAW_SHARE = 1.0


@dataclass(frozen=True)
class Overlap:
    """A host snapshot's read that overlaps training: the GPU memory it may hold per GPU (its
    share of what the training leaves unused at its peak), and the positions of the CUDA tensors
    it reads after ``save`` returns (the others are copied on their GPU first)."""

    caps: dict[torch.device, int]
    later: frozenset[int]


@dataclass(frozen=True)
class HostPlan:
    """What a host snapshot of a state does (:meth:`of`): its GPUs code ``coded`` (by position)
    within ``limits``; ``now``, the host tensors and the CUDA tensors an overlapping read cannot
    wait for, are copied into buffers of their device before ``save`` returns; ``pinned``, the
    CUDA tensors not coded on their GPU (the raw share, and those the limits send to the host)
    and, for a snapshot kept as the next save's base, every CUDA tensor, are copied to pinned
    host memory by the read."""

    limits: GpuLimits
    coded: list[bool]
    now: list[int]
    pinned: list[int]
    overlap: Overlap | None

    @classmethod
    def of(cls, sources: list[torch.Tensor], policy: Policy, gpu_memory: int | None, overlap: Overlap | None,
           share: float, keep: bool) -> HostPlan:
        """The plan of a host snapshot of ``sources`` read in the caller, or (``overlap``) while
        training goes on, within its caps; ``share``: of the bytes its GPUs would code, what is
        copied raw instead (:func:`raw_share`); ``keep``: whether its CUDA tensors are kept on the
        host, as the next save's base."""
        with gpu.capped(None if overlap is None else overlap.caps):
            limits = GpuLimits.of(sources, policy, gpu_memory, HOST_SNAPSHOT_BATCH_BYTES)
        on_gpu = gpu_coded(sources, policy, limits)
        cuda = [i for i, t in enumerate(sources) if t.is_cuda]
        raw = raw_share([t.nbytes for t in sources], [i for i in cuda if on_gpu[i]], share)
        coded = [c and i not in raw for i, c in enumerate(on_gpu)]
        later = frozenset() if overlap is None else overlap.later
        now = [i for i, t in enumerate(sources) if not t.is_cuda or (later and i not in later)]
        return cls(limits, coded, now, [i for i in cuda if keep or not coded[i]], overlap)

    def pinned_bytes(self, sources: list[torch.Tensor]) -> int:
        """Bytes of the pinned buffer the read copies into, as :meth:`~.buffers.SnapshotBuffers.views` lays it out."""
        return sum(aligned(sources[i].nbytes) for i in self.pinned)


@dataclass(frozen=True)
class CodedPlan:
    """What a stager's staging of a state does (:meth:`of`): its GPUs code ``coded`` (by
    position) within ``limits``, in a save's batches; every other tensor is copied to the host
    before the staging returns."""

    limits: GpuLimits
    coded: list[bool]

    @classmethod
    def of(cls, tensors: list[torch.Tensor], policy: Policy, gpu_memory: int | None) -> CodedPlan:
        limits = GpuLimits.of(tensors, policy, gpu_memory)
        return cls(limits, gpu_coded(tensors, policy, limits))


def raw_share(nbytes: list[int], candidates: list[int], share: float) -> set[int]:
    """Which of ``candidates`` (positions of tensors a host snapshot would code on a GPU, whose
    sizes ``nbytes`` gives by position) it copies raw instead: the last ones of the table, up to
    ``share`` of the candidates' bytes (a tensor that would overshoot it by more than a tenth is
    passed over for smaller ones before it)."""
    goal = share * sum(nbytes[i] for i in candidates)
    chosen: set[int] = set()
    total = 0
    for i in reversed(candidates):
        if total + nbytes[i] <= 1.1 * goal:
            chosen.add(i)
            total += nbytes[i]
        if total >= goal:
            break
    return chosen
