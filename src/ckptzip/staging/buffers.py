"""The buffers a manager's snapshots copy tensors into, reused from save to save: one flat buffer
per (device, pinned) key and snapshot, each tensor's copy a view into it; and the CUDA streams
those copies (and a snapshot's read and write) run on, by role and device."""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
from collections.abc import Callable

import torch

from ..errors import CheckpointWriteError
from ..memory.pinned import Slab
from ..memory.shared import shared_empty
from . import copies
from .copies import Copied, Trickle, copy_batched, queued

ALIGN = 256  # byte alignment of each tensor inside a snapshot buffer
BufferKey = tuple[torch.device, bool]  # (device, pinned)
HOST_PINNED: BufferKey = (torch.device("cpu"), True)
_LOG = logging.getLogger("ckptzip")


def aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


class SnapshotBuffers:
    """Pooled snapshot buffers and streams. ``shared``: host buffers in shared memory, where it
    has room (a process of their own codes what they hold)."""

    def __init__(self, shared: bool = False) -> None:
        self._shared = shared
        self._free: dict[BufferKey, list[torch.Tensor]] = {}
        self._slabs: dict[int, Slab] = {}  # registered host memory of the pinned buffers, by address
        self._lock = threading.Lock()
        # streams by role and device: the caller's copies, the background reads, the worker's writes
        self._streams: dict[tuple[str, torch.device], torch.cuda.Stream] = {}

    def stream(self, role: str, device: torch.device) -> torch.cuda.Stream:
        stream = self._streams.get((role, device))
        if stream is None:
            stream = self._streams[role, device] = torch.cuda.Stream(device)
        return stream

    def acquire(self, key: BufferKey, nbytes: int, paced: bool = False) -> torch.Tensor:
        """A buffer of at least ``nbytes`` for ``key``: a pooled one, else a new one (``paced``: a
        pinned one registered while training runs, :class:`~ckptzip.memory.pinned.Slab`)."""
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
            if device.type == "cpu" and self._shared:
                with contextlib.suppress(CheckpointWriteError):  # no room in shared memory: the write copies it
                    return shared_empty(nbytes)
            return torch.empty(nbytes, dtype=torch.uint8, device=device)
        # registered pageable memory: torch's pinned allocator would round tens of GB up to a power of two
        try:
            # shared where shared memory has room; pieces of whole trickled copies (the copies'
            # piece read now, so that the slab's registrations and the copies' cuts agree)
            slab = Slab(nbytes, shared=self._shared, unit=copies.TRICKLE_PIECE_BYTES, paced=paced)
        except RuntimeError as exc:  # the driver refuses to register it: pageable memory, slower copies
            _LOG.warning("ckptzip: snapshot buffers in pageable host memory (copies to them are slower): %s", exc)
            return torch.empty(nbytes, dtype=torch.uint8)
        with self._lock:
            self._slabs[slab.memory.data_ptr()] = slab
        return slab.memory

    def give_back(self, buffers: list[tuple[BufferKey, torch.Tensor]]) -> None:
        """Return buffers to the pool (nothing may still read them)."""
        with self._lock:
            for key, buf in buffers:
                self._free.setdefault(key, []).append(buf)

    def pooled_host(self) -> int:
        """Bytes of the host buffers the pool holds (pinned or not)."""
        with self._lock:
            return sum(b.numel() for (device, _), free in self._free.items() if device.type == "cpu" for b in free)

    def pooled(self, device: torch.device) -> int:
        """Bytes of the device buffers the pool holds for ``device``."""
        with self._lock:
            return sum(b.numel() for b in self._free.get((device, False), []))

    def release_device_buffers(self) -> None:
        """Give the pooled device buffers back to torch's cache (a host snapshot needs none), where
        the training takes them again."""
        with self._lock:
            for key in [k for k in self._free if k[0].type == "cuda"]:
                del self._free[key]

    def clear(self) -> None:
        with self._lock:
            self._free.clear()
            self._slabs.clear()

    def views(self, sources: list[torch.Tensor], keys: dict[int, BufferKey]
              ) -> tuple[list[torch.Tensor], list[tuple[BufferKey, torch.Tensor]]]:
        """Copies-to-be of ``sources`` (by position, where ``keys`` gives a buffer; placeholders
        elsewhere), as views into one pooled buffer per key."""
        groups: dict[BufferKey, list[int]] = collections.defaultdict(list)
        for i, key in keys.items():
            groups[key].append(i)
        copies = [torch.empty(0)] * len(sources)
        buffers = []
        for key, members in groups.items():
            offsets, total = [], 0
            for i in members:
                offsets.append(total)
                total += aligned(sources[i].nbytes)
            buf = self.acquire(key, total)
            buffers.append((key, buf))
            for i, offset in zip(members, offsets):
                t = sources[i]
                copies[i] = buf[offset : offset + t.nbytes].view(t.dtype).view(t.shape)
        return copies, buffers

    def copied_now(self, sources: list[torch.Tensor], copies: list[torch.Tensor], which: list[int]
                   ) -> list[torch.cuda.Event]:
        """Copy ``sources[i]`` into ``copies[i]`` for ``i`` in ``which`` before the caller's later
        kernels run (its streams wait for the copies; its thread does not); the events after them."""
        copying = self.copy([sources[i] for i in which], [copies[i] for i in which], "copy")
        return ordered([finish() for finish in copying])

    def copy(self, sources: list[torch.Tensor], copies: list[torch.Tensor], role: str
             ) -> list[Callable[[], Copied]]:
        """Copy ``sources`` into ``copies``: host tensors now, CUDA tensors on a side stream per
        device (``role``: the caller's copies, or a read's, each on streams of its own) after the
        work queued on the current stream (to the host, a few pieces at a time:
        :class:`~.copies.Trickle`). Returns per device a function that gives the event after its
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
            side = self.stream(role, device)
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


def ordered(copied: list[Copied]) -> list[torch.cuda.Event]:
    """The current streams wait for ``copied`` (later kernels may overwrite the sources)."""
    for device, done in copied:
        torch.cuda.current_stream(device).wait_event(done)
    return [done for _, done in copied]
