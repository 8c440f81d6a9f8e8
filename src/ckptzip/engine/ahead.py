"""Ordered work-ahead: tasks run a few ahead on a thread pool (or inline), results consumed in
order; and iteration one item ahead on a background thread."""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Generic, TypeVar

K = TypeVar("K")
R = TypeVar("R")
T = TypeVar("T")


class Task(Generic[K, R]):
    """``run()`` for ``key``; ``inline`` tasks run on the calling thread (GPU work stays on the
    thread that owns the device's stream)."""

    __slots__ = ("inline", "key", "run")

    def __init__(self, key: K, run: Callable[[], R], *, inline: bool = False) -> None:
        self.key = key
        self.run = run
        self.inline = inline


def run_ahead(tasks: Iterable[Task[K, R]], workers: int) -> Iterator[tuple[K, R]]:
    """Yield ``(key, result)`` for each task, in order, keeping up to ``2 * workers`` in flight.

    ``tasks`` is consumed lazily, so preparing a task (resolving its data) also happens at most
    that far ahead. Inline tasks run one ahead of the consumer: the next one starts (queues its
    GPU work) before the previous result is yielded, and no further, since each result may hold
    device memory until the consumer is done with it. An error in a task is raised when its turn
    comes; later tasks are cancelled.
    """
    pending: collections.deque[tuple[K, Future[R], bool]] = collections.deque()
    depth = 2 * max(1, workers)
    inline_pending = 0
    pool = ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="ckptzip-ahead")
    try:
        for task in tasks:
            if task.inline:
                done: Future[R] = Future()
                done.set_result(task.run())
                pending.append((task.key, done, True))
                inline_pending += 1
            else:
                pending.append((task.key, pool.submit(task.run), False))
            while len(pending) >= depth or inline_pending > 1:
                key, future, inline = pending.popleft()
                inline_pending -= inline
                yield key, future.result()
        while pending:
            key, future, _ = pending.popleft()
            yield key, future.result()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


class _Done:
    """The end of an iterator read ahead."""


_DONE = _Done()


def read_ahead(items: Iterable[T]) -> Iterator[T]:
    """Iterate ``items`` on a background thread, one item ahead of the consumer (so reading the
    next blob overlaps decoding this one). ``items`` must not need the consumer's thread."""
    iterator = iter(items)
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckptzip-read-ahead") as pool:
        upcoming = pool.submit(next, iterator, _DONE)
        while True:
            item: T | _Done = upcoming.result()
            if isinstance(item, _Done):
                return
            upcoming = pool.submit(next, iterator, _DONE)
            yield item
