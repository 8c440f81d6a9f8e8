"""ckptzip on the CPU against torch.save / torch.load, and its ratio against byte planes + zstd-3.

Trains a model of ``ckptzip.demo.training`` on the CPU (or builds a synthetic state of fp32
weight- and moment-like tensors), then, pinned to 1, 2, ... cores (``os.sched_setaffinity`` in a
child process per core count, so ckptzip's threads and torch's see only those cores), saves and
loads it (saves into a file object that discards its input, loads from bytes in memory) with
ckptzip and with torch.save / torch.load. Prints medians (wall and process CPU seconds) of
``--reps`` runs after a warm-up, the scaling from 1 core to the most, and the ratio per tensor
class against the five-line baseline (:func:`planes_zstd3`)::

    python bench/cpu_bench.py                                   # tiny trained state, 1 and all cores
    python bench/cpu_bench.py --state synthetic --codec portable --cores 1,2,4,8,16
    CUDA_VISIBLE_DEVICES="" python bench/cpu_bench.py --preset medium --cores 1,16   # a GPU host's CPU

``--disk DIR`` times files instead: each method of ``ckptzip bench`` named by ``--methods``
(default ckptzip-auto, torch.save, safetensors, zipnn) saves into a fresh directory under DIR,
fsync included, and loads it back (page cache warm), medians of ``--reps``.
"""

from __future__ import annotations

import argparse
import collections
import io
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np
import torch
import zstandard

import ckptzip
from ckptzip.demo.training import tensor_class, train
from ckptzip.tree import flatten
from ckptzip_bench.methods import get_method
from ckptzip_bench.pipeline import DiscardSink


def planes_zstd3(t: torch.Tensor) -> int:
    """The baseline: every float tensor split into byte planes, zstd level 3 on each plane."""
    b = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
    k = t.element_size()
    if t.is_floating_point() and k > 1:
        return sum(len(zstandard.compress(np.ascontiguousarray(b.reshape(-1, k)[:, j]), 3)) for j in range(k))
    return len(zstandard.compress(b.tobytes(), 3))


def make_state(args: argparse.Namespace) -> dict[str, Any]:
    if args.state_file:  # the parent's, made once for every core count
        return torch.load(args.state_file, weights_only=True)
    if args.state == "trained":
        return train(args.preset, args.steps, device="cpu", seed=0).state()
    g = torch.Generator().manual_seed(0)
    layers = max(1, round(args.gb * 1e9 / (3 << 22)))  # three 4 MiB fp32 tensors a layer
    return {f"{kind}{i}": (torch.randn(1 << 20, generator=g) * scale) ** power
            for i in range(layers) for kind, scale, power in (("w", 0.02, 1), ("m", 1e-3, 1), ("v", 1e-2, 2))}


def _medians(fn: Any, reps: int) -> tuple[float, float]:
    """Median wall-clock and process CPU seconds of ``reps`` calls after one untimed call (the
    CPU seconds are what a loaded machine still measures fairly)."""
    fn()
    walls, cpus = [], []
    for _ in range(reps):
        wall, cpu = time.perf_counter(), time.process_time()
        fn()
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    return statistics.median(walls), statistics.median(cpus)


def measure_disk(args: argparse.Namespace, state: Any) -> dict[str, float]:
    """Each method's save into a fresh directory under ``args.disk`` (fsync included) and load,
    medians of ``args.reps`` after one untimed round."""
    row: dict[str, float] = {}
    for name in args.methods.split(","):
        method = get_method(name)
        if not method.available()[0]:
            continue
        saves, loads, written = [], [], 0
        for rep in range(args.reps + 1):
            directory = tempfile.mkdtemp(dir=args.disk)
            try:
                result = method.save(state, os.path.join(directory, "out"))
                _, seconds = method.load(os.path.join(directory, "out"))
            finally:
                shutil.rmtree(directory)
            if rep:
                saves.append(result.seconds)
                loads.append(seconds)
            written = result.bytes_written
        row[f"{name}_save_s"], row[f"{name}_load_s"] = statistics.median(saves), statistics.median(loads)
        row[f"{name}_bytes"] = written
    return row


def measure(args: argparse.Namespace) -> dict[str, float]:
    """Run in a child pinned to ``args.child`` cores."""
    os.sched_setaffinity(0, list(sorted(os.sched_getaffinity(0)))[: args.child])
    torch.set_num_threads(args.child)
    state = make_state(args)
    nbytes = sum(t.tensor.numel() * t.tensor.element_size() for t in flatten(state).tensors)
    if args.disk:
        return {"cores": args.child, "nbytes": nbytes, **measure_disk(args, state)}
    out = io.BytesIO()
    ckptzip.save(state, out, codec=args.codec)
    blob = out.getvalue()
    pt = io.BytesIO()
    torch.save(state, pt)
    row: dict[str, float] = {"cores": args.child, "nbytes": nbytes, "ratio": nbytes / len(blob)}
    for name, fn in (
        ("save", lambda: ckptzip.save(state, DiscardSink(), codec=args.codec)),
        ("load", lambda: ckptzip.load(blob)),
        ("torch_save", lambda: torch.save(state, DiscardSink())),
        ("torch_load", lambda: torch.load(io.BytesIO(pt.getvalue()), weights_only=True)),
    ):
        row[f"{name}_s"], row[f"{name}_cpu_s"] = _medians(fn, args.reps)
    if args.profile:
        from ckptzip_bench.breakdown import profile_call
        from ckptzip_bench.results import breakdown_table
        for name, fn in (("save", lambda: ckptzip.save(state, DiscardSink(), codec=args.codec)),
                         ("load", lambda: ckptzip.load(blob))):
            breakdown, _ = profile_call(fn, torch.device("cpu"))
            print(f"--- {name}, {args.child} cores ({breakdown['wall_seconds']:.3f} s profiled)\n"
                  f"{breakdown_table(breakdown)}", file=sys.stderr)
    return row


def class_ratios(args: argparse.Namespace) -> list[str]:
    state = make_state(args)
    out = io.BytesIO()
    ckptzip.save(state, out, codec=args.codec)
    totals: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0, 0])
    with ckptzip.open(io.BytesIO(out.getvalue())) as reader:
        for entry in reader.entries():
            t = reader[entry.name]
            for key in (tensor_class(entry.name, t), "total"):
                row = totals[key]
                row[0] += entry.nbytes
                row[1] += entry.compressed_nbytes
                row[2] += planes_zstd3(t)
    lines = ["| class | bytes | ckptzip ratio | planes + zstd-3 ratio |", "|---|---|---|---|"]
    for key, (n, c, b) in totals.items():
        lines.append(f"| {key} | {n} | {n / c:.4f} | {n / b:.4f}{' (ckptzip lower)' if c > b else ''} |")
    return lines


def print_disk(args: argparse.Namespace, rows: list[dict[str, float]]) -> None:
    names = [n for n in args.methods.split(",") if f"{n}_save_s" in rows[0]]
    print(f"{args.state} state ({args.preset}), {rows[0]['nbytes'] / 1e6:.1f} MB; files with fsync, "
          f"medians of {args.reps}\n")
    print("| cores | method | ratio | save s | load s | save / torch.save | load / torch.load |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        for n in names:
            print(f"| {r['cores']} | {n} | {r['nbytes'] / r[f'{n}_bytes']:.4f} | {r[f'{n}_save_s']:.3f} "
                  f"| {r[f'{n}_load_s']:.3f} | {r[f'{n}_save_s'] / r['torch.save_save_s']:.2f}x "
                  f"| {r[f'{n}_load_s'] / r['torch.save_load_s']:.2f}x |")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--state", choices=("trained", "synthetic"), default="trained")
    p.add_argument("--preset", default="tiny")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--gb", type=float, default=0.2, help="size of the synthetic state")
    p.add_argument("--profile", action="store_true", help="print where one save's and one load's time goes")
    p.add_argument("--codec", default="auto")
    p.add_argument("--cores", default=f"1,{len(os.sched_getaffinity(0))}", help="comma-separated core counts")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--disk", help="time saves (with fsync) and loads of files in this directory")
    p.add_argument("--methods", default="ckptzip-auto,torch.save,safetensors,zipnn", help="with --disk")
    p.add_argument("--child", type=int, help=argparse.SUPPRESS)
    p.add_argument("--state-file", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(measure(args)))
        return 0
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        # the state is made once, on every core, and read by each core count's child (training
        # a small model on one core took 90 s of a 2-core machine's time per child)
        state_file = os.path.join(scratch, "state.pt")
        torch.save(make_state(args), state_file)
        for cores in sorted({int(c) for c in args.cores.split(",")}):
            cmd = [sys.executable, __file__, *sys.argv[1:], "--child", str(cores), "--state-file", state_file]
            child = subprocess.run(cmd, check=True, capture_output=True, text=True)
            sys.stderr.write(child.stderr)
            rows.append(json.loads(child.stdout))
    if args.disk:
        print_disk(args, rows)
        return 0
    print(f"{args.state} state ({args.preset if args.state == 'trained' else '3 x 4 MiB fp32 a layer'}), codec={args.codec}, "
          f"{rows[0]['nbytes'] / 1e6:.1f} MB, ratio {rows[0]['ratio']:.4f}; medians of {args.reps}, in memory\n")
    print("| cores | ckptzip save s | load s | save GB/s | load GB/s | torch.save s | torch.load s | save / torch | "
          "load / torch | CPU s: save, load, torch.save, torch.load |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        gb = r["nbytes"] / 1e9
        print(f"| {r['cores']} | {r['save_s']:.3f} | {r['load_s']:.3f} | {gb / r['save_s']:.2f} | {gb / r['load_s']:.2f} "
              f"| {r['torch_save_s']:.3f} | {r['torch_load_s']:.3f} | {r['save_s'] / r['torch_save_s']:.2f}x "
              f"| {r['load_s'] / r['torch_load_s']:.2f}x | {r['save_cpu_s']:.3f}, {r['load_cpu_s']:.3f}, "
              f"{r['torch_save_cpu_s']:.3f}, {r['torch_load_cpu_s']:.3f} |")
    if len(rows) > 1:
        print(f"\nscaling {rows[0]['cores']} -> {rows[-1]['cores']} cores: save {rows[0]['save_s'] / rows[-1]['save_s']:.2f}x, "
              f"load {rows[0]['load_s'] / rows[-1]['load_s']:.2f}x\n")
    print("\n".join(class_ratios(args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
