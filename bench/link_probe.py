"""What the host side of one GPU can move: pinned copies each way (alone, and while host threads
copy into other pinned buffers, as a loader does), pageable copies, host memcpy by thread count,
and the cost of pinning memory that is already there (``cudaHostRegister``). Usage:

    python bench/link_probe.py --gb 4 --json out.json
"""

from __future__ import annotations

import argparse
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from ckptzip_bench.results import print_and_save

PIECE = 64 << 20


def _timed(fn) -> float:  # noqa: ANN001
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gb", type=float, default=4.0)
    ap.add_argument("--json")
    args = ap.parse_args()
    total = int(args.gb * 1e9) // PIECE * PIECE
    n = total // PIECE
    device_buf = torch.empty(total, dtype=torch.uint8, device="cuda")
    pinned = [torch.empty(PIECE, dtype=torch.uint8, pin_memory=True) for _ in range(16)]
    source = np.random.default_rng(0).integers(0, 255, total, dtype=np.uint8)  # pageable, touched
    stream = torch.cuda.Stream()
    out: dict[str, float] = {}

    def h2d() -> None:
        with torch.cuda.stream(stream):
            for i in range(n):
                device_buf[i * PIECE : (i + 1) * PIECE].copy_(pinned[i % 8], non_blocking=True)

    def d2h() -> None:
        with torch.cuda.stream(stream):
            for i in range(n):
                pinned[i % 8].copy_(device_buf[i * PIECE : (i + 1) * PIECE], non_blocking=True)

    for _ in range(2):
        out["h2d_pinned_gbps"] = total / _timed(h2d) / 1e9
        out["d2h_pinned_gbps"] = total / _timed(d2h) / 1e9

    def memcpy(threads: int) -> float:
        def one(i: int) -> None:
            np.copyto(pinned[8 + i % 8].numpy(), source[i * PIECE : (i + 1) * PIECE])
        with ThreadPoolExecutor(threads) as pool:
            start = time.perf_counter()
            list(pool.map(one, range(n)))
            return total / (time.perf_counter() - start) / 1e9

    for threads in (1, 2, 4, 8):
        out[f"memcpy_to_pinned_{threads}t_gbps"] = memcpy(threads)
    for threads in (1, 4):
        with ThreadPoolExecutor(1) as bg:
            running = bg.submit(lambda: [memcpy(threads) for _ in range(3)])
            out[f"h2d_pinned_with_{threads}t_memcpy_gbps"] = total / _timed(h2d) / 1e9
            running.result()

    def pageable() -> None:
        with torch.cuda.stream(stream):
            for i in range(n):
                device_buf[i * PIECE : (i + 1) * PIECE].copy_(torch.from_numpy(source[i * PIECE : (i + 1) * PIECE]),
                                                              non_blocking=True)

    out["h2d_pageable_gbps"] = total / _timed(pageable) / 1e9
    cudart = torch.cuda.cudart()
    start = time.perf_counter()
    err = cudart.cudaHostRegister(source.ctypes.data, total, 0)
    register_s = time.perf_counter() - start
    out["host_register_gbps"] = total / register_s / 1e9 if int(err) == 0 else -1.0
    if int(err) == 0:
        registered = torch.from_numpy(source)

        def from_registered() -> None:
            with torch.cuda.stream(stream):
                for i in range(n):
                    device_buf[i * PIECE : (i + 1) * PIECE].copy_(registered[i * PIECE : (i + 1) * PIECE],
                                                                  non_blocking=True)

        out["h2d_registered_gbps"] = total / _timed(from_registered) / 1e9
        start = time.perf_counter()
        cudart.cudaHostUnregister(source.ctypes.data)
        out["host_unregister_gbps"] = total / (time.perf_counter() - start) / 1e9
    print_and_save(out, args.json)


if __name__ == "__main__":
    main()
