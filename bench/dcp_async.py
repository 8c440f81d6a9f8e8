"""``dcp.async_save``'s blocking time with ckptzip's writer (its own GPU staging) against
``FileSystemWriter`` (DCP's default stager), on one GPU, and when each save is done.

    python bench/dcp_async.py --gib 7.3 --saves 3 --dir /tmp/ckpt
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

from ckptzip.dcp import CompressedStorageReader, CompressedStorageWriter


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


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--gib", type=float, default=7.3)
    p.add_argument("--saves", type=int, default=3)
    p.add_argument("--dir", default=None)
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
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
