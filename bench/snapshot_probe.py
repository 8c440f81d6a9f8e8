"""CheckpointManager's stall on one GPU, by snapshot kind, for large states: how long ``save``
blocks the caller against a device-to-device copy of the state, the extra GPU memory a save
takes, and how long until the checkpoint is committed (that part is bound by storage).

The state is synthetic and training-like (engine_probe.synthetic_state) so that 30+ GB states
need no training run. Usage:

    python bench/snapshot_probe.py --gb 10 34 --saves 3 --dir /tmp --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch

from ckptzip.manager import CheckpointManager
from ckptzip.tree import flatten
from engine_probe import synthetic_state


def _clone_seconds(tensors: list[torch.Tensor]) -> float:
    times = []
    for _ in range(3):
        torch.cuda.synchronize()
        start = time.perf_counter()
        copies = [t.clone() for t in tensors]
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        del copies
    return statistics.median(times)


def probe(state: dict, mode: str, saves: int, directory: str) -> dict:
    tensors = [item.tensor for item in flatten(state).tensors]
    blocked, commit, extra = [], [], []
    with tempfile.TemporaryDirectory(dir=directory) as root, CheckpointManager(root, snapshot=mode, keep_last=1) as m:
        for step in range(1, saves + 1):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            free_before, _ = torch.cuda.mem_get_info()
            allocated = torch.cuda.memory_allocated()
            start = time.perf_counter()
            future = m.save(step, state)
            blocked.append(time.perf_counter() - start)
            tensors[0].add_(0.0)  # the next training kernel, ordered after the snapshot
            low = free_before
            while not future.done():
                low = min(low, torch.cuda.mem_get_info()[0])
                time.sleep(0.005)
            future.result()
            commit.append(time.perf_counter() - start)
            extra.append(max(torch.cuda.max_memory_allocated() - allocated, free_before - low))
        chosen = m.last_snapshot
    return {"mode": mode, "chose": chosen, "blocked_s": blocked, "blocked_s_median": statistics.median(blocked[1:] or blocked),
            "first_blocked_s": blocked[0], "commit_s_median": statistics.median(commit[1:] or commit),
            "extra_gpu_gb_max": max(extra) / 1e9}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gb", type=float, nargs="+", default=[10.0])
    ap.add_argument("--modes", default="device,host")
    ap.add_argument("--saves", type=int, default=3)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--json")
    args = ap.parse_args()
    results = []
    for gb in args.gb:
        state = synthetic_state(gb, 48)
        tensors = [item.tensor for item in flatten(state).tensors]
        raw = sum(t.nbytes for t in tensors)
        clone_s = _clone_seconds(tensors)
        for mode in args.modes.split(","):
            r = {"state_gb": raw / 1e9, "tensors": len(tensors), "d2d_clone_s": clone_s, **probe(state, mode, args.saves, args.dir)}
            r["blocked_over_clone"] = r["blocked_s_median"] / clone_s
            results.append(r)
            print(json.dumps(r))
        del state, tensors
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
