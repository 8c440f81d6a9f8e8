"""How long a small device-to-host read waits while large copies to the host are queued on
another stream (the save path reads plane entropies and nvCOMP's compressed sizes back once
per batch while the previous batch's stored bytes are copied out), and what avoids the wait.

Rows (milliseconds, medians of ``--reps``):
- ``copy``: 4 KiB copied to pinned memory on the compute stream, then its event waited for,
  with 0 / 64 / 256 / 1024 MiB of D2H queued just before on a copy stream
  (``copy_behind_uploads``: of H2D, as a load queues them);
- ``nvcomp``: ckptzip's gdeflate ``encode_segments`` of 64 chunks of 64 KiB (its sizes read back), the same way;
- ``mapped``: the 4 KiB written into pinned host memory by a kernel (Triton, through the host
  pointer, which unified addressing maps) instead of copied, the same way;
- ``paced``: GB/s of 1 GiB copied out in 64 MiB pieces with at most 1, 2 or 4 in flight
  (a thread waiting for each piece's event before it queues one more).

    python3 bench/readback_probe.py --json $OUT/readback.json
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from ckptzip_bench.results import print_and_save

MIB = 1 << 20


class _HostPointer:
    """A pinned host tensor seen by Triton as a device pointer (unified addressing)."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t
        self.dtype = t.dtype

    def data_ptr(self) -> int:
        return self.t.data_ptr()


def _median_ms(fn: Callable[[], None], reps: int) -> float:
    out = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        out.append((time.perf_counter() - start) * 1e3)
    return round(statistics.median(out), 3)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--json")
    args = p.parse_args()
    import triton
    import triton.language as tl

    @triton.jit
    def _store(src, dst, n, BLOCK: tl.constexpr):  # noqa: ANN001, ANN202
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(dst + offs, tl.load(src + offs, mask=offs < n), mask=offs < n)

    dev = torch.device("cuda")
    compute = torch.cuda.current_stream(dev)
    copier = torch.cuda.Stream(dev)
    big = torch.randint(0, 255, (1024 * MIB,), dtype=torch.uint8, device=dev)
    host_big = torch.empty(1024 * MIB, dtype=torch.uint8, pin_memory=True)
    small = torch.arange(512, dtype=torch.int64, device=dev)
    host_small = torch.empty(512, dtype=torch.int64, pin_memory=True)
    mapped = _HostPointer(host_small)
    import numpy as np

    from ckptzip.codecs import get_codec
    codec = get_codec({"id": "gdeflate", "algorithm_type": 0}, "cuda")  # the engine's path, its sync included
    plane = (torch.randn(64 << 16, device=dev) * 0.02).view(torch.uint8)[3::4].contiguous()
    lengths = np.full(64, 64 << 10, dtype=np.int64)
    offsets = np.arange(64, dtype=np.int64) * (64 << 10)

    def queue(mib: int, upload: bool = False) -> None:
        if mib:
            copier.wait_stream(compute)
            with torch.cuda.stream(copier):
                if upload:
                    big[: mib * MIB].copy_(host_big[: mib * MIB], non_blocking=True)
                else:
                    host_big[: mib * MIB].copy_(big[: mib * MIB], non_blocking=True)

    def readback(kind: str, mib: int) -> Callable[[], None]:
        def run() -> None:
            copier.synchronize()
            queue(mib, upload=kind == "copy_behind_uploads")
            if kind in ("copy", "copy_behind_uploads"):
                host_small.copy_(small, non_blocking=True)
            elif kind == "mapped":
                _store[(1,)](small, mapped, small.numel(), BLOCK=512)
            else:
                codec.encode_segments(plane, offsets, lengths)
            done = torch.cuda.Event()
            done.record(compute)
            done.synchronize()
        return run

    for kind in ("copy", "mapped", "nvcomp"):  # warm up (compiles the kernel)
        readback(kind, 0)()
    assert torch.equal(host_small, small.cpu())
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    for kind in ("copy", "copy_behind_uploads", "mapped", "nvcomp"):
        result[kind] = {f"{mib}_mib_queued_ms": _median_ms(readback(kind, mib), args.reps) for mib in (0, 64, 256, 1024)}
    torch.cuda.synchronize()

    def paced(depth: int) -> float:
        pieces = [(o, 64 * MIB) for o in range(0, 1024 * MIB, 64 * MIB)]
        events: list[torch.cuda.Event] = []
        torch.cuda.synchronize()
        start = time.perf_counter()
        for o, n in pieces:
            while len(events) >= depth:
                events.pop(0).synchronize()
            with torch.cuda.stream(copier):
                host_big[o : o + n].copy_(big[o : o + n], non_blocking=True)
                e = torch.cuda.Event()
                e.record(copier)
                events.append(e)
        for e in events:
            e.synchronize()
        return round(1024 * MIB / 1e9 / (time.perf_counter() - start), 2)

    result["paced_gbs"] = {str(d): statistics.median(paced(d) for _ in range(3)) for d in (1, 2, 4, 16)}
    print_and_save(result, args.json)


if __name__ == "__main__":
    main()
