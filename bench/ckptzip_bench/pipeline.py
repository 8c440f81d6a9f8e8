"""The pipeline's own speed, with no storage in the way: save to a file object that discards what it
is given, load from bytes already in host memory.

A method takes part when it can save to a file object and load from one
(:meth:`~ckptzip_bench.baselines.Baseline.stream_io`): ckptzip's presets and torch.save. Each is
timed ``reps`` times after a first call reported apart; the first load is checked bit for bit.
:func:`profile_pipeline` breaks one save and one load down by where the time goes.
"""

from __future__ import annotations

import io
import statistics
import time
from collections.abc import Callable
from typing import Any, BinaryIO, cast

import torch

from .baselines import Baseline, StreamIO
from .breakdown import profile_call
from .measure import assert_state_equal, tensor_nbytes

__all__ = ["DiscardSink", "first_call", "measure_pipeline", "profile_pipeline", "timed"]


class DiscardSink(io.RawIOBase):
    """A writable file object that counts and drops what it is given."""

    def __init__(self) -> None:
        super().__init__()
        self.nbytes = 0

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        n = memoryview(b).nbytes
        self.nbytes += n
        return n


def discard_sink() -> BinaryIO:
    """A :class:`DiscardSink`, typed as the binary file it is."""
    return cast(BinaryIO, DiscardSink())  # a RawIOBase is a binary file object; typeshed says otherwise


def first_call(fn: Callable[[], Any], device: torch.device) -> tuple[float, Any]:
    """Seconds of one call of ``fn`` (the device synchronised before and after on CUDA) and its result."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn()
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - start, out


def timed(fn: Callable[[], Any], reps: int, device: torch.device) -> list[float]:
    """Seconds of each of ``reps`` calls of :func:`first_call`; each result is dropped before the next."""
    return [first_call(fn, device)[0] for _ in range(reps)]


def _in_memory(save: Callable[[Any, BinaryIO], None], state: Any) -> bytes:
    buffer = io.BytesIO()
    save(state, buffer)
    return buffer.getvalue()


def _stream(method: Baseline) -> StreamIO:
    stream = method.stream_io()
    if stream is None:
        raise ValueError(f"{method.name} cannot save to a file object; use a ckptzip preset or torch.save")
    return stream


def measure_pipeline(method: Baseline, state: Any, device: torch.device, reps: int) -> dict[str, Any]:
    """Save ``state`` to a :class:`DiscardSink` and load it from bytes in host memory onto ``device``,
    ``reps`` times each after a first call reported apart. If the first load is not bit-exact the
    record is only ``{"mismatch": first differing path}``."""
    save, load = _stream(method)
    first_save, _ = first_call(lambda: save(state, discard_sink()), device)
    saves = timed(lambda: save(state, discard_sink()), reps, device)
    blob = _in_memory(save, state)
    first_load, loaded = first_call(lambda: load(io.BytesIO(blob), device), device)
    try:
        assert_state_equal(method.expected(state), loaded)
    except AssertionError as error:
        return {"mismatch": str(error)}
    del loaded
    loads = timed(lambda: load(io.BytesIO(blob), device), reps, device)
    raw = tensor_nbytes(method.expected(state))
    save_s, load_s = statistics.median(saves), statistics.median(loads)
    return {
        "stored_bytes": len(blob),
        "save_seconds": save_s,
        "load_seconds": load_s,
        "save_gbps": raw / save_s / 1e9,
        "load_gbps": raw / load_s / 1e9,
        "save_runs": saves,
        "load_runs": loads,
        "first_save_seconds": first_save,
        "first_load_seconds": first_load,
    }


def profile_pipeline(method: Baseline, state: Any, device: torch.device) -> dict[str, Any]:
    """Where the time goes in one save to a :class:`DiscardSink` and one load from host memory
    (:func:`ckptzip_bench.breakdown.profile_call`), after one untimed round of each."""
    save, load = _stream(method)
    blob = _in_memory(save, state)
    load(io.BytesIO(blob), device)
    saved, _ = profile_call(lambda: save(state, discard_sink()), device)
    loaded, _ = profile_call(lambda: load(io.BytesIO(blob), device), device)
    return {"method": method.name, "save": saved, "load": loaded}
