"""Snapshots a manager takes in ``save``, so the caller may change its state at once.

A snapshot is one of two kinds, chosen per save (:meth:`SnapshotPool.take`):

- a *device* snapshot copies the CUDA tensors into reused buffers of their GPU (the caller's
  stream waits for the copy, not its thread); the background write codes them there;
- a *host* snapshot codes the CUDA tensors on their GPU in bounded batches and keeps only their
  stored bytes, in pinned host memory, while a share of them crosses the link raw at the same time,
  to be coded on the host when the snapshot is written. Its *read* of the state (the coding and
  the copies) runs in the caller, or, where ckptzip can see every writer of the tensors it reads
  (:mod:`ckptzip.engine.guard`), on a thread of its own while the next forward and backward run
  (:mod:`._reading`): the optimizer's next step waits for it.

Whatever holds GPU memory while training runs (a device snapshot's buffers, its coding in the
background, a read that overlaps training) is sized from what the training leaves unused at its
peak (:func:`~ckptzip.memory.gpu.beside_training`), never from what is free between two steps.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO, Literal

import torch

from ..engine import (
    DeltaBase,
    GpuLimits,
    HostCopies,
    Policy,
    SaveOptions,
    StagedState,
    gpu_coded,
    optimizer_owned,
    optimizer_stepped,
    optimizer_storages,
    stage_state,
    watch_optimizer_steps,
    write_staged,
    write_state,
)
from ..errors import CheckpointWriteError, GpuMemoryError
from ..format import TensorEntry
from ..memory import gpu
from ..memory.pinned import PinnedPool, Slab
from ..memory.shared import shared_empty
from ..tree import flatten
from ._coding import CodingProcess
from ._copies import Copied, Trickle, copy_batched, queued
from ._reading import Reading

_ALIGN = 256  # byte alignment of each tensor inside a snapshot buffer

_BufferKey = tuple[torch.device, bool]  # (device, pinned)
SnapshotMode = Literal["auto", "device", "host"]
# GPU memory beside training that a read overlapping training needs at least for its batches, and
# a device snapshot's coding beside its copy (its batches are larger, and slow batches would slow
# the write that the next save waits for); below them a snapshot is a host one, read in the caller.
READ_MIN_BYTES = 1 << 30
DEVICE_CODING_MIN_BYTES = 2 << 30
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
_GIB = 1 << 30
_LOG = logging.getLogger("ckptzip")


@dataclass
class Snapshot:
    tree: Any  # the state flattened by ckptzip.tree, referring to ``tensors`` by position
    names: list[str]
    tensors: list[torch.Tensor]  # copies of the state's tensors (views into ``buffers``), or placeholders of staged ones
    buffers: list[tuple[_BufferKey, torch.Tensor]]
    ready: list[torch.cuda.Event]  # recorded after the GPU copies; empty when all copies were synchronous
    staged: Reading[_Read] | StagedState | None  # the table, its CUDA tensors encoded, stored bytes in pinned memory
    copied: bool  # whether ``tensors`` holds a copy of every tensor (the base of an incremental save)
    caps: dict[torch.device, int] | None  # GPU memory its background coding may hold (device snapshots)


@dataclass
class _Read:
    """What a host snapshot's read of the state leaves: the staged state, and the events after its
    copies to the host (which the write codes there)."""

    staged: StagedState
    copied: list[torch.cuda.Event]


@dataclass
class Written:
    """What a save wrote: its tensor table, and its tensors by name (None where they were staged)."""

    entries: list[TensorEntry]
    tensors: dict[str, torch.Tensor] | None


Write = Callable[[BinaryIO, "DeltaBase | None"], Written]


@dataclass(frozen=True)
class _Choice:
    """What a snapshot is: a host one or not, why, the GPU memory its work beside training may
    hold per GPU (None: all its GPU work runs in the caller), and the positions of the CUDA
    tensors it reads after ``take`` returns."""

    host: bool
    reason: str
    caps: dict[torch.device, int] | None = None
    later: frozenset[int] = frozenset()


class SnapshotPool:
    """Takes snapshots of states, so the caller may mutate the originals at once.

    ``"device"``: device snapshots. ``"host"``: host snapshots. ``"auto"``: a device snapshot
    where, on every GPU, its copy and its coding fit in what the training leaves unused at its
    peak, once an optimizer step has shown that peak; else a host one. ``overlap``: whether a host
    snapshot may read what optimizers own while training goes on. Buffers return to the pool after
    the save that used them.
    """

    def __init__(self, where: SnapshotMode, policy: Policy, gpu_memory: int | None = None,
                 overlap: bool = True, coding_process: bool = False) -> None:
        self._where = where
        self._policy = policy
        self._gpu_memory = gpu_memory
        self._overlap = overlap
        self.last_mode: Literal["device", "host"] | None = None
        self.last_reason: str | None = None
        self.last_overlapped = False
        self._free: dict[_BufferKey, list[torch.Tensor]] = {}
        self._slabs: dict[int, Slab] = {}  # registered host memory of the pinned buffers, by address
        # where a process codes, host memory it reads is shared memory (handed over without a copy)
        self._coder = CodingProcess() if coding_process else None
        self._staging = PinnedPool(STAGING_BUFFER_BYTES, count=sys.maxsize, slab_bytes=STAGING_SLAB_BYTES,
                                   shared=coding_process)
        self._staged_bytes: int | None = None  # staging buffers the last host snapshot occupied
        self._reserving: threading.Thread | None = None  # reserve_host's, until a snapshot waited for it
        self._lock = threading.Lock()
        # streams by role and device: the caller's copies, the background reads, the worker's writes
        self._streams: dict[tuple[str, torch.device], torch.cuda.Stream] = {}
        watch_optimizer_steps()  # an optimizer's step shows the training's peak, and waits for reads that overlap it

    def _stream(self, role: str, device: torch.device) -> torch.cuda.Stream:
        stream = self._streams.get((role, device))
        if stream is None:
            stream = self._streams[role, device] = torch.cuda.Stream(device)
        return stream

    def _acquire(self, key: _BufferKey, nbytes: int) -> torch.Tensor:
        with self._lock:
            free = self._free.setdefault(key, [])
            for i, buf in enumerate(free):
                if buf.numel() >= nbytes:
                    return free.pop(i)
            for buf in free:  # all too small for this state: let them go before allocating
                self._slabs.pop(buf.data_ptr(), None)
            free.clear()
        device, pinned = key
        if not pinned:
            if device.type == "cpu" and self._coder is not None:
                with contextlib.suppress(CheckpointWriteError):  # no room in shared memory: the write copies it
                    return shared_empty(nbytes)
            return torch.empty(nbytes, dtype=torch.uint8, device=device)
        # registered pageable memory: torch's pinned allocator would round tens of GB up to a power of two
        try:
            slab = Slab(nbytes, shared=self._coder is not None)  # shared where shared memory has room
        except RuntimeError as exc:  # the driver refuses to register it: pageable memory, slower copies
            _LOG.warning("ckptzip: snapshot buffers in pageable host memory (copies to them are slower): %s", exc)
            return torch.empty(nbytes, dtype=torch.uint8)
        with self._lock:
            self._slabs[slab.memory.data_ptr()] = slab
        return slab.memory

    def _pooled(self, device: torch.device) -> int:
        """Bytes of the device buffers the pool holds for ``device``."""
        with self._lock:
            return sum(b.numel() for b in self._free.get((device, False), []))

    def _release_device_buffers(self) -> None:
        """Give the pooled device buffers back to torch's cache (a host snapshot needs none), where
        the training takes them again."""
        with self._lock:
            for key in [k for k in self._free if k[0].type == "cuda"]:
                del self._free[key]

    # ------------------------------------------------------------------------- the choice

    def _choose(self, sources: list[torch.Tensor]) -> _Choice:
        """Device or host snapshot, from what the training leaves unused at its peak on each GPU,
        measured before this snapshot allocates anything (the device buffers the pool holds are
        ckptzip's, not the training's: a device snapshot reuses them, a host one gives them back)."""
        need: dict[torch.device, int] = collections.defaultdict(int)
        for t in sources:
            if t.is_cuda:
                need[t.device] += _aligned(t.nbytes)
        if not need:
            return _Choice(self._where == "host", "the state holds no CUDA tensor")
        room = {d: gpu.beside_training(d) + self._pooled(d) for d in need}
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
                copies[t.device] += _aligned(t.nbytes)
        caps = {d: n - copies[d] for d, n in room.items()}
        if not later or any(n < READ_MIN_BYTES for n in caps.values()):
            return _Choice(True, reason)
        return _Choice(True, reason, caps, later)

    def reserve_host(self, sources: list[torch.Tensor]) -> threading.Thread | None:
        """Where host snapshots are (or now would be) taken, reserve pinned staging for the GPU
        bytes of ``sources`` on a background thread (a save's staging waits for it)."""
        choice = self._choose(sources)
        if not choice.host:
            return None
        try:
            coded = self._host_plan(sources, choice.caps, self._overlap)  # a read overlapping training, as a rule
        except GpuMemoryError:  # no room to plan with now: reserve for coding it all, the save will say why
            coded = [t.is_cuda for t in sources]
        nbytes = self._expected_staging() or sum(t.nbytes for t, c in zip(sources, coded) if c)
        copies = sum(_aligned(t.nbytes) for t, c in zip(sources, coded) if t.is_cuda and not c)
        if not nbytes and not copies and self._coder is None:
            return None

        def reserve() -> None:
            self._staging.reserve(nbytes)
            if copies:
                key = (torch.device("cpu"), True)
                buf = self._acquire(key, copies)
                with self._lock:
                    self._free.setdefault(key, []).append(buf)
            if self._coder is not None:
                self._coder.start()

        thread = threading.Thread(target=reserve, name="ckptzip-reserve", daemon=True)
        thread.start()
        self._reserving = thread
        return thread

    def _host_plan(self, sources: list[torch.Tensor], caps: dict[torch.device, int] | None, overlapped: bool
                   ) -> list[bool]:
        """For a host snapshot of ``sources``: which tensors its GPUs code (within ``caps``, where
        its read overlaps training). The CUDA tensors they do not (a share copied raw instead,
        :func:`raw_share`, and those the engine would code on the host) are copied to pinned host
        memory and coded when the snapshot is written."""
        with gpu.capped(caps):
            limits = GpuLimits.of(sources, self._policy, self._gpu_memory, HOST_SNAPSHOT_BATCH_BYTES)
        coded = gpu_coded(sources, self._policy, limits)
        raw = raw_share([t.nbytes for t in sources], [i for i, t in enumerate(sources) if t.is_cuda and coded[i]],
                        OVERLAP_RAW_SHARE if overlapped and self._coder is not None else HOST_RAW_SHARE)
        return [c and i not in raw for i, c in enumerate(coded)]

    # ------------------------------------------------------------------------- taking

    def take(self, state: Any, base: DeltaBase | None, keep: bool) -> Snapshot:
        """Validate ``state`` (raises :class:`~ckptzip.errors.UnsupportedObjectError`) and snapshot
        it. A host snapshot rewrites its table against ``base`` as it reads the state; with
        ``keep`` it also copies the CUDA tensors it encodes to host memory, as the next save's base."""
        flat = flatten(state)  # also a deep copy of every non-tensor value
        names = [item.name for item in flat.tensors]
        sources = [item.tensor for item in flat.tensors]
        choice = self._choose(sources)
        if choice.host and self._where == "auto" and self.last_mode != "host":
            _LOG.warning("ckptzip: taking host snapshots (compressed on the GPU in small batches, stored in pinned "
                         "host memory) instead of device copies: %s", choice.reason)
        self.last_mode = "host" if choice.host else "device"
        self.last_reason = choice.reason
        self.last_overlapped = bool(choice.later)
        if choice.host:
            self._release_device_buffers()
            return self._host_snapshot(flat.tree, names, sources, base, keep, choice)
        copies, buffers = self._buffers(sources, {i: (t.device, False) for i, t in enumerate(sources)})
        ready = self._copied_now(sources, copies, list(range(len(sources))))
        return Snapshot(flat.tree, names, copies, buffers, ready, None, True, choice.caps)

    def _buffers(self, sources: list[torch.Tensor], keys: dict[int, _BufferKey]
                 ) -> tuple[list[torch.Tensor], list[tuple[_BufferKey, torch.Tensor]]]:
        """Copies-to-be of ``sources`` (by position, where ``keys`` gives a buffer; placeholders
        elsewhere), as views into one pooled buffer per key."""
        groups: dict[_BufferKey, list[int]] = collections.defaultdict(list)
        for i, key in keys.items():
            groups[key].append(i)
        copies = [torch.empty(0)] * len(sources)
        buffers = []
        for key, members in groups.items():
            offsets, total = [], 0
            for i in members:
                offsets.append(total)
                total += _aligned(sources[i].nbytes)
            buf = self._acquire(key, total)
            buffers.append((key, buf))
            for i, offset in zip(members, offsets):
                t = sources[i]
                copies[i] = buf[offset : offset + t.nbytes].view(t.dtype).view(t.shape)
        return copies, buffers

    def _copied_now(self, sources: list[torch.Tensor], copies: list[torch.Tensor], which: list[int]
                    ) -> list[torch.cuda.Event]:
        """Copy ``sources[i]`` into ``copies[i]`` for ``i`` in ``which`` before the caller's later
        kernels run (its streams wait for the copies; its thread does not); the events after them."""
        copying = self._copy([sources[i] for i in which], [copies[i] for i in which], "copy")
        return self._ordered([finish() for finish in copying])

    @staticmethod
    def _ordered(copied: list[Copied]) -> list[torch.cuda.Event]:
        """The current streams wait for ``copied`` (later kernels may overwrite the sources)."""
        for device, done in copied:
            torch.cuda.current_stream(device).wait_event(done)
        return [done for _, done in copied]

    def _host_snapshot(self, tree: Any, names: list[str], sources: list[torch.Tensor], base: DeltaBase | None,
                       keep: bool, choice: _Choice) -> Snapshot:
        coded = self._host_plan(sources, choice.caps, bool(choice.later))
        if self._reserving is not None:  # its buffers, not a second set beside them
            self._reserving.join()
            self._reserving = None
        cuda = [i for i, t in enumerate(sources) if t.is_cuda]
        # copied now: the host tensors, and (where the read comes later) the CUDA tensors it cannot wait for
        now = {i: (t.device, False) for i, t in enumerate(sources)
               if not t.is_cuda or (choice.later and i not in choice.later)}
        pinned = [i for i in cuda if keep or not coded[i]]  # copied to the host by the read: kept as a base, or coded there
        copies, buffers = self._buffers(sources, now)
        host, host_buffers = self._buffers(sources, dict.fromkeys(pinned, (torch.device("cpu"), True)))
        ready = self._copied_now(sources, copies, list(now))
        read_from = [copies[i] if i in now else sources[i] for i in range(len(sources))]
        kept = [host[i] if i in pinned else copies[i] if i in now and not sources[i].is_cuda else torch.empty(0)
                for i in range(len(sources))]

        if not cuda:
            return Snapshot(tree, names, kept, buffers, ready, None, True, None)

        def read() -> _Read:
            copying: list[Callable[[], Copied]] = []  # empty until the copies are started
            try:
                options = SaveOptions(self._policy, base, self._gpu_memory, HOST_SNAPSHOT_BATCH_BYTES)
                staged = stage_state(names, read_from, options, self._staging, self._expected_staging(),
                                     HostCopies({i: host[i] for i in cuda if not coded[i]},
                                                lambda: copying.extend(self._copy([read_from[i] for i in pinned],
                                                                                  [host[i] for i in pinned], "read-copy"))))
            finally:
                copied = self._ordered([finish() for finish in copying])
            return _Read(staged, copied)

        if choice.later:
            devices = {sources[i].device for i in cuda}
            reading = Reading(read, {d: self._stream("read", d) for d in devices}, choice.caps or {})
            return Snapshot(tree, names, kept, buffers + host_buffers, ready, reading, keep, None)
        done = read()
        self._staged_bytes = done.staged.occupied_bytes
        return Snapshot(tree, names, kept, buffers + host_buffers, ready + done.copied, done.staged, keep, None)

    def _expected_staging(self) -> int | None:
        """Pinned staging the next host snapshot needs: the buffers the last one occupied and a
        margin (None before the first)."""
        return None if self._staged_bytes is None else int(self._staged_bytes * STAGING_MARGIN)

    def _copy(self, sources: list[torch.Tensor], copies: list[torch.Tensor], role: str
              ) -> list[Callable[[], Copied]]:
        """Copy ``sources`` into ``copies``: host tensors now, CUDA tensors on a side stream per
        device (``role``: the caller's copies, or a read's, each on streams of its own) after the
        work queued on the current stream (to the host, a few pieces at a time:
        :class:`~._copies.Trickle`). Returns per device a function that gives the event after its
        copies (once they are all queued), which must be waited for before the sources change."""
        by_device: dict[torch.device, list[int]] = collections.defaultdict(list)
        for i, t in enumerate(sources):
            by_device[t.device].append(i)
        ready: list[Callable[[], Copied]] = []
        for device, members in by_device.items():
            into, out_of = [copies[i] for i in members], [sources[i] for i in members]
            if device.type != "cuda":
                copy_batched(into, out_of, non_blocking=False)
                continue
            current = torch.cuda.current_stream(device)
            side = self._stream(role, device)
            side.wait_stream(current)  # the state is final once the queued kernels ran
            if into[0].device.type == "cpu":  # a host snapshot's: all its copies go to pinned memory
                ready.append(Trickle(device, side, into, out_of).finish)
                continue
            with torch.cuda.stream(side):
                copy_batched(into, out_of, non_blocking=True)
            done = torch.cuda.Event()
            done.record(side)
            ready.append(queued(device, done))
        return ready

    # ------------------------------------------------------------------------- writing

    @contextlib.contextmanager
    def use(self, snapshot: Snapshot) -> Iterator[Write]:
        """In the worker: wait for the snapshot's read and copies, then give the body a function
        that writes it as a container (on private CUDA streams, its GPU work within the snapshot's
        caps); recycle the buffers afterwards."""
        devices = {key[0] for key, _ in snapshot.buffers if key[0].type == "cuda"}
        streams = [self._stream("write", d) for d in devices]
        staged: StagedState | None = None

        def write(f: BinaryIO, base: DeltaBase | None) -> Written:
            kept = dict(zip(snapshot.names, snapshot.tensors)) if snapshot.copied else None
            if staged is not None and staged.rest and staged.shared and self._coder is not None and self._coder.usable:
                entries = self._coder.write(f, staged, snapshot.tree, self._policy)  # coded in the child
                if entries is not None:
                    return Written(entries, kept)
            if staged is not None:  # its table was rewritten (against the base) when the state was read
                return Written(write_staged(f, staged, snapshot.tree, self._policy), kept)
            return Written(write_state(f, snapshot.names, snapshot.tensors, snapshot.tree,
                                       SaveOptions(self._policy, base, self._gpu_memory)), kept)

        try:
            ready = snapshot.ready
            if isinstance(snapshot.staged, Reading):
                done = snapshot.staged.result()
                staged, ready = done.staged, ready + done.copied
                self._staged_bytes = staged.occupied_bytes
            else:
                staged = snapshot.staged
            for event in ready:
                event.synchronize()
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
                expected = self._expected_staging()
                if expected is not None:  # the first snapshot reserved the raw size: keep what is used
                    self._staging.trim(expected)
            with self._lock:
                for key, buf in snapshot.buffers:
                    self._free.setdefault(key, []).append(buf)

    def clear(self) -> None:
        """Free the pooled buffers; stop the coding process."""
        with self._lock:
            self._free.clear()
            self._slabs.clear()
        self._staging.clear()
        if self._coder is not None:
            self._coder.close()


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


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
