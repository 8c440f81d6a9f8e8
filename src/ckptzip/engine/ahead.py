"""Ordered work-ahead: tasks run a few ahead on a thread pool (or inline), results consumed in
order; iteration one item ahead on a background thread; and a thread that handles items in the
order they are put (:class:`InOrder`)."""

from __future__ import annotations

import collections
import queue
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Generic, TypeVar

K = TypeVar("K")
R = TypeVar("R")
T = TypeVar("T")


class Task(Generic[K, R]):
    """``run()`` for ``key``. ``inline`` tasks run on the calling thread (GPU work stays on the
    thread that owns the device's stream), or, where :func:`run_ahead` is given ``lanes`` above
    one, on that many threads of their own (``run`` then sets up its device and stream itself)."""

    __slots__ = ("inline", "key", "run")

    def __init__(self, key: K, run: Callable[[], R], *, inline: bool = False) -> None:
        self.key = key
        self.run = run
        self.inline = inline


def run_ahead(tasks: Iterable[Task[K, R]], workers: int, lanes: int = 1) -> Iterator[tuple[K, R]]:
    """Yield ``(key, result)`` for each task, in order, keeping up to ``2 * workers`` in flight.

    ``tasks`` is consumed lazily, so preparing a task (resolving its data) also happens at most
    that far ahead. Inline tasks run one ahead of the consumer: the next one starts (queues its
    GPU work) before the previous result is yielded, and no further, since each result may hold
    device memory until the consumer is done with it. With ``lanes`` above one they run that many
    at a time, each on a lane thread, so one codes on the host while another waits for its device
    (a lane's result is yielded before a further one starts). An error in a task is raised when
    its turn comes; later tasks are cancelled.
    """
    pending: collections.deque[tuple[K, Future[R], bool]] = collections.deque()
    depth = 2 * max(1, workers)
    inline_pending = 0
    pool = ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="ckptzip-ahead")
    lane_pool = ThreadPoolExecutor(max_workers=lanes, thread_name_prefix="ckptzip-lane") if lanes > 1 else None
    try:
        for task in tasks:
            if task.inline and lane_pool is None:
                done: Future[R] = Future()
                done.set_result(task.run())
                pending.append((task.key, done, True))
            else:
                pending.append((task.key, (lane_pool if task.inline and lane_pool else pool).submit(task.run),
                                task.inline))
            inline_pending += task.inline
            while len(pending) >= depth or inline_pending > (1 if lane_pool is None else lanes):
                key, future, inline = pending.popleft()
                inline_pending -= inline
                yield key, future.result()
        while pending:
            key, future, _ = pending.popleft()
            yield key, future.result()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        if lane_pool is not None:
            lane_pool.shutdown(wait=True, cancel_futures=True)


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


class InOrder(Generic[T]):
    """A thread that handles items in the order they are put. Its first error is raised in the
    putting thread (by ``put``, ``check`` or ``close``); items after it are only finished."""

    def __init__(self, name: str, maxsize: int) -> None:
        self._queue: queue.Queue[T | None] = queue.Queue(maxsize=maxsize)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            try:
                if self._error is None:
                    self._handle(item)
            except BaseException as exc:  # surfaced to the putting thread
                self._error = exc
            finally:
                self._finish(item)

    def _handle(self, item: T) -> None:
        raise NotImplementedError

    def _finish(self, item: T) -> None:
        """After each item, handled or not."""

    def put(self, item: T) -> None:
        self.check()
        self._queue.put(item)

    def check(self) -> None:
        """Raise the thread's error, if it had one."""
        if self._error is not None:
            raise self._error

    def close(self) -> None:
        """Wait for every item; raise the first error."""
        self._queue.put(None)
        self._thread.join()
        self.check()
