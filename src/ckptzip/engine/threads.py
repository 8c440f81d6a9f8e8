"""Threads of the engine's CPU batches: how many workers code them at once (:func:`cpu_workers`),
and each batch's share of the cores for its codec calls (:func:`batch_share`, applied with
:func:`~ckptzip.codecs.codec_threads`)."""

from __future__ import annotations

from ..codecs import cpu_threads
from ..kernels import THREAD_SAFE


def batch_share(batches: int) -> int:
    """Threads each of ``batches`` batches may use when the engine codes them at once, one per
    worker thread: the cores split between the batches that run together."""
    cores = cpu_threads()
    return max(1, cores // max(1, min(cores, batches)))


def cpu_workers(cpu_batches: int) -> tuple[int, int]:
    """Workers for :func:`~.ahead.run_ahead` over a plan with ``cpu_batches`` CPU batches (one
    per core, else one), and the codec threads each CPU batch may use (:func:`batch_share`)."""
    workers = cpu_threads() if THREAD_SAFE and cpu_batches else 1
    return workers, batch_share(cpu_batches if workers > 1 else 1)
