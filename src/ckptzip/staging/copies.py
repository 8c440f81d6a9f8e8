"""Copies of a state's tensors, bit for bit, for its snapshots: into buffers of their device at
once, or to pinned host memory a few pieces at a time (:class:`Trickle`)."""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable

import torch

from ..memory.pinned import piece_ends

# Pieces of copies to the host, and how many may wait in the copy engine at once (other copies of
# the device wait behind them: a piece is about a millisecond of the link). Pieces are cut at
# multiples of this from their buffer's start, so each lies in one registration of a slab.
TRICKLE_PIECE_BYTES = 16 << 20
TRICKLE_AHEAD = 3

# Floating types that the CUDA kernel of ``_foreach_copy_`` carries through float (its "opmath"
# type), replacing their NaN payloads with the canonical NaN: those copy as same-width integers.
_THROUGH_FLOAT = {
    dtype: torch.int16 if dtype.itemsize == 2 else torch.int32 if dtype.itemsize == 4 else torch.uint8
    for dtype in (torch.bfloat16, torch.float16, torch.complex32,
                  *(getattr(torch, name) for name in dir(torch) if name.startswith("float8_")))
    if isinstance(dtype, torch.dtype)
}


def copy_batched(dst: list[torch.Tensor], src: list[torch.Tensor], *, non_blocking: bool) -> None:
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


Copied = tuple[torch.device, torch.cuda.Event]  # a device, and the event after its snapshot copies


def queued(device: torch.device, done: torch.cuda.Event) -> Callable[[], Copied]:
    """For copies queued already: a function that gives their device and the event after them."""
    return lambda: (device, done)


class Trickle:
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
                waiting: collections.deque[torch.cuda.Event] = collections.deque()
                for into, out_of in zip(dst, src):
                    if not out_of.is_contiguous():  # whole, through integers where floats would change bits
                        copy_batched([into], [out_of], non_blocking=True)
                        continue
                    a, b = into.reshape(-1).view(torch.uint8), out_of.reshape(-1).view(torch.uint8)
                    at = a.data_ptr() - a.untyped_storage().data_ptr()  # pieces from the buffer's start
                    for start, end in piece_ends(at, a.numel(), TRICKLE_PIECE_BYTES):
                        a[start - at : end - at].copy_(b[start - at : end - at], non_blocking=True)
                        waiting.append(torch.cuda.Event())
                        waiting[-1].record(stream)
                        if len(waiting) > TRICKLE_AHEAD:
                            waiting.popleft().synchronize()
                self._done.record(stream)
        except BaseException as exc:  # handed to the caller by finish()
            self._error = exc

    def finish(self) -> Copied:
        """Once every copy is queued: the device and the event after them."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._device, self._done
