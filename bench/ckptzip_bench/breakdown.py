"""Where the time of one save or load goes: GPU kernels by kind, copies, checksums, file I/O, host
Python and waiting.

Two sources, one table. The GPU lane comes from torch.profiler's device events (kernels and
memcpys, classified by name by :data:`GPU_RULES`). The host lanes come from sampling the Python
stack of every thread about once a millisecond (:data:`HOST_RULES`, innermost matching frame
wins): torch.profiler's Python tracer only follows threads alive when it starts, and the engine
does its host work on threads it starts per call. Lanes overlap (threads and streams run at the
same time), so a lane's seconds are busy time on that lane, not shares of the wall time.
"""

from __future__ import annotations

import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from contextlib import nullcontext
from dataclasses import dataclass
from types import FrameType
from typing import Any

import torch

__all__ = [
    "CATEGORIES",
    "GPU_RULES",
    "HOST_RULES",
    "LANES",
    "classify_device_event",
    "classify_frame",
    "device_seconds",
    "profile_call",
]

LANES = ("gpu", "main", "workers")  # GPU streams, the calling thread, every other thread


@dataclass(frozen=True)
class Rule:
    """A category for events whose name (GPU) or frame (host: file path and function) matches."""

    category: str
    path: str | None = None  # a substring of the frame's file path ("/" separated)
    names: tuple[str, ...] = ()  # GPU: substrings of the event name; host: exact function names


# GPU events, first match wins; a kernel no rule names is "GPU kernels: other".
GPU_RULES: tuple[Rule, ...] = (
    Rule("copy D2H", names=("Memcpy DtoH",)),
    Rule("copy H2D", names=("Memcpy HtoD",)),
    Rule("copy D2D", names=("Memcpy DtoD", "Memcpy PtoP")),
    Rule("memset", names=("Memset",)),
    Rule("GPU kernels: byte planes split/merge", names=("split_kernel", "merge_kernel")),
    Rule("GPU kernels: gather + checksums", names=("segments_", "gather_bytes", "wsum")),
    Rule("GPU kernels: nvCOMP codecs", names=("nvcomp", "ans_gpu_lib", "zstd", "gdeflate", "bitcomp", "lz4",
                                             "cascaded", "deflate", "snappy")),
)
GPU_OTHER = "GPU kernels: other"

# Host frames, checked innermost first; the first frame any rule matches names the category.
_IO_FUNCTIONS = ("write", "writelines", "readinto", "read_into", "read_exact_into", "_readinto", "pwrite",
                 "pread", "preadv", "fsync", "_writeback")
HOST_RULES: tuple[Rule, ...] = (
    Rule("wait for the GPU", path="/torch/cuda/", names=("synchronize", "wait_event", "wait_stream")),
    Rule("wait: locks, queues, idle threads", path="/threading.py"),
    Rule("wait: locks, queues, idle threads", path="/queue.py"),
    Rule("wait: locks, queues, idle threads", path="/concurrent/futures/"),
    Rule("checksums", path="/ckptzip/checksum.py"),
    Rule("checksums", names=("segment_sums", "_segment_sums_numpy", "verify_checksums", "_verify_xxh3")),
    Rule("byte planes (host)", path="/ckptzip/kernels/planes.py"),
    Rule("new host pages (fault-in)", path="/ckptzip/memory/pages.py"),
    Rule("codecs (host calls)", path="/ckptzip/codecs/"),
    Rule("file I/O", path="/ckptzip/storage/"),
    Rule("file I/O", path="/ckptzip/format/writer.py", names=("append", "flush")),
    Rule("file I/O", names=_IO_FUNCTIONS),
    Rule("torch (host)", path="/torch/"),
)
HOST_OTHER = "host Python"

CATEGORIES: tuple[str, ...] = tuple(dict.fromkeys(
    [r.category for r in GPU_RULES] + [GPU_OTHER] + [r.category for r in HOST_RULES] + [HOST_OTHER]
))


def classify_device_event(name: str) -> str:
    """The category of a GPU event (a kernel or a memcpy/memset) by its name."""
    for rule in GPU_RULES:
        if any(part in name for part in rule.names):
            return rule.category
    return GPU_OTHER


def _matches(rule: Rule, path: str, function: str) -> bool:
    return (rule.path is None or rule.path in path) and (not rule.names or function in rule.names)


def classify_frame(frame: FrameType | None) -> str:
    """The category of a thread's stack: the innermost frame a :data:`HOST_RULES` rule matches."""
    while frame is not None:
        path, function = frame.f_code.co_filename.replace("\\", "/"), frame.f_code.co_name
        for rule in HOST_RULES:
            if _matches(rule, path, function):
                return rule.category
        frame = frame.f_back
    return HOST_OTHER


class _StackSampler:
    """Samples every other thread's Python stack on a daemon thread until stopped."""

    def __init__(self, main: int, interval_s: float) -> None:
        self.counts: Counter[tuple[str, str]] = Counter()
        self.samples = 0
        self.threads: set[int] = set()
        self._main, self._interval = main, interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ckptzip-bench-sampler", daemon=True)

    def __enter__(self) -> _StackSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        me = threading.get_ident()
        while not self._stop.wait(self._interval):
            for ident, frame in sys._current_frames().items():
                if ident == me:
                    continue
                lane = "main" if ident == self._main else "workers"
                if lane == "workers":
                    self.threads.add(ident)
                self.counts[(lane, classify_frame(frame))] += 1
            self.samples += 1


def device_seconds(events: Iterable[Any]) -> dict[str, float]:
    """Busy seconds per category of torch.profiler's GPU events (streams summed)."""
    seconds: Counter[str] = Counter()
    for event in events:
        if event.device_type.name == "CUDA":  # kernels, memcpys and memsets
            seconds[classify_device_event(event.name)] += event.time_range.elapsed_us() / 1e6
    return dict(seconds)


def _torch_profiler() -> Any:
    from torch.profiler import ProfilerActivity, profile

    return profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])


def profile_call(fn: Callable[[], Any], device: torch.device, interval_s: float = 1e-3) -> tuple[dict[str, Any], Any]:
    """Run ``fn`` once under the stack sampler (and torch.profiler on CUDA); returns the breakdown
    as JSON-able data and the torch.profiler object (``None`` on the CPU) for its own tables."""
    cuda = device.type == "cuda"
    with _torch_profiler() if cuda else nullcontext() as prof, \
            _StackSampler(threading.get_ident(), interval_s) as sampler:
        start = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - start
    lanes: dict[str, dict[str, float]] = {lane: {} for lane in LANES}
    if prof is not None:
        lanes["gpu"] = device_seconds(prof.events())
    for (lane, category), n in sampler.counts.items():
        lanes[lane][category] = n / max(sampler.samples, 1) * wall
    return {
        "wall_seconds": wall,
        "samples": sampler.samples,
        "worker_threads": len(sampler.threads),
        "lanes": lanes,
        "gpu_profiled": cuda,
    }, prof
