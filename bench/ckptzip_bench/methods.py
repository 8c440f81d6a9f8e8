"""Every method ``ckptzip bench`` compares, and how one is measured: save, restore, bit-exact check.

The methods are the baselines of :mod:`ckptzip_bench.baselines` plus ckptzip's three presets
behind the same :class:`~ckptzip_bench.baselines.Baseline` interface. :func:`measure_method`
turns one method into one JSON-able record; a method that is unavailable, fails or does not
round-trip bit for bit is recorded as such and never stops the benchmark.
"""

from __future__ import annotations

import functools
import math
import shutil
import statistics
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch

from ckptzip import api
from .analysis import TensorSize, dtype_name, group_totals
from .baselines import BASELINES, Baseline, CodecThroughput, StreamIO
from .measure import assert_state_equal, iter_tensors, tensor_nbytes
from .pipeline import measure_pipeline
from .system import PageCache, release_memory
from ckptzip.report import classify
from ckptzip.report import tensor_class

__all__ = [
    "DEFAULT_ORDER",
    "METHODS",
    "CkptzipAuto",
    "CkptzipFast",
    "CkptzipPortable",
    "CkptzipPreset",
    "RunContext",
    "first_line",
    "get_method",
    "measure_method",
    "method_names",
    "tensor_sizes",
]


class CkptzipPreset(Baseline):
    """``ckptzip.save`` / ``ckptzip.load`` of the whole state with one preset, one ``.ckz`` file."""

    preset: ClassVar[str]
    filename: ClassVar[str] = "state.ckz"

    def _save(self, state: Any, directory: Path) -> None:
        api.save(state, directory / self.filename, codec=self.preset)

    def _load(self, directory: Path, device: torch.device) -> Any:
        return api.load(directory / self.filename, map_location=device)

    def stream_io(self) -> StreamIO:
        return (lambda state, f: api.save(state, f, codec=self.preset),
                lambda f, device: api.load(f, map_location=device))


class CkptzipAuto(CkptzipPreset):
    name = "ckptzip-auto"
    preset = "auto"
    summary = "ckptzip default preset: byte planes, structured planes entropy-coded (GPU: nvCOMP gdeflate)"


class CkptzipFast(CkptzipPreset):
    name = "ckptzip-fast"
    preset = "fast"
    summary = "ckptzip fast preset: byte planes with the backend's fastest codec (GPU: nvCOMP ans)"


class CkptzipPortable(CkptzipPreset):
    name = "ckptzip-portable"
    preset = "portable"
    summary = "ckptzip portable preset: byte planes with zstd, decodable on machines without a GPU"


METHODS: tuple[type[Baseline], ...] = (CkptzipAuto, CkptzipFast, CkptzipPortable, *BASELINES)
# Run (and table) order: what the targets need first, so a time budget cuts the least useful.
DEFAULT_ORDER = (
    "ckptzip-auto", "torch.save", "nvcomp-zstd", "ckptzip-portable", "ckptzip-fast", "zstd-cpu",
    "nvcomp-ans", "nvcomp-ans-typed", "safetensors", "dcp", "dcp+zstd", "zipnn",
)


def method_names() -> list[str]:
    """Every method name, in :data:`DEFAULT_ORDER` first, then any other in :data:`METHODS` order."""
    names = [cls.name for cls in METHODS]
    return [n for n in DEFAULT_ORDER if n in names] + [n for n in names if n not in DEFAULT_ORDER]


def get_method(name: str) -> Baseline:
    """A fresh method by name; ``ValueError`` listing the known names otherwise."""
    for cls in METHODS:
        if cls.name == name:
            return cls()
    raise ValueError(f"unknown method {name!r}; expected one of {', '.join(method_names())}")


def tensor_sizes(method: Baseline, directory: Path, state: Any) -> list[TensorSize] | None:
    """Stored bytes of each tensor, where the method stores tensors independently: ckptzip (its
    index) and the raw-bytes baselines (their ``index.pt`` blob sizes); ``None`` for the others."""
    if isinstance(method, CkptzipPreset):
        with api.open(directory / method.filename) as reader:
            return [TensorSize(classify(e), e.dtype, e.nbytes, e.compressed_nbytes) for e in reader.entries()]
    index = directory / "index.pt"
    if not (index.is_file() and (directory / "blobs.bin").is_file()):
        return None
    sizes = torch.load(index, weights_only=True)["sizes"]
    tensors = list(iter_tensors(state))
    if len(sizes) != len(tensors):
        return None
    return [
        TensorSize(tensor_class(path, t), dtype_name(t.dtype), t.numel() * t.element_size(), size)
        for (path, t), size in zip(tensors, sizes, strict=True)
    ]


@dataclass
class RunContext:
    """Where and how methods run: restore device, repetitions, page cache, scratch directory, deadline,
    and the repetitions of the pipeline without storage."""

    device: torch.device
    reps: int
    cache: PageCache
    workdir: Path
    deadline: float = math.inf  # time.monotonic() after which no new method or repetition starts
    pipeline_reps: int = 0  # repetitions of save to a discarding sink and load from host memory; 0: none

    def out_of_time(self) -> bool:
        return time.monotonic() > self.deadline


def first_line(exc: BaseException) -> str:
    """``TypeName: first line of the message`` for a results file."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


def _device_speed(measure: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Run one GPU-resident or pipeline measurement; an error is recorded, not raised: the
    end-to-end numbers stand on their own."""
    try:
        return measure()
    except Exception as exc:  # reported, the run goes on
        traceback.print_exc()
        return {"error": first_line(exc)}
    finally:
        release_memory()


def _resident(method: CkptzipPreset, state: Any, checkpoint: Path, reps: int) -> dict[str, Any]:
    from .gpu import measure_resident

    resident = measure_resident(state, checkpoint, method.preset, reps=max(3, reps))
    return {
        "encode_gbps": resident.encode_gbps,
        "decode_gbps": resident.decode_gbps,
        "ratio": resident.ratio,
        "exact": None,
        "how": "ckptzip_bench.gpu.measure_resident, median; the restore through the same decoder is checked",
    }


def _codec_speed(result: CodecThroughput) -> dict[str, Any]:
    return {
        "encode_gbps": result.encode_gbps,
        "decode_gbps": result.decode_gbps,
        "ratio": result.ratio,
        "exact": result.mismatch is None,
        "mismatch": result.mismatch,
        "how": "nvCOMP on device-resident tensors, one call per tensor, CUDA events",
    }


def _record(method: Baseline, status: str, reason: str | None = None) -> dict[str, Any]:
    return {"name": method.name, "summary": method.summary, "status": status, "reason": reason,
            "exact": None, "ratio": None}


def measure_method(method: Baseline, state: Any, ctx: RunContext) -> dict[str, Any]:
    """Save and restore ``state`` with ``method`` ``ctx.reps`` times; every restore is compared bit
    for bit with what the method promises (:meth:`Baseline.expected`) before anything is reported.

    ``status`` is ``"ok"``, ``"skipped"`` (unavailable, or the time budget ran out), ``"failed"``
    (an exception; its first line is the reason) or ``"mismatch"`` (the first differing path).
    Only ``"ok"`` records carry measurements.
    """
    ok, why = method.available()
    if not ok:
        return _record(method, "skipped", why)
    if ctx.out_of_time():
        return _record(method, "skipped", "the time budget (--budget-s) was spent before it started")
    try:
        return _measure(method, state, ctx)
    except Exception as exc:  # a failing method is reported, never aborts the run
        traceback.print_exc()
        return _record(method, "failed", first_line(exc))
    finally:
        release_memory()


def _measure(method: Baseline, state: Any, ctx: RunContext) -> dict[str, Any]:
    expected = method.expected(state)
    raw = tensor_nbytes(expected)
    # On the GPU a ckptzip preset first runs once untimed: a fresh process compiles its Triton
    # kernels and creates nvCOMP contexts then. That first round is reported on its own.
    on_gpu = method if isinstance(method, CkptzipPreset) and ctx.device.type == "cuda" else None
    first = -1 if on_gpu else 0
    saves: list[float] = []
    loads: list[float] = []
    first_round: dict[str, float] = {}
    written = 0
    sizes: list[TensorSize] | None = None
    device: dict[str, Any] | None = None
    for rep in range(first, ctx.reps):
        if rep > 0 and ctx.out_of_time():
            break
        what = "warm-up round" if rep < 0 else f"repetition {rep + 1}"
        directory = ctx.workdir / f"{method.name}-{rep - first}"
        try:
            saved = method.save(state, directory)
            if rep == first:
                written = saved.bytes_written
                sizes = tensor_sizes(method, directory, state)
                if on_gpu:
                    checkpoint = directory / on_gpu.filename
                    device = _device_speed(functools.partial(_resident, on_gpu, state, checkpoint, ctx.reps))
            ctx.cache.drop()
            loaded, load_seconds = method.load(directory, ctx.device)
            try:
                assert_state_equal(expected, loaded)
            except AssertionError as error:
                return _record(method, "mismatch", f"{what}: {error}")
            finally:
                del loaded
        finally:
            shutil.rmtree(directory, ignore_errors=True)
        if rep < 0:
            first_round = {"save_seconds": saved.seconds, "load_seconds": load_seconds}
        else:
            saves.append(saved.seconds)
            loads.append(load_seconds)
    throughput = getattr(method, "throughput", None)
    if throughput is not None and ctx.device.type == "cuda":
        device = _device_speed(lambda: _codec_speed(throughput(state)))
        if device.get("exact") is False:
            return _record(method, "mismatch", f"device round trip: {device['mismatch']}")
    pipeline = None
    if ctx.pipeline_reps and method.stream_io() is not None and not ctx.out_of_time():
        pipeline = _device_speed(lambda: measure_pipeline(method, state, ctx.device, ctx.pipeline_reps))
        if "mismatch" in pipeline:
            return _record(method, "mismatch", f"load from host memory: {pipeline['mismatch']}")
    save_s, load_s = statistics.median(saves), statistics.median(loads)
    return {
        **_record(method, "ok"),
        "exact": True,
        "reps": len(saves),
        "raw_bytes": raw,
        "stored_bytes": written,
        "ratio": raw / written if written else None,
        "save_seconds": save_s,
        "load_seconds": load_s,
        "save_runs": saves,
        "load_runs": loads,
        "save_gbps": raw / save_s / 1e9,
        "load_gbps": raw / load_s / 1e9,
        "read_cache": ctx.cache.mode,
        "classes": group_totals(sizes) if sizes is not None else None,
        "device": device,
        "first_round": first_round or None,
        "pipeline": pipeline,
    }
