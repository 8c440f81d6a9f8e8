"""Overlap per-item work: compression or decoding a few items ahead on a thread pool, reading
one blob ahead, writing one blob behind; results are always consumed in order."""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import IO, Generic, TypeVar

K = TypeVar("K")
R = TypeVar("R")
T = TypeVar("T")


class Task(Generic[K, R]):
    """``run()`` for ``key``; ``inline`` tasks run on the calling thread (GPU work stays on the
    thread that owns the device's stream)."""

    __slots__ = ("key", "run", "inline")

    def __init__(self, key: K, run: Callable[[], R], *, inline: bool = False) -> None:
        self.key = key
        self.run = run
        self.inline = inline


def run_ahead(tasks: Iterable[Task[K, R]], workers: int) -> Iterator[tuple[K, R]]:
    """Yield ``(key, result)`` for each task, in order, keeping up to ``2 * workers`` in flight.

    ``tasks`` is consumed lazily, so preparing a task (resolving its data) also happens at most
    that far ahead. An error in a task is raised when its turn comes; later tasks are cancelled.
    """
    pending: collections.deque[tuple[K, Future[R]]] = collections.deque()
    depth = 2 * max(1, workers)
    pool = ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="ckptzip-dcp")
    try:
        for task in tasks:
            if task.inline:
                done: Future[R] = Future()
                done.set_result(task.run())
                pending.append((task.key, done))
            else:
                pending.append((task.key, pool.submit(task.run)))
            while len(pending) >= depth:
                key, future = pending.popleft()
                yield key, future.result()
        while pending:
            key, future = pending.popleft()
            yield key, future.result()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


_DONE = object()


def read_ahead(items: Iterable[T]) -> Iterator[T]:
    """Iterate ``items`` on a background thread, one item ahead of the consumer (so reading the
    next blob overlaps decoding this one). ``items`` must not need the consumer's thread."""
    iterator = iter(items)
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckptzip-dcp-read") as pool:
        upcoming = pool.submit(next, iterator, _DONE)
        while True:
            item = upcoming.result()
            if item is _DONE:
                return
            upcoming = pool.submit(next, iterator, _DONE)
            yield item  # type: ignore[misc]


class WriteBehind:
    """Write to ``stream`` on a background thread with one write in flight, so producing the next
    buffer (compressing on a GPU, copying to the host) overlaps writing the previous one."""

    def __init__(self, stream: IO[bytes]) -> None:
        self._stream = stream
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckptzip-dcp-write")
        self._pending: Future[int] | None = None

    def write(self, data: bytes) -> None:
        """Queue ``data`` after waiting for the previous write (whose error is raised here)."""
        self._wait()
        self._pending = self._pool.submit(self._stream.write, data)

    def _wait(self) -> None:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()

    def __enter__(self) -> WriteBehind:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        try:
            if exc_type is None:
                self._wait()
            elif self._pending is not None:
                wait([self._pending])  # finish before the stream closes; the body's error wins
        finally:
            self._pool.shutdown(wait=True)
