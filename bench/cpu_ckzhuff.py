#!/usr/bin/env python3
"""ckz-huff's C decoder (codecs/_ckzhuff.c) on one CPU core, on the chunks the GPU writes (issue 46).

The sign/exponent byte planes of a trained-like state (bench/coder_gpu.py's ``trained_like``, made
on the CPU: fp32 weights after AdamW steps, AdamW's exp_avg and exp_avg_sq, bf16 gradients;
``--plane-mib`` MiB each) are coded in 256 KiB chunks by the CPU encoder, whose bytes are the GPU
coder's, then decoded on one thread: the first call apart, then the median of ``--reps`` calls,
in GB/s of decoded bytes. Every decode is checked bit-exact against the plane. Run it on a GPU
host's CPU with CUDA hidden, so nothing but the CPU is timed::

    python3 setup.py -q build_ext --inplace
    CUDA_VISIBLE_DEVICES="" PYTHONPATH=src python3 bench/cpu_ckzhuff.py --json "$OUT/cpu_ckzhuff.json"

``--threads N`` also times N threads (each a share of the chunks). Exit status: 0, or 1 where a
decode is not bit-exact.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from typing import Any

import numpy as np
import torch

from ckptzip.codecs import codec_threads, get_codec
from coder_gpu import chunks_of, high_plane, trained_like

GB = 1e9
CHUNK = 256 << 10  # the GPU coder's chunk


def planes(mib: int, seed: int) -> dict[str, torch.Tensor]:
    """The four classes' sign/exponent planes, ``mib`` MiB each."""
    g = torch.Generator().manual_seed(seed)
    t = trained_like((mib << 20) // 4096, 4096, 3, g)
    return {"fp32 weights": high_plane(t["weight"]), "exp_avg": high_plane(t["exp_avg"]),
            "exp_avg_sq": high_plane(t["exp_avg_sq"]), "bf16 grads": high_plane(t["grad"])}


def timed(fn: Any, reps: int) -> tuple[float, float]:
    """The first call's seconds and the median of ``reps`` more."""
    start = time.perf_counter()
    fn()
    first = time.perf_counter() - start
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return first, statistics.median(times)


def measure(name: str, plane: torch.Tensor, reps: int, threads: list[int]) -> dict[str, Any]:
    """One plane: its ratio, and decode GB/s on each thread count (bit-exact or ``exact`` False)."""
    codec = get_codec({"id": "ckz-huff"}, "cpu")
    offsets, lengths = chunks_of(plane.numel(), CHUNK)
    out, out_offsets, sizes = codec.encode_segments(plane, offsets, lengths)
    back = torch.empty_like(plane)
    forms = np.array([int(out[int(o)]) for o in out_offsets])  # each chunk's form: its first byte
    row: dict[str, Any] = {"plane": name, "bytes": plane.numel(), "ratio": plane.numel() / int(sizes.sum()),
                           "huffman_chunks": int((forms == 2).sum()), "chunks": int(forms.size)}
    for n in threads:
        back.fill_(0)
        with codec_threads(n):
            first, median = timed(lambda: codec.decode_segments(out, out_offsets, sizes, back, offsets, lengths), reps)
        row[f"{n}_threads_gbs"] = plane.numel() / median / GB
        row[f"{n}_threads_first_s"] = first
        row["exact"] = row.get("exact", True) and bool(torch.equal(back, plane))
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--plane-mib", type=int, default=32, help="bytes of each class's plane (MiB)")
    parser.add_argument("--reps", type=int, default=7, help="timed calls after the first (median)")
    parser.add_argument("--threads", type=int, default=1, help="also time this many threads (1: one core only)")
    parser.add_argument("--seed", type=int, default=46)
    parser.add_argument("--json", help="write the results here too")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # the planes' synthesis aside, nothing else runs beside the decoder
    threads = sorted({1, args.threads})
    print(f"{platform.processor() or platform.machine()} | torch {torch.__version__} | planes of {args.plane_mib} MiB "
          f"in {CHUNK >> 10} KiB chunks | medians of {args.reps}", flush=True)
    header = f"{'plane':<14}{'ratio':>8}{'huffman':>9}" + "".join(f"{f'{n} thr GB/s':>13}{'1st s':>8}" for n in threads)
    print(header + "\n" + "-" * len(header), flush=True)
    rows = []
    for name, plane in planes(args.plane_mib, args.seed).items():
        row = measure(name, plane, args.reps, threads)
        rows.append(row)
        print(f"{name:<14}{row['ratio']:>8.3f}{row['huffman_chunks']:>5}/{row['chunks']:<3}"
              + "".join(f"{row[f'{n}_threads_gbs']:>13.3f}{row[f'{n}_threads_first_s']:>8.3f}" for n in threads)
              + ("" if row["exact"] else "  NOT BIT-EXACT"), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "plane_mib": args.plane_mib, "reps": args.reps}, f, indent=1)
    return 0 if all(r["exact"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
