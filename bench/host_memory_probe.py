"""What host memory costs a load on this machine: first touch of fresh memory, and reading a file
in shared memory, by thread count and method.

- first touch: ``--gib`` of fresh anonymous memory (an ``mmap``) written once with ``memset``
  (ctypes, which releases the GIL) by 1, 4, 16 threads, plain, after ``madvise(MADV_HUGEPAGE)``
  and after ``madvise(MADV_POPULATE_WRITE)`` (Linux 5.14+; reported as unsupported otherwise);
  then the same memory written again (what a warm buffer costs).
- reading a file of ``--gib`` in ``--dir`` (default /dev/shm) into warm memory: ``os.preadv``
  by 1, 4, 12 threads, and ``mmap`` + ``memmove`` by the same.

    python3 bench/host_memory_probe.py --gib 2 --json $OUT/host-memory.json
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import mmap
import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from ckptzip_bench.results import print_and_save

MADV_HUGEPAGE = 14
MADV_POPULATE_WRITE = 23
_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
_libc.memset.restype = ctypes.c_void_p
_libc.memmove.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
_libc.memmove.restype = ctypes.c_void_p


def _address(m: mmap.mmap) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(m))


def _split(n: int, threads: int) -> list[tuple[int, int]]:
    step = -(-n // threads)
    step = -(-step // 4096) * 4096
    return [(o, min(step, n - o)) for o in range(0, n, step)]


def _parallel(threads: int, fn: Any, pieces: list[tuple[int, int]]) -> float:
    with ThreadPoolExecutor(threads) as pool:
        start = time.perf_counter()
        list(pool.map(lambda p: fn(*p), pieces))
        return time.perf_counter() - start


def first_touch(nbytes: int, threads: int, advice: int | None) -> dict[str, Any]:
    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    base = _address(m)
    row: dict[str, Any] = {"threads": threads, "advice": {None: "none", MADV_HUGEPAGE: "hugepage",
                                                          MADV_POPULATE_WRITE: "populate_write"}[advice]}
    advise_s = 0.0
    if advice is not None:
        start = time.perf_counter()
        if _libc.madvise(base, nbytes, advice) != 0:
            row["error"] = os.strerror(ctypes.get_errno())
        advise_s = time.perf_counter() - start
    pieces = _split(nbytes, threads)
    touch = _parallel(threads, lambda o, n: _libc.memset(base + o, 1, n), pieces)
    again = _parallel(threads, lambda o, n: _libc.memset(base + o, 2, n), pieces)
    row.update(advise_s=round(advise_s, 4), first_gbs=round(nbytes / 1e9 / (advise_s + touch), 2),
               warm_gbs=round(nbytes / 1e9 / again, 2))
    with contextlib.suppress(BufferError):
        m.close()
    return row


def file_reads(nbytes: int, folder: str | None) -> list[dict[str, Any]]:
    rows = []
    nbytes = max(1, nbytes >> 20) << 20
    with tempfile.NamedTemporaryFile(dir=folder) as f:
        block = os.urandom(1 << 20)
        for _ in range(nbytes >> 20):
            f.write(block)
        f.flush()
        out = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        out_addr = _address(out)
        _parallel(16, lambda o, n: _libc.memset(out_addr + o, 0, n), _split(nbytes, 16))  # warm
        src = mmap.mmap(f.fileno(), nbytes, flags=mmap.MAP_SHARED)
        src_addr = _address(src)
        view = memoryview(out)
        pieces = [(o, min(16 << 20, nbytes - o)) for o in range(0, nbytes, 16 << 20)]
        for threads in (1, 4, 12):
            pread = _parallel(threads, lambda o, n: os.preadv(f.fileno(), [view[o:o + n]], o), pieces)
            mapped = _parallel(threads, lambda o, n: _libc.memmove(out_addr + o, src_addr + o, n), pieces)
            rows.append({"threads": threads, "preadv_gbs": round(nbytes / 1e9 / pread, 2),
                         "mmap_memmove_gbs": round(nbytes / 1e9 / mapped, 2)})
        view.release()
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gib", type=float, default=2.0)
    p.add_argument("--dir", default="/dev/shm" if os.path.isdir("/dev/shm") else None)
    p.add_argument("--json")
    args = p.parse_args()
    nbytes = int(args.gib * (1 << 30)) // 4096 * 4096
    result = {"first_touch": [first_touch(nbytes, t, a) for a in (None, MADV_HUGEPAGE, MADV_POPULATE_WRITE)
                              for t in (1, 4, 16)],
              "file_reads": file_reads(nbytes, args.dir)}
    print_and_save(result, args.json)


if __name__ == "__main__":
    main()
