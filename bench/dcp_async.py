"""``dcp.async_save``'s blocking time with ckptzip's writer (its own GPU staging) against
``FileSystemWriter`` (DCP's default stager), on one GPU, and when each save is done; with
``--free``, ``dcp.save``, ``dcp.async_save`` and ``dcp.load`` through ckptzip with the GPU filled
so that only that many GiB stay free beside the state (and beside the tensors a load fills).

    python bench/dcp_async.py --gib 7.3 --saves 3 --free 1 --dir /tmp/ckpt
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException

from ckptzip.dcp import CompressedStorageReader, CompressedStorageWriter
from ckptzip_bench.training_job import fill_gpu


def flat_state(gib: float) -> dict[str, torch.Tensor]:
    """fp32 weights N(0, 0.02) and both AdamW moments, in 4096 x 4096 tensors."""
    g = torch.Generator(device="cuda").manual_seed(2)
    n = max(1, int(gib * (1 << 30) / (3 * 4096 * 4096 * 4)))
    state = {}
    for i in range(n):
        state[f"w{i}"] = torch.randn(4096, 4096, generator=g, device="cuda") * 0.02
        state[f"m{i}"] = torch.randn(4096, 4096, generator=g, device="cuda") * 1e-4
        state[f"v{i}"] = torch.rand(4096, 4096, generator=g, device="cuda") * 1e-8
    return state


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(a[k].view(torch.int32), b[k].view(torch.int32)) for k in b)


def filled(state: dict[str, torch.Tensor], leave_gib: float, root: str) -> dict[str, object]:
    """Save (sync and async) and load through ckptzip with ``leave_gib`` GiB free."""
    target = {k: torch.empty_like(v) for k, v in state.items()}  # what the load fills, allocated first
    filler = fill_gpu(int(leave_gib * (1 << 30)))
    row: dict[str, object] = {"writer": "ckptzip", "free_gib": leave_gib}
    try:
        torch.cuda.synchronize()
        t = time.perf_counter()
        dcp.save(state, storage_writer=CompressedStorageWriter(f"{root}/sync"), no_dist=True)
        row["save_s"] = round(time.perf_counter() - t, 3)
        t = time.perf_counter()
        future = dcp.async_save(state, storage_writer=CompressedStorageWriter(f"{root}/async"), no_dist=True)
        row["async_block_s"] = round(time.perf_counter() - t, 3)
        future.result()
        for name in ("sync", "async"):
            torch.cuda.synchronize()
            t = time.perf_counter()
            dcp.load(target, storage_reader=CompressedStorageReader(f"{root}/{name}"), no_dist=True)
            torch.cuda.synchronize()
            row[f"load_{name}_s"] = round(time.perf_counter() - t, 3)
            row[f"bit_exact_{name}"] = same(target, state)
            for v in target.values():
                v.zero_()
    except (Exception, CheckpointException) as exc:  # a failure is a result too (DCP's is a BaseException)
        row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    row["reserved_mib"] = torch.cuda.memory_reserved() >> 20
    del filler, target
    torch.cuda.empty_cache()
    return row


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--gib", type=float, default=7.3)
    p.add_argument("--saves", type=int, default=3)
    p.add_argument("--dir", default=None)
    p.add_argument("--free", default="", help="GiB left free for the filled runs, comma-separated")
    args = p.parse_args()
    state = flat_state(args.gib)
    size = sum(t.nbytes for t in state.values())
    root = tempfile.mkdtemp(dir=args.dir)
    for name, make in (("ckptzip", CompressedStorageWriter), ("FileSystemWriter", FileSystemWriter)):
        blocks, totals = [], []
        for k in range(args.saves):
            path = f"{root}/{name}-{k}"
            torch.cuda.synchronize()
            t = time.perf_counter()
            future = dcp.async_save(state, storage_writer=make(path), no_dist=True)
            blocks.append(round(time.perf_counter() - t, 3))
            future.result()
            totals.append(round(time.perf_counter() - t, 3))
        if name == "ckptzip":
            target = {k: torch.empty_like(v) for k, v in state.items()}
            dcp.load(target, storage_reader=CompressedStorageReader(f"{root}/{name}-0"), no_dist=True)
            exact = all(torch.equal(target[k].view(torch.int32), state[k].view(torch.int32)) for k in state)
        else:
            exact = None
        print(json.dumps({"writer": name, "state_gb": round(size / 1e9, 2), "blocks_s": blocks, "done_s": totals,
                          "bit_exact": exact}), flush=True)
        shutil.rmtree(root, ignore_errors=True)
        root = tempfile.mkdtemp(dir=args.dir)
    for leave in [float(x) for x in args.free.split(",") if x]:
        print(json.dumps(filled(state, leave, root) | {"state_gb": round(size / 1e9, 2)}), flush=True)
        shutil.rmtree(root, ignore_errors=True)
        root = tempfile.mkdtemp(dir=args.dir)
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
