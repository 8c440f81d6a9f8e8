"""How many bytes of device-to-host copies a save should queue ahead (``engine.staging``'s
``COPY_AHEAD_BYTES`` and ``COPY_REFILL_AT``): a small read back waits for every copy queued
before it, and the staging thread that queues them needs the GIL each time it wakes.

For each setting, on one GPU and a synthetic training-like state of ``--gb`` GB: ``ckptzip.save``
to a file object that discards its input (1 GiB batches), the same with ``gpu_memory`` capped
(small batches, as when training fills the GPU), and a ``CheckpointManager(snapshot="host")``
save (its blocking time: the encode and the copy of every stored byte to host memory). Medians
of ``--reps`` after one untimed call; the restored state is compared once, bit for bit.

    python3 bench/copy_window_probe.py --gb 12 --json $OUT/copy-window.json
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import time
from typing import Any

import torch

import ckptzip
from ckptzip.engine import staging
from ckptzip_bench.pipeline import DiscardSink
import training_job  # noqa: F401  (registers the discard:// store)
from engine_probe import nbytes, same, synthetic_state

MIB = 1 << 20
# (limit MiB, refill fraction); "unbounded" is the behaviour before the limit existed
SETTINGS = [(64, 0.0), (128, 0.5), (128, 1.0), (256, 0.5), (512, 0.5), (1024, 0.5), (1 << 30, 1.0)]


def _seconds(fn: Any) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def _median(fn: Any, reps: int) -> float:
    fn()
    return round(statistics.median(_seconds(fn) for _ in range(reps)), 4)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gb", type=float, default=12.0)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--small-batches-mib", type=int, default=1536, help="gpu_memory of the capped saves")
    p.add_argument("--json")
    args = p.parse_args()
    state = synthetic_state(args.gb, 16)
    size = nbytes(state)
    blob = io.BytesIO()
    ckptzip.save(state, blob)
    same(state, ckptzip.load(blob.getvalue(), map_location="cuda"))  # raises unless bit-exact
    rows = []
    cap = args.small_batches_mib * MIB
    manager = ckptzip.CheckpointManager("discard://window", keep_last=1, snapshot="host", gpu_memory=cap)
    step = 0

    def host_snapshot() -> None:
        nonlocal step
        manager.save(step, state)
        step += 1

    for limit, refill in SETTINGS:
        staging.COPY_AHEAD_BYTES, staging.COPY_REFILL_AT = limit * MIB, refill
        whole = _median(lambda: ckptzip.save(state, DiscardSink()), args.reps)
        small = _median(lambda: ckptzip.save(state, DiscardSink(), gpu_memory=cap), args.reps)
        blocked = []
        for _ in range(args.reps + 1):
            blocked.append(_seconds(host_snapshot))
            manager.wait()
        row = {"limit_mib": limit if limit < 1 << 20 else "unbounded", "refill_at": refill,
               "save_s": whole, "save_gbs": round(size / 1e9 / whole, 1),
               "capped_save_s": small, "capped_save_gbs": round(size / 1e9 / small, 1),
               "host_snapshot_blocked_s": round(statistics.median(blocked[1:]), 4)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    manager.close()
    result = {"device": torch.cuda.get_device_name(), "state_gb": round(size / 1e9, 2), "bit_exact": True,
              "capped_gpu_memory_mib": args.small_batches_mib, "rows": rows}
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
