#!/usr/bin/env python3
"""How long dropping a shared tensor holds the interpreter lock, with and without
``ckptzip.memory.shared.unmap_pages`` first: a thread that sleeps 1 ms at a time notes how late it
wakes (what a training thread would wait) while the main thread drops a tensor of N GiB whose file
another reference keeps, as DCP's checkpoint process keeps the staging it was handed.

    PYTHONPATH=src python3 bench/unmap_probe.py --gib 1,2
"""

from __future__ import annotations

import argparse
import os
import threading
import time
from collections.abc import Callable

from ckptzip.memory.shared import shared_empty, unmap_pages


def worst_wake(action: Callable[[], object]) -> tuple[float, float]:
    """Seconds ``action`` took, and the latest a 1 ms sleeper woke while it ran."""
    late, stop = [0.0], threading.Event()

    def watch() -> None:
        while not stop.is_set():
            due = time.perf_counter() + 0.001
            time.sleep(0.001)
            late[0] = max(late[0], time.perf_counter() - due)

    thread = threading.Thread(target=watch)
    thread.start()
    time.sleep(0.05)
    start = time.perf_counter()
    action()
    took = time.perf_counter() - start
    time.sleep(0.05)
    stop.set()
    thread.join()
    return took, late[0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gib", default="1,2", help="sizes, comma-separated")
    args = p.parse_args()
    for gib in (int(x) for x in args.gib.split(",")):
        for unmap in (False, True):
            held = [shared_empty(gib << 30).fill_(1)]  # every page mapped here
            keep = os.dup(held[0].untyped_storage()._share_fd_cpu_()[0])  # the other process's reference
            note = ""
            if unmap:
                took, late = worst_wake(lambda tensor=held[0]: unmap_pages(tensor))
                note = f"; unmap_pages {took:.3f} s, worst late wake {late:.3f} s"
            took, late = worst_wake(held.clear)
            os.close(keep)
            print(f"{gib} GiB, unmap_pages first: {unmap}: drop {took:.3f} s, worst late wake {late:.3f} s{note}")


if __name__ == "__main__":
    main()
