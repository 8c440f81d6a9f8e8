"""GPU memory that ckptzip's work takes outside torch's allocator, and what fails without it.

A save or load sizes its batches from torch's view of the GPU (free memory plus torch's unused
cache). Memory the driver hands out behind torch's back (kernel modules loaded on first use,
local memory grown for a kernel that needs more per thread, library workspaces) is not in that
view: on a filled GPU it is where "out of memory" comes from although torch's allocator never
failed. For each operation this probe prints the driver's free memory taken beyond what torch
reserved: its first call with the GPU empty, then with the GPU filled so that only ``--leave``
MiB stay free, and the error where one was raised; first, the scratch nvCOMP asks of torch per
codec and number of chunks in a launch.

    python bench/hidden_memory_probe.py --leave 512,384,320,288
"""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Callable
from typing import Any

import torch

import ckptzip
from ckptzip.engine import memory
from ckptzip_bench.training_job import fill_gpu

MIB = 1 << 20


def driver_free() -> int:
    torch.cuda.synchronize()
    return int(torch.cuda.mem_get_info()[0])


def operations() -> dict[str, Callable[[], Any]]:
    """Each GPU path once on a small tensor whose input exists before the GPU is filled; a
    decompression reads what the compression before it wrote."""
    g = torch.Generator(device="cuda").manual_seed(3)
    w = torch.randn(1 << 22, generator=g, device="cuda") * 0.02  # 16 MiB fp32
    b = (torch.randn(1 << 22, generator=g, device="cuda") * 1e-3).bfloat16()
    coded: dict[str, bytes] = {}

    def save(codec: str) -> Callable[[], Any]:
        def run() -> None:
            coded[codec] = ckptzip.compress(w, codec=codec).to_bytes()
        return run

    def load(codec: str) -> Callable[[], Any]:
        return lambda: ckptzip.decompress(coded[codec], device="cuda")

    ops: dict[str, Callable[[], Any]] = {}
    for codec in ("auto", "fast", "portable"):
        ops[f"compress {codec}"] = save(codec)
        ops[f"decompress {codec}"] = load(codec)
    ops["compress auto bf16"] = lambda: ckptzip.compress(b, codec="auto")
    return ops


def scratch_sizes() -> list[dict[str, Any]]:
    """nvCOMP's scratch (from torch's allocator) per codec for a launch of ``count`` chunks of
    each codec's chunk size: what a filled GPU must hold beside a batch's buffers."""
    from ckptzip.codecs import nvcomp
    from ckptzip.engine.policy import codec_for

    rows = []
    for config in ({"id": "zstd", "level": 3}, {"id": "gdeflate", "algorithm_type": 0}, {"id": "ans", "data_type": "|u1"}):
        codec = codec_for(config, "cuda")
        lib = nvcomp._library(codec.codec_id)
        for count in (1, 16, 256, 4096, 65536):
            chunk = codec.chunk_bytes
            row = {"codec": codec.codec_id, "chunk_kib": chunk >> 10, "count": count}
            for decompress in (False, True):
                temp = lib.temp_bytes(codec._format, decompress, count, chunk, count * chunk)
                row["decode_mib" if decompress else "encode_mib"] = round(temp / MIB, 2)
            rows.append(row)
    return rows


def attempt(op: Callable[[], Any]) -> dict[str, Any]:
    reserved, free = torch.cuda.memory_reserved(), driver_free()
    row: dict[str, Any] = {}
    try:
        out = op()
        del out
    except Exception as exc:
        row["error"] = memory.failure_line(exc)[:300]
    hidden = (free - driver_free()) - (torch.cuda.memory_reserved() - reserved)
    row["hidden_mib"] = round(hidden / MIB, 1)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--leave", default="512,384,320,288", help="MiB left free, comma-separated")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.zeros(1, device="cuda")
    ops = operations()
    for row in scratch_sizes():
        print(json.dumps(row), flush=True)
    for name, op in ops.items():  # the first call of each, with the GPU empty
        print(json.dumps({"leave_mib": None, "op": name} | attempt(op)), flush=True)
    for leave in (int(x) for x in args.leave.split(",") if x):
        for name, op in ops.items():
            filler = fill_gpu(leave * MIB)
            print(json.dumps({"leave_mib": leave, "op": name, "free_mib": driver_free() // MIB} | attempt(op)),
                  flush=True)
            del filler
    torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
