"""Host staging: a state's CUDA tensors coded on their GPUs now, their stored bytes staged in
pinned host memory, the container written later (:class:`HostStaged`). Two strategies take it:

- a manager's host snapshot (:class:`HostSnapshots`), whose raw share and base copies cross the
  link while the GPU codes the rest, read in the caller or, deferred, on a thread of its own
  while training goes on (:class:`~.reading.Reading`);
- a stager's (DCP's, torch_checkpointing's: :func:`stage_coded`), which copies every tensor its
  GPUs do not code to the host before it returns.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, BinaryIO

import torch

from ..engine import DeltaBase, Policy, SaveOptions, StagedState, stage_table, staged_table, write_staged
from ..format import TensorEntry
from ..memory.pinned import PinnedPool
from ..memory.shared import shared_copy
from .buffers import HOST_PINNED, BufferKey, SnapshotBuffers, ordered
from .copied import CopiedState
from .copies import Copied
from .plan import CodedPlan, HostPlan
from .reading import Reading

# Host snapshots' pinned staging is kept at this much above the buffers the last snapshot occupied
# (a pool smaller than that grows again, buffer by buffer, while a save blocks): batches fill the
# buffers back to back, so the next snapshot of the same state occupies as many.
STAGING_MARGIN = 1.02
# Host snapshots stage their batches' stored bytes in buffers of this size, back to back (only the
# snapshot's last buffer is partly used).
STAGING_BUFFER_BYTES = 16 << 20
# ... registered in slabs of at most this size: the pool holds up to a slab more than the margin asks
# (the first snapshot's pool grows by slabs, one after ``prepare()`` shrinks by slabs).
STAGING_SLAB_BYTES = 256 << 20


@dataclass
class HostStaged:
    """A state staged on the host (a :class:`~ckptzip.staging.Staged`): the engine's staging
    (its table rewritten against the base when it was staged), the policy its host tensors are
    coded with when it is written, and the events after the copies to the host it reads."""

    state: StagedState
    policy: Policy
    copied: list[torch.cuda.Event] = field(default_factory=list)

    def _copies_done(self) -> None:
        for event in self.copied:
            event.synchronize()

    def wait(self) -> None:
        self._copies_done()
        self.state.wait()

    def write(self, f: BinaryIO, tree: Any, base: DeltaBase | None = None) -> list[TensorEntry]:
        self._copies_done()
        return write_staged(f, self.state, tree, self.policy)

    def release(self) -> None:
        self._copies_done()  # nothing may still write into the buffers it gives back
        self.state.release()

    def portable(self) -> HostStaged:
        """This staging as another process can take it (:meth:`~ckptzip.engine.StagedState.portable`)."""
        self._copies_done()
        return HostStaged(self.state.portable(), self.policy)


def stage_coded(names: list[str], tensors: list[torch.Tensor], policy: Policy, pool: PinnedPool,
                gpu_memory: int | None = None, *, shared: bool = False) -> HostStaged:
    """A stager's snapshot of a state's tensors, so the caller may change them once this returns:
    those its GPUs code are coded there now, in a save's batches; every other tensor (a host
    tensor, or one the GPU cannot code: no nvCOMP, or over its budget) is copied to the host now,
    into shared memory where ``shared``, and coded when it is written."""
    plan = CodedPlan.of(tensors, policy, gpu_memory)
    copied = [t if coded else shared_copy(t) if shared else t.to("cpu", copy=True)
              for t, coded in zip(tensors, plan.coded)]
    return HostStaged(stage_table(staged_table(names, copied, None), policy, plan.limits, pool), policy)


@dataclass
class Taken:
    """A host snapshot as ``save`` leaves it: the state's copies it keeps (by position: the host
    tensors, and the CUDA tensors copied to the host; placeholders elsewhere), the buffers they
    lie in, and its staging, or the read that will give it."""

    kept: list[torch.Tensor]
    buffers: list[tuple[BufferKey, torch.Tensor]]
    staged: HostStaged | Reading[HostStaged] | CopiedState


class HostSnapshots:
    """A manager's host snapshots, from their plan (:class:`~.plan.HostPlan`): the stored bytes in
    a pinned pool of their own, kept from save to save at :data:`STAGING_MARGIN` above what the
    last one occupied; the copies in ``buffers``; ``options``: the policy and the GPU memory cap.
    ``shared``: host memory in shared memory."""

    def __init__(self, buffers: SnapshotBuffers, options: SaveOptions, shared: bool) -> None:
        self._buffers = buffers
        self._options = options
        self.pool = PinnedPool(STAGING_BUFFER_BYTES, count=sys.maxsize, slab_bytes=STAGING_SLAB_BYTES, shared=shared)
        self._staged_bytes: int | None = None  # staging buffers the last host snapshot occupied

    def expected(self) -> int | None:
        """Pinned staging the next host snapshot needs: the buffers the last one occupied and a
        margin (None before the first)."""
        return None if self._staged_bytes is None else int(self._staged_bytes * STAGING_MARGIN)

    def reserve(self, staging: int, pinned: int) -> None:
        """Reserve ``staging`` bytes of the pool and a pooled pinned buffer of ``pinned`` bytes,
        while training runs (paced: :class:`~ckptzip.memory.pinned.Slab`)."""
        self.pool.reserve(staging, paced=True)
        if pinned:
            self._buffers.give_back([(HOST_PINNED, self._buffers.acquire(HOST_PINNED, pinned, paced=True))])

    def take(self, names: list[str], sources: list[torch.Tensor], plan: HostPlan, base: DeltaBase | None) -> Taken:
        """Stage ``sources`` as ``plan`` says, its table rewritten against ``base``: now, or where
        the plan overlaps training, by a read on a thread of its own."""
        now = {i: (sources[i].device, False) for i in plan.now}
        copies, buffers = self._buffers.views(sources, now)
        host, host_buffers = self._buffers.views(sources, dict.fromkeys(plan.pinned, HOST_PINNED))
        ready = self._buffers.copied_now(sources, copies, plan.now)
        read_from = [copies[i] if i in now else sources[i] for i in range(len(sources))]
        kept = [host[i] if i in plan.pinned else copies[i] if i in now and not sources[i].is_cuda else torch.empty(0)
                for i in range(len(sources))]
        cuda = [i for i, t in enumerate(sources) if t.is_cuda]
        if not cuda:  # nothing to code on a GPU: the copies are the snapshot
            return Taken(kept, buffers, CopiedState(names, kept, ready, self._options))
        policy = self._options.policy

        def read() -> HostStaged:
            table = staged_table(names, read_from, base, {i: host[i] for i in cuda if not plan.coded[i]})
            # queued after the table's rewrite, whose small reads would wait behind them
            copying: list[Callable[[], Copied]] = []
            try:
                copying = self._buffers.copy([read_from[i] for i in plan.pinned], [host[i] for i in plan.pinned],
                                             "read-copy")
                state = stage_table(table, policy, plan.limits, self.pool, self.expected())
            finally:
                copied = ordered([finish() for finish in copying])
            return HostStaged(state, policy, ready + copied)

        if plan.overlap is not None:
            devices = {sources[i].device for i in cuda}
            reading = Reading(read, {d: self._buffers.stream("read", d) for d in devices}, plan.overlap.caps)
            return Taken(kept, buffers + host_buffers, reading)
        staged = read()
        self.settle(staged)
        return Taken(kept, buffers + host_buffers, staged)

    def settle(self, staged: HostStaged) -> None:
        """Remember what ``staged`` occupies of the pool (the next snapshot expects as much)."""
        self._staged_bytes = staged.state.occupied_bytes

    def trim(self) -> None:
        """After a write: keep the pool at what the next snapshot is expected to need."""
        expected = self.expected()
        if expected is not None:  # the first snapshot reserved the raw size: keep what is used
            self.pool.trim(expected)

