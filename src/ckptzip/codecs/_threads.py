"""Threads of CPU codecs: one shared pool (zstandard, zlib and lz4 release the GIL), and the
share of the cores each thread's codec calls may use (the engine sets it while it codes several
batches at once: :mod:`ckptzip.engine.threads`)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import numpy as np

from .. import settings
from .._local import ThreadSetting

T = TypeVar("T")
R = TypeVar("R")

_POOL: ThreadPoolExecutor | None = None
MIN_PARALLEL_BYTES = 1 << 20
GROUP_BYTES = 4 << 20  # raw bytes of the chunks one thread codes per task: a few per thread keep them busy
_SHARE: ThreadSetting[int] = ThreadSetting()


def cpu_threads() -> int:
    """Threads used by CPU codecs: ``CKPTZIP_THREADS`` or the number of usable cores."""
    chosen = settings.threads()
    if chosen is not None:
        return chosen
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)


def codec_threads(n: int) -> contextlib.AbstractContextManager[None]:
    """Within: this thread's codec calls use at most ``n`` threads (where several batches are
    coded at once, each codec spawning threads for every core would oversubscribe them)."""
    return _SHARE.within(n)


def codec_thread_count() -> int:
    """Threads one codec call of this thread may use: its share (:func:`codec_threads`), else
    :func:`cpu_threads`."""
    n = _SHARE.get()
    return cpu_threads() if n is None else n


def parallel_map(fn: Callable[[T], R], items: Sequence[T], nbytes: int) -> list[R]:
    """``[fn(x) for x in items]``, on the shared pool when there is enough work to pay for it."""
    global _POOL
    if len(items) < 2 or nbytes < MIN_PARALLEL_BYTES or codec_thread_count() == 1:
        return [fn(x) for x in items]
    if _POOL is None:
        _POOL = ThreadPoolExecutor(max_workers=cpu_threads(), thread_name_prefix="ckptzip-codec")
    return list(_POOL.map(fn, items))


def chunk_groups(raw: np.ndarray) -> list[np.ndarray]:
    """Chunk indices (of chunks of ``raw`` bytes each) split into consecutive runs of about
    :data:`GROUP_BYTES`, at least one per thread of the caller's share: the tasks of a codec that
    codes chunk by chunk on :func:`parallel_map`."""
    if raw.size == 0:
        return []
    per = max(1, GROUP_BYTES // max(1, int(raw.max())))
    if codec_thread_count() > 1:
        per = min(per, -(-raw.size // codec_thread_count()))
    return np.array_split(np.arange(raw.size), range(per, raw.size, per))
