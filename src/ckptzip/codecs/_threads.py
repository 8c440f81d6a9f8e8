"""One shared thread pool for CPU codecs (zstandard, zlib and lz4 release the GIL)."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")

_POOL: ThreadPoolExecutor | None = None
MIN_PARALLEL_BYTES = 1 << 20


def cpu_threads() -> int:
    """Threads used by CPU codecs: ``CKPTZIP_THREADS`` or the number of usable cores."""
    env = os.environ.get("CKPTZIP_THREADS")
    if env:
        return max(1, int(env))
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)


def parallel_map(fn: Callable[[T], R], items: Sequence[T], nbytes: int) -> list[R]:
    """``[fn(x) for x in items]``, on the shared pool when there is enough work to pay for it."""
    global _POOL
    if len(items) < 2 or nbytes < MIN_PARALLEL_BYTES or cpu_threads() == 1:
        return [fn(x) for x in items]
    if _POOL is None:
        _POOL = ThreadPoolExecutor(max_workers=cpu_threads(), thread_name_prefix="ckptzip-codec")
    return list(_POOL.map(fn, items))
