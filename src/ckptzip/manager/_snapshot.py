"""Snapshots a manager takes in ``save``, so the caller may change its state at once: device
copies into reused buffers, or host snapshots (compressed on the GPU in bounded batches, their
stored bytes in pinned host memory, while a share of the tensors crosses the link raw at the same
time, to be coded on the host when the snapshot is written)."""

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

from ..engine import memory
from ..engine.plan import GpuLimits, gpu_coded
from ..engine.policy import Policy
from ..engine.sources import DeltaBase
from ..engine.staging import PinnedPool, Slab
from ..engine.writer import StagedState, stage_state, write_state, write_staged
from ..errors import GpuMemoryError
from ..format import TensorEntry
from ..tree import flatten

_ALIGN = 256  # byte alignment of each tensor inside a snapshot buffer

_BufferKey = tuple[torch.device, bool]  # (device, pinned)
SnapshotMode = Literal["auto", "device", "host"]
# A device snapshot must leave this much GPU memory free (or 5 % of the GPU, if more), for the
# training steps that run while the checkpoint is written; otherwise "auto" takes a host snapshot.
DEVICE_HEADROOM = 2 << 30
# GPU batch of a host snapshot: its encoding needs a few of these beside the state.
HOST_SNAPSHOT_BATCH_BYTES = 256 << 20
# A host snapshot copies about this share of the bytes it would code on a GPU raw to pinned host
# memory instead, on a side stream while the GPU codes the rest (the copy engines and the GPU work
# at once), and codes those tensors on the host when the snapshot is written, in the background.
# The 40.5 GB state with 3 GiB free, its batches overlapped (engine.plan.OVERLAP_WORKING_SETS), on
# an H200: saves blocked 0.88-0.99 s at 0.5, 0.87-0.88 s at 0.25, 0.88-1.01 s at 0.1; host memory
# grew 1.21x, 1.17x and 1.15x the stored size (bench/RESULTS.md, seventeenth session). With the
# staging below packed and trimmed closer: 0.86-0.95 s at 0.25, 0.89-1.01 s at 0.2 (eighteenth).
HOST_RAW_SHARE = 0.25
# Pieces of those copies, and how many may wait in the copy engine at once (other copies of the
# device wait behind them: about 1 ms at 50 GB/s).
TRICKLE_PIECE_BYTES = 16 << 20
TRICKLE_AHEAD = 3
# Host snapshots' pinned staging is kept at this much above the buffers the last snapshot occupied
# (a pool smaller than that grows again, buffer by buffer, while a save blocks). Batches fill the
# buffers back to back, so the next snapshot of the same state occupies as many: the 40.5 GB state
# with 3 GiB free blocked 0.86-0.95 s at 1.02 with 256 MiB slabs, its host memory 1.07x the stored
# size plus about 1 GiB (bench/RESULTS.md, eighteenth session).
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
    staged: StagedState | None  # the table, its CUDA tensors already encoded, their stored bytes in pinned memory
    copied: bool  # whether ``tensors`` holds a copy of every tensor (the base of an incremental save)


@dataclass
class Written:
    """What a save wrote: its tensor table, and its tensors by name (None where they were staged)."""

    entries: list[TensorEntry]
    tensors: dict[str, torch.Tensor] | None


Write = Callable[[BinaryIO, "DeltaBase | None"], Written]


# Floating types that the CUDA kernel of ``_foreach_copy_`` carries through float (its "opmath"
# type), replacing their NaN payloads with the canonical NaN: those copy as same-width integers.
_THROUGH_FLOAT = {
    dtype: torch.int16 if dtype.itemsize == 2 else torch.int32 if dtype.itemsize == 4 else torch.uint8
    for dtype in (torch.bfloat16, torch.float16, torch.complex32,
                  *(getattr(torch, name) for name in dir(torch) if name.startswith("float8_")))
    if isinstance(dtype, torch.dtype)
}


def _copy_batched(dst: list[torch.Tensor], src: list[torch.Tensor], *, non_blocking: bool) -> None:
    """``dst[i].copy_(src[i])`` bit for bit, for all ``i`` (tensors of one device) in few launches:
    one ``_foreach_copy_`` per dtype and layout, since its fused CUDA kernel needs one dtype and
    matching strides per call."""
    groups: dict[tuple[torch.dtype, bool], list[int]] = collections.defaultdict(list)
    for i, t in enumerate(src):
        groups[t.dtype, t.is_contiguous()].append(i)
    for (dtype, _), members in groups.items():
        into, out_of = [dst[i] for i in members], [src[i] for i in members]
        bits = _THROUGH_FLOAT.get(dtype) if out_of[0].is_cuda else None  # CPU copies are bytewise
        if bits is not None:
            into, out_of = [t.view(bits) for t in into], [t.view(bits) for t in out_of]
        torch._foreach_copy_(into, out_of, non_blocking=non_blocking)


_Copied = tuple[torch.device, torch.cuda.Event]  # a device, and the event after its snapshot copies


def _queued(device: torch.device, done: torch.cuda.Event) -> Callable[[], _Copied]:
    """For copies queued already: a function that gives their device and the event after them."""
    return lambda: (device, done)


class _Trickle:
    """Copies of one GPU's tensors to pinned host memory, queued on ``stream`` by a thread of
    their own :data:`TRICKLE_PIECE_BYTES` at a time, at most :data:`TRICKLE_AHEAD` pieces ahead
    of the copy engine: queued at once, gigabytes of them would hold up every other copy of the
    device (a host snapshot's small reads and its batches' stored bytes wait behind them)."""

    def __init__(self, device: torch.device, stream: torch.cuda.Stream, dst: list[torch.Tensor],
                 src: list[torch.Tensor]) -> None:
        self._device = device
        self._done = torch.cuda.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(stream, dst, src), name="ckptzip-trickle",
                                        daemon=True)
        self._thread.start()

    def _run(self, stream: torch.cuda.Stream, dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
        try:
            with torch.cuda.device(self._device), torch.cuda.stream(stream):
                queued: collections.deque[torch.cuda.Event] = collections.deque()
                for into, out_of in zip(dst, src):
                    if not out_of.is_contiguous():  # whole, through integers where floats would change bits
                        _copy_batched([into], [out_of], non_blocking=True)
                        continue
                    a, b = into.reshape(-1).view(torch.uint8), out_of.reshape(-1).view(torch.uint8)
                    for start in range(0, b.numel(), TRICKLE_PIECE_BYTES):
                        a[start : start + TRICKLE_PIECE_BYTES].copy_(b[start : start + TRICKLE_PIECE_BYTES],
                                                                   non_blocking=True)
                        queued.append(torch.cuda.Event())
                        queued[-1].record(stream)
                        if len(queued) > TRICKLE_AHEAD:
                            queued.popleft().synchronize()
                self._done.record(stream)
        except BaseException as exc:  # handed to the caller by finish()
            self._error = exc

    def finish(self) -> _Copied:
        """Once every copy is queued: the device and the event after them."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._device, self._done


class SnapshotPool:
    """Takes snapshots of states, so the caller may mutate the originals at once.

    ``"device"``: every tensor is copied into a reusable flat buffer on its device; a CUDA tensor
    on a side stream that the caller's current stream then waits for, so ``take`` returns without
    a host sync. ``"host"``: CUDA tensors are compressed on their GPU in bounded batches and only
    their stored bytes are copied, into pinned host buffers that are kept for the next save (host
    tensors are copied as above). ``"auto"``: ``"device"`` when every GPU has room for the copy
    beside a safety margin, else ``"host"``. Buffers return to the pool after the save that used them.
    """

    def __init__(self, where: SnapshotMode, policy: Policy, gpu_memory: int | None = None) -> None:
        self._where = where
        self._policy = policy
        self._gpu_memory = gpu_memory
        self.last_mode: Literal["device", "host"] | None = None
        self.last_reason: str | None = None
        self._free: dict[_BufferKey, list[torch.Tensor]] = {}
        self._slabs: dict[int, Slab] = {}  # registered host memory of the pinned buffers, by address
        self._staging = PinnedPool(STAGING_BUFFER_BYTES, count=sys.maxsize, slab_bytes=STAGING_SLAB_BYTES)
        self._staged_bytes: int | None = None  # staging buffers the last host snapshot occupied
        self._reserving: threading.Thread | None = None  # reserve_host's, until a snapshot waited for it
        self._lock = threading.Lock()
        self._side_streams: dict[torch.device, torch.cuda.Stream] = {}  # caller thread only
        self._worker_streams: dict[torch.device, torch.cuda.Stream] = {}  # worker thread only

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
            return torch.empty(nbytes, dtype=torch.uint8, device=device)
        # registered pageable memory: torch's pinned allocator would round tens of GB up to a power of two
        try:
            slab = Slab(nbytes)
        except RuntimeError as exc:  # the driver refuses to register it: pageable memory, slower copies
            _LOG.warning("ckptzip: snapshot buffers in pageable host memory (copies to them are slower): %s", exc)
            return torch.empty(nbytes, dtype=torch.uint8)
        with self._lock:
            self._slabs[slab.memory.data_ptr()] = slab
        return slab.memory

    def _device_room(self, sources: list[torch.Tensor]) -> str | None:
        """Why a device snapshot does not fit, or None when it does on every GPU: its copy, beside
        ``DEVICE_HEADROOM`` (or 5 % of the GPU) left for training, out of what can really be had
        (free memory, what torch's cache would release, and pooled buffers it would reuse)."""
        need: dict[torch.device, int] = collections.defaultdict(int)
        for t in sources:
            if t.is_cuda:
                need[t.device] += _aligned(t.nbytes)
        for device, nbytes in need.items():
            with self._lock:
                pooled = max((b.numel() for b in self._free.get((device, False), [])), default=0)
            if pooled >= nbytes:
                continue
            total = torch.cuda.get_device_properties(device).total_memory
            headroom = max(DEVICE_HEADROOM, total // 20)
            have = memory.available(device) + pooled
            if nbytes + headroom > have:
                return (f"a device copy of the state needs {nbytes / _GIB:.2f} GiB on {device} and "
                        f"{headroom / _GIB:.2f} GiB must stay free for training, but only {have / _GIB:.2f} GiB "
                        "can be had there")
        return None

    def reserve_host(self, sources: list[torch.Tensor]) -> threading.Thread | None:
        """Where host snapshots are (or now would be) taken, reserve pinned staging for the GPU
        bytes of ``sources`` on a background thread (a save's staging waits for it)."""
        if self._where == "device" or (self._where == "auto" and self._device_room(sources) is None):
            return None
        try:
            coded = self._host_plan(sources)
        except GpuMemoryError:  # no room to plan with now: reserve for coding it all, the save will say why
            coded = [t.is_cuda for t in sources]
        nbytes = self._expected_staging() or sum(t.nbytes for t, c in zip(sources, coded) if c)
        copies = sum(_aligned(t.nbytes) for t, c in zip(sources, coded) if t.is_cuda and not c)
        if not nbytes and not copies:
            return None

        def reserve() -> None:
            self._staging.reserve(nbytes)
            if copies:
                key = (torch.device("cpu"), True)
                buf = self._acquire(key, copies)
                with self._lock:
                    self._free.setdefault(key, []).append(buf)

        thread = threading.Thread(target=reserve, name="ckptzip-reserve", daemon=True)
        thread.start()
        self._reserving = thread
        return thread

    def _host_plan(self, sources: list[torch.Tensor]) -> list[bool]:
        """For a host snapshot of ``sources``: which tensors its GPUs code. The CUDA tensors they
        do not (a share copied raw instead, :func:`raw_share`, and those the engine would code on
        the host) are copied to pinned host memory and coded when the snapshot is written."""
        limits = GpuLimits.of(sources, self._policy, self._gpu_memory, HOST_SNAPSHOT_BATCH_BYTES)
        coded = gpu_coded(sources, self._policy, limits)
        raw = raw_share([t.nbytes for t in sources], [i for i, t in enumerate(sources) if t.is_cuda and coded[i]],
                        HOST_RAW_SHARE)
        return [c and i not in raw for i, c in enumerate(coded)]

    def take(self, state: Any, base: DeltaBase | None, keep: bool) -> Snapshot:
        """Validate ``state`` (raises :class:`~ckptzip.errors.UnsupportedObjectError`) and snapshot
        it. A host snapshot rewrites its table against ``base`` now; with ``keep`` it also copies
        the CUDA tensors it encodes to host memory, as the next save's base."""
        flat = flatten(state)  # also a deep copy of every non-tensor value
        names = [item.name for item in flat.tensors]
        sources = [item.tensor for item in flat.tensors]
        reason = "snapshot='host' was asked for" if self._where == "host" else (
            "snapshot='device' was asked for" if self._where == "device" else self._device_room(sources))
        host = self._where == "host" or (self._where == "auto" and reason is not None)
        coded = self._host_plan(sources) if host else [False] * len(sources)
        if host and self._reserving is not None:  # its buffers, not a second set beside them
            self._reserving.join()
            self._reserving = None
        encoded = {i for i, t in enumerate(sources) if host and t.is_cuda}
        copied = [i for i in range(len(sources)) if keep or i not in encoded or not coded[i]]
        groups: dict[_BufferKey, list[int]] = collections.defaultdict(list)
        for i in copied:
            pinned = i in encoded  # a host copy of a CUDA tensor (kept as a base, or coded on the host)
            groups[torch.device("cpu") if pinned else sources[i].device, pinned].append(i)
        placeholder = torch.empty(0)
        copies = [placeholder] * len(sources)
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
        copying: list[Callable[[], _Copied]] = []  # empty until the copies are started

        def start_copies() -> None:
            copying.extend(self._copy([sources[i] for i in copied], [copies[i] for i in copied]))

        staged = None
        try:
            if encoded:  # the GPUs code while the copies cross the link; the host codes the copies later
                snapshot = [sources[i] if i in encoded else copies[i] for i in range(len(sources))]
                staged = stage_state(names, snapshot, self._policy, self._staging, HOST_SNAPSHOT_BATCH_BYTES, base,
                                     self._gpu_memory, self._expected_staging(),
                                     {i: copies[i] for i in encoded if not coded[i]}, start_copies)
                self._staged_bytes = staged.occupied_bytes
            else:
                start_copies()
        finally:
            copied_events = [finish() for finish in copying]
            for device, done in copied_events:  # later kernels of the caller may overwrite the sources
                torch.cuda.current_stream(device).wait_event(done)
        ready = [done for _, done in copied_events]
        if host and self._where == "auto" and self.last_mode != "host":
            _LOG.warning("ckptzip: taking host snapshots (compressed on the GPU in small batches, stored in pinned "
                         "host memory) instead of device copies: %s", reason)
        self.last_mode = "host" if host else "device"
        self.last_reason = reason or "a device copy of the state fits beside the headroom left for training"
        return Snapshot(flat.tree, names, copies, buffers, ready, staged, len(copied) == len(sources))

    def _expected_staging(self) -> int | None:
        """Pinned staging the next host snapshot needs: the buffers the last one occupied and a
        margin (None before the first)."""
        return None if self._staged_bytes is None else int(self._staged_bytes * STAGING_MARGIN)

    def _copy(self, sources: list[torch.Tensor], copies: list[torch.Tensor]) -> list[Callable[[], _Copied]]:
        """Copy ``sources`` into ``copies``: host tensors now, CUDA tensors on a side stream per
        device after the caller's queued work (to the host, a few pieces at a time: :class:`_Trickle`).
        Returns per device a function that gives the event after its copies (once they are all
        queued), which the caller's current stream must wait for before it changes the sources."""
        by_device: dict[torch.device, list[int]] = collections.defaultdict(list)
        for i, t in enumerate(sources):
            by_device[t.device].append(i)
        ready: list[Callable[[], _Copied]] = []
        for device, members in by_device.items():
            into, out_of = [copies[i] for i in members], [sources[i] for i in members]
            if device.type != "cuda":
                _copy_batched(into, out_of, non_blocking=False)
                continue
            current = torch.cuda.current_stream(device)
            side = self._side_streams.get(device)
            if side is None:
                side = self._side_streams[device] = torch.cuda.Stream(device)
            side.wait_stream(current)  # the state is final once the caller's queued kernels ran
            if into[0].device.type == "cpu":  # a host snapshot's: all its copies go to pinned memory
                ready.append(_Trickle(device, side, into, out_of).finish)
                continue
            with torch.cuda.stream(side):
                _copy_batched(into, out_of, non_blocking=True)
            done = torch.cuda.Event()
            done.record(side)
            ready.append(_queued(device, done))
        return ready

    @contextlib.contextmanager
    def use(self, snapshot: Snapshot) -> Iterator[Write]:
        """In the worker: wait for the copies, then give the body a function that writes the
        snapshot as a container (on private CUDA streams); recycle the buffers afterwards."""
        devices = {key[0] for key, _ in snapshot.buffers if key[0].type == "cuda"}
        streams = [self._worker_stream(d) for d in devices]
        staged = snapshot.staged

        def write(f: BinaryIO, base: DeltaBase | None) -> Written:
            kept = dict(zip(snapshot.names, snapshot.tensors)) if snapshot.copied else None
            if staged is not None:  # its table was rewritten (against the base) when it was taken
                return Written(write_staged(f, staged, snapshot.tree, self._policy), kept)
            return Written(write_state(f, snapshot.names, snapshot.tensors, snapshot.tree, self._policy, base,
                                       self._gpu_memory), kept)

        try:
            for event in snapshot.ready:
                event.synchronize()
            with contextlib.ExitStack() as stack:
                for stream in streams:
                    stack.enter_context(torch.cuda.stream(stream))
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

    def _worker_stream(self, device: torch.device) -> torch.cuda.Stream:
        stream = self._worker_streams.get(device)
        if stream is None:
            stream = self._worker_streams[device] = torch.cuda.Stream(device)
        return stream

    def clear(self) -> None:
        """Free the pooled buffers."""
        with self._lock:
            self._free.clear()
            self._slabs.clear()
        self._staging.clear()


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
