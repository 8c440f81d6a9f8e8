"""Snapshots a manager takes in ``save``, so the caller may change its state at once: which kind
each save takes, and its write in the worker. How each kind is staged is :mod:`ckptzip.staging`'s.

A snapshot is one of two kinds, chosen per save (:meth:`SnapshotPool.take`):

- a *device* snapshot copies the CUDA tensors into reused buffers of their GPU (the caller's
  stream waits for the copy, not its thread); the background write codes them there;
- a *host* snapshot codes the CUDA tensors on their GPU in bounded batches and keeps only their
  stored bytes, in pinned host memory, while a share of them crosses the link raw at the same time,
  to be coded on the host when the snapshot is written. Its *read* of the state (the coding and
  the copies) runs in the caller, or, where ckptzip can see every writer of the tensors it reads
  (:mod:`ckptzip.engine.guard`), on a thread of its own while the next forward and backward run
  (:mod:`ckptzip.staging.reading`): the optimizer's next step waits for it.

Whatever holds GPU memory while training runs (a device snapshot's buffers, its coding in the
background, a read that overlaps training) is sized from what the training leaves unused at its
peak (:func:`~ckptzip.memory.gpu.beside_training`), never from what is free between two steps.
Host memory likewise: a snapshot that would take more of it than the host can give (every
training process of the host as much, with a margin left) is not taken, and the manager writes
that checkpoint before ``save`` returns, in bounded memory, as a synchronous save does.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO, Literal

import torch

from ..engine import (
    DeltaBase,
    Policy,
    SaveOptions,
    optimizer_owned,
    optimizer_stepped,
    optimizer_storages,
    watch_optimizer_steps,
)
from ..errors import GpuMemoryError
from ..format import TensorEntry
from ..memory import gpu
from ..memory.host import host_available
from ..staging import (
    HOST_RAW_SHARE,
    OVERLAP_RAW_SHARE,
    CopiedState,
    HostPlan,
    HostSnapshots,
    HostStaged,
    Overlap,
    Reading,
    SnapshotBuffers,
    Staged,
    copy_state,
)
from ..staging.buffers import BufferKey, aligned
from ..tree import flatten
from ._coding import CodingProcess, local_ranks

SnapshotMode = Literal["auto", "device", "host"]
TakenMode = Literal["device", "host", "direct"]  # "direct": none taken, written before save returns
# GPU memory beside training that a read overlapping training needs at least for its batches, and
# a device snapshot's coding beside its copy (its batches are larger, and slow batches would slow
# the write that the next save waits for); below them a snapshot is a host one, read in the caller.
READ_MIN_BYTES = 1 << 30
DEVICE_CODING_MIN_BYTES = 2 << 30
# The share of the host's available memory snapshots leave unused (the training's own host memory
# grows too: data loaders, the next batch); a share, so that a small state on a small machine fits
HOST_MARGIN = 0.2
_GIB = 1 << 30
_LOG = logging.getLogger("ckptzip")


@dataclass
class Snapshot:
    tree: Any  # the state flattened by ckptzip.tree, referring to ``tensors`` by position
    names: list[str]
    tensors: list[torch.Tensor]  # copies of the state's tensors, or placeholders of staged ones
    buffers: list[tuple[BufferKey, torch.Tensor]]  # the pooled buffers the copies lie in
    staged: Staged | Reading[HostStaged]  # what is written, or the read that gives it (ckptzip.staging)
    copied: bool  # whether ``tensors`` holds a copy of every tensor (the base of an incremental save)
    caps: dict[torch.device, int] | None  # GPU memory its background coding may hold (device snapshots)


@dataclass
class Written:
    """What a save wrote: its tensor table, and its tensors by name (None where they were staged)."""

    entries: list[TensorEntry]
    tensors: dict[str, torch.Tensor] | None


Write = Callable[[BinaryIO, "DeltaBase | None"], Written]


@dataclass(frozen=True)
class _Choice:
    """What a snapshot is: a host one or not, why, the GPU memory a device snapshot's coding
    beside training may hold per GPU, and a host snapshot's read that overlaps training (None:
    read in the caller)."""

    host: bool
    reason: str
    caps: dict[torch.device, int] | None = None
    overlap: Overlap | None = None


class SnapshotPool:
    """Takes snapshots of states, so the caller may mutate the originals at once: chooses the
    strategy of each (:mod:`ckptzip.staging`), plans it once, and writes it in the worker.

    ``"device"``: device snapshots. ``"host"``: host snapshots. ``"auto"``: a device snapshot
    where, on every GPU, its copy and its coding fit in what the training leaves unused at its
    peak, once an optimizer step has shown that peak; else a host one. ``overlap``: whether a host
    snapshot may read what optimizers own while training goes on. Buffers return to the pool after
    the save that used them.
    """

    def __init__(self, where: SnapshotMode, policy: Policy, gpu_memory: int | None = None,
                 overlap: bool = True, coding_process: bool = False) -> None:
        self._where = where
        self._options = SaveOptions(policy, gpu_memory=gpu_memory)
        self._overlap = overlap
        self.last_mode: TakenMode | None = None
        self.last_reason: str | None = None
        self.last_overlapped = False
        # where a process codes, host memory it reads is shared memory (handed over without a copy)
        self._coder = CodingProcess() if coding_process else None
        self._buffers = SnapshotBuffers(shared=coding_process)
        self._host = HostSnapshots(self._buffers, self._options, shared=coding_process)
        self._staging = self._host.pool
        self._reserving: threading.Thread | None = None  # reserve_host's, until a snapshot waited for it
        watch_optimizer_steps()  # an optimizer's step shows the training's peak, and waits for reads that overlap it

    # ------------------------------------------------------------------------- the choice

    def _choose(self, sources: list[torch.Tensor]) -> _Choice:
        """Device or host snapshot, from what the training leaves unused at its peak on each GPU,
        measured before this snapshot allocates anything (the device buffers the pool holds are
        ckptzip's, not the training's: a device snapshot reuses them, a host one gives them back)."""
        need: dict[torch.device, int] = collections.defaultdict(int)
        for t in sources:
            if t.is_cuda:
                need[t.device] += aligned(t.nbytes)
        if not need:
            return _Choice(self._where == "host", "the state holds no CUDA tensor")
        room = {d: gpu.beside_training(d) + self._buffers.pooled(d) for d in need}
        if self._where == "device" or (self._where == "auto" and optimizer_stepped()):
            short = [d for d in need if need[d] + DEVICE_CODING_MIN_BYTES > room[d]]
            if not short:
                why = ("snapshot='device' was asked for" if self._where == "device" else
                       "a device copy of the state and its coding fit beside the training's peak")
                return _Choice(False, why, {d: room[d] - need[d] for d in need})
            d = short[0]
            reason = (f"a device copy of the state needs {need[d] / _GIB:.2f} GiB on {d} and its coding "
                      f"{DEVICE_CODING_MIN_BYTES / _GIB:.2f} GiB, but the training leaves {room[d] / _GIB:.2f} GiB "
                      "unused there at its peak")
            if self._where == "device":
                reason = "snapshot='device' was asked for, but " + reason
        elif self._where == "host":
            reason = "snapshot='host' was asked for"
        else:
            reason = ("no optimizer has stepped since the manager was made, so the training's peak GPU memory is not "
                      "known yet")
        return self._read_later(sources, room, reason)

    def _read_later(self, sources: list[torch.Tensor], room: dict[torch.device, int], reason: str) -> _Choice:
        """A host snapshot; read while training goes on where ckptzip sees every writer of what it
        reads later (tensors the optimizers seen stepping own: the others are copied on their
        GPU first) and the GPUs have room for that beside the training's peak."""
        if not self._overlap or not optimizer_stepped():
            return _Choice(True, reason)
        storages = optimizer_storages()
        later = frozenset(i for i, t in enumerate(sources) if t.is_cuda and optimizer_owned(t, storages))
        copies: dict[torch.device, int] = collections.defaultdict(int)
        for i, t in enumerate(sources):
            if t.is_cuda and i not in later:
                copies[t.device] += aligned(t.nbytes)
        caps = {d: n - copies[d] for d, n in room.items()}
        if not later or any(n < READ_MIN_BYTES for n in caps.values()):
            return _Choice(True, reason)
        return _Choice(True, reason, overlap=Overlap(caps, later))

    def _plan(self, sources: list[torch.Tensor], overlap: Overlap | None, overlapped: bool, keep: bool) -> HostPlan:
        """A host snapshot's plan (``overlapped``: whether its read overlaps training, which
        copies more of it raw where a process codes it)."""
        share = OVERLAP_RAW_SHARE if overlapped and self._coder is not None else HOST_RAW_SHARE
        return HostPlan.of(sources, self._options.policy, self._options.gpu_memory, overlap, share, keep)

    def _host_held(self) -> int:
        """Host memory the pools hold already, which a snapshot reuses."""
        return self._buffers.pooled_host() + self._staging.reserved

    def _host_short(self, nbytes: int) -> str | None:
        """Why taking ``nbytes`` more of host memory than the pools hold could run the host out of
        it (each training process of the host taking as much, as ranks do at the same step), or
        None where it fits or where the host's memory cannot be read."""
        need = nbytes - self._host_held()
        if need <= 0:  # the pools hold it (every save after the first, as a rule): nothing to read
            return None
        available = host_available()
        if available is None:
            return None
        ranks = local_ranks()
        keep = int(available * HOST_MARGIN)
        if need * ranks + keep <= available:
            return None
        each = f" (and each of the {ranks} training processes of this host as much)" if ranks > 1 else ""
        return (f"a snapshot of the state needs {need / _GIB:.2f} GiB more host memory{each}, but the host has "
                f"{available / _GIB:.2f} GiB available, of which {keep / _GIB:.2f} GiB are left to the training")

    @staticmethod
    def _host_bytes(sources: list[torch.Tensor], choice: _Choice, keep: bool) -> int:
        """Host memory a snapshot of ``sources`` takes at most: copies of the host tensors, and for a
        host one the CUDA tensors' bytes too (raw or coded), twice with ``keep`` (the next save's base)."""
        host = sum(aligned(t.nbytes) for t in sources if not t.is_cuda)
        if not choice.host:
            return host
        return host + sum(aligned(t.nbytes) for t in sources if t.is_cuda) * (2 if keep else 1)

    def reserve_host(self, sources: list[torch.Tensor]) -> threading.Thread | None:
        """Where host snapshots are (or now would be) taken, reserve pinned staging for the GPU
        bytes of ``sources`` on a background thread (a save's staging waits for it)."""
        choice = self._choose(sources)
        if not choice.host:
            return None
        try:
            plan = self._plan(sources, choice.overlap, self._overlap, False)  # a read overlapping training, as a rule
            coded, pinned = plan.coded, plan.pinned_bytes(sources)
        except GpuMemoryError:  # no room to plan with now: reserve for coding it all, the save will say why
            coded, pinned = [t.is_cuda for t in sources], 0
        nbytes = self._host.expected() or sum(t.nbytes for t, c in zip(sources, coded) if c)
        if not nbytes and not pinned and self._coder is None:
            return None
        short = self._host_short(nbytes + pinned)
        if short is not None:  # the saves will say what they do instead
            _LOG.warning("ckptzip: prepare() reserves no host memory: %s", short)
            return None

        def reserve() -> None:
            began = time.perf_counter()
            try:
                self._host.reserve(nbytes, pinned)
            except (OSError, RuntimeError) as exc:  # host memory short now: the first snapshot reserves what it needs
                _LOG.warning("ckptzip: prepare() could not reserve %.2f GiB of pinned host memory; the first host "
                             "snapshot will: %s", (nbytes + pinned) / _GIB, exc)
            else:
                _LOG.debug("ckptzip: prepare() reserved %.2f GiB of pinned host memory in %.2f s",
                           (nbytes + pinned) / _GIB, time.perf_counter() - began)
            if self._coder is not None:
                self._coder.start()

        thread = threading.Thread(target=reserve, name="ckptzip-reserve", daemon=True)
        thread.start()
        self._reserving = thread
        return thread

    def _reserved(self) -> None:
        """Wait for :meth:`reserve_host`'s thread, if one runs."""
        if self._reserving is not None:
            self._reserving.join()
            self._reserving = None

    # ------------------------------------------------------------------------- taking

    def take(self, state: Any, base: DeltaBase | None, keep: bool) -> Snapshot | None:
        """Validate ``state`` (raises :class:`~ckptzip.errors.UnsupportedObjectError`) and snapshot
        it. A host snapshot rewrites its table against ``base`` as it reads the state; with
        ``keep`` it also copies the CUDA tensors it encodes to host memory, as the next save's base.
        None, having taken nothing, where the snapshot would take more host memory than the host
        can give (:attr:`last_mode` ``"direct"``): the caller writes the state itself."""
        flat = flatten(state)  # also a deep copy of every non-tensor value
        names = [item.name for item in flat.tensors]
        sources = [item.tensor for item in flat.tensors]
        choice = self._choose(sources)
        if choice.host:
            self._reserved()  # its buffers, not a second set beside them (and the check counts them)
        short = self._host_short(self._host_bytes(sources, choice, keep))
        if short is not None:
            if self.last_mode != "direct":
                _LOG.warning("ckptzip: writing checkpoints before save returns, without a snapshot: %s", short)
            self.last_mode, self.last_reason, self.last_overlapped = "direct", short, False
            return None
        if choice.host and self._where == "auto" and self.last_mode != "host":
            _LOG.warning("ckptzip: taking host snapshots (compressed on the GPU in small batches, stored in pinned "
                         "host memory) instead of device copies: %s", choice.reason)
        self.last_mode = "host" if choice.host else "device"
        self.last_reason = choice.reason
        self.last_overlapped = choice.overlap is not None
        if not choice.host:
            copied, buffers = copy_state(self._buffers, names, sources, self._options)
            return Snapshot(flat.tree, names, copied.tensors, buffers, copied, True, choice.caps)
        self._buffers.release_device_buffers()
        plan = self._plan(sources, choice.overlap, choice.overlap is not None, keep)
        taken = self._host.take(names, sources, plan, base)
        return Snapshot(flat.tree, names, taken.kept, taken.buffers, taken.staged,
                        keep or isinstance(taken.staged, CopiedState), None)

    # ------------------------------------------------------------------------- writing

    @contextlib.contextmanager
    def use(self, snapshot: Snapshot) -> Iterator[Write]:
        """In the worker: wait for the snapshot's read, then give the body a function that writes
        it as a container (on private CUDA streams, its GPU work within the snapshot's caps;
        coded in the coding process where it has one and the snapshot leaves tensors to code on
        the host); recycle the buffers afterwards."""
        devices = {key[0] for key, _ in snapshot.buffers if key[0].type == "cuda"}
        streams = [self._buffers.stream("write", d) for d in devices]
        staged: Staged | None = None

        def write(f: BinaryIO, base: DeltaBase | None) -> Written:
            assert staged is not None
            kept = dict(zip(snapshot.names, snapshot.tensors)) if snapshot.copied else None
            if (isinstance(staged, HostStaged) and staged.state.rest and staged.state.shared
                    and self._coder is not None and self._coder.usable):
                entries = self._coder.write(f, staged, snapshot.tree)  # coded in the child
                if entries is not None:
                    return Written(entries, kept)
            return Written(staged.write(f, snapshot.tree, base), kept)

        try:
            if isinstance(snapshot.staged, Reading):
                staged = snapshot.staged.result()
                self._host.settle(staged)
            else:
                staged = snapshot.staged
            with contextlib.ExitStack() as stack:
                for stream in streams:
                    stack.enter_context(torch.cuda.stream(stream))
                stack.enter_context(gpu.capped(snapshot.caps))
                yield write
        finally:
            for stream in streams:
                stream.synchronize()  # nothing may still read a buffer when it is handed out again
            if staged is not None:
                staged.release()  # what a failed write left
            if isinstance(staged, HostStaged):
                self._host.trim()
            self._buffers.give_back(snapshot.buffers)

    def clear(self) -> None:
        """Free the pooled buffers; stop the coding process (after a reservation in flight, which
        would otherwise pool buffers and start the process once this returned)."""
        self._reserved()
        self._buffers.clear()
        self._staging.clear()
        if self._coder is not None:
            self._coder.close()
