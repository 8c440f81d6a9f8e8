"""Ordered work-ahead (engine.ahead): order, how far ahead tasks run, errors."""

from __future__ import annotations

import threading

import pytest

from ckptzip.engine.ahead import Task, read_ahead, run_ahead


def test_results_come_in_task_order_whatever_finishes_first() -> None:
    gate = threading.Event()

    def slow() -> str:
        gate.wait(5)
        return "slow"

    def fast() -> str:
        gate.set()
        return "fast"

    tasks = [Task(0, slow), Task(1, fast), Task(2, lambda: "inline", inline=True)]
    assert list(run_ahead(tasks, workers=2)) == [(0, "slow"), (1, "fast"), (2, "inline")]


def test_inline_tasks_run_one_ahead_of_the_consumer_even_among_pool_tasks() -> None:
    log: list[str] = []

    def task(i: int) -> Task[int, int]:
        def run() -> int:
            log.append(f"run {i}")
            return i
        return Task(i, run, inline=True)

    tasks = [task(0), Task(99, lambda: 99), task(1), task(2), task(3)]
    for key, _ in run_ahead(tasks, workers=8):  # a deep pool window must not hold inline results
        log.append(f"got {key}")
    assert log.index("run 2") > log.index("got 0")
    assert log.index("run 3") > log.index("got 1")
    assert log.index("run 1") < log.index("got 0")  # the next inline task is queued first


def test_an_error_is_raised_in_its_turn() -> None:
    def boom() -> int:
        raise ValueError("task 1 failed")

    results = run_ahead([Task(0, lambda: 0), Task(1, boom), Task(2, lambda: 2)], workers=2)
    assert next(results) == (0, 0)
    with pytest.raises(ValueError, match="task 1 failed"):
        next(results)


def test_read_ahead_yields_every_item_in_order() -> None:
    assert list(read_ahead(iter(range(50)))) == list(range(50))


def test_lanes_run_inline_tasks_two_at_a_time_on_their_threads_in_order() -> None:
    lock = threading.Lock()
    running, peak, threads = [0], [0], set()
    both = threading.Barrier(2, timeout=5)

    def task(i: int) -> Task[int, int]:
        def run() -> int:
            with lock:
                running[0] += 1
                peak[0] = max(peak[0], running[0])
                threads.add(threading.current_thread().name.split("_")[0])
            if i < 2:
                both.wait()  # the first two can only finish together
            with lock:
                running[0] -= 1
            return i
        return Task(i, run, inline=True)

    assert list(run_ahead([task(i) for i in range(6)], workers=1, lanes=2)) == [(i, i) for i in range(6)]
    assert peak[0] == 2 and threads == {"ckptzip-lane"}
