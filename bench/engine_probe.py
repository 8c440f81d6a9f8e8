"""Probe the engine on one GPU: bit-exact round trips, then the pipeline's own speed.

Builds a synthetic training-like state on the GPU (fp32 weights, both AdamW moments, bf16
gradients; per-class value scales like real training) of about --gb gigabytes, checks that
save/load round-trips bit for bit for each preset, then times (medians of --reps, first calls
reported apart): save to a file object that discards its input, load from bytes in host memory,
GPU-resident encode/decode of the whole state, torch.save/torch.load on the same sinks, and a
profile of one save and one load. Usage: python bench/engine_probe.py --gb 10 --reps 3
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import subprocess
import sys
import time

import torch

import ckptzip
from ckptzip_bench.breakdown import profile_call
from ckptzip_bench.gpu import decode_resident, device_regions
from ckptzip_bench.pipeline import DiscardSink, first_call
from ckptzip_bench.pipeline import timed as pipeline_timed
from ckptzip_bench.results import breakdown_table
from ckptzip.codecs import cpu_threads
from ckptzip.engine.encode import encode_batch
from ckptzip.engine.policy import Policy
from ckptzip.engine.plan import save_batches as write_plan
from ckptzip.format import ContainerReader

CUDA = torch.device("cuda")


def synthetic_state(gb: float, layers: int, seed: int = 0, device: str = "cuda") -> dict:
    g = torch.Generator(device=device).manual_seed(seed)
    per_layer = gb * 1e9 / layers / 14  # bytes/param: 4 w + 4 m + 4 v + 2 g
    d = int((per_layer / 12) ** 0.5) // 64 * 64
    shapes = {"qkv": (3 * d, d), "proj": (d, d), "fc1": (4 * d, d), "fc2": (d, 4 * d), "ln1": (d,), "ln2": (d,),
              "b1": (4 * d,), "b2": (d,)}
    model, grads, opt = {}, {}, {}
    i = 0
    for layer in range(layers):
        for name, shape in shapes.items():
            key = f"layers.{layer}.{name}"
            w = torch.randn(shape, device=device, generator=g) * (0.02 if len(shape) == 2 else 1.0)
            model[key] = w
            grads[key] = (torch.randn(shape, device=device, generator=g) * 1e-3).bfloat16()
            m = torch.randn(shape, device=device, generator=g) * 1e-4
            opt[i] = {"step": torch.tensor(100.0), "exp_avg": m, "exp_avg_sq": m * m * 3 + 1e-12}
            i += 1
    return {"model": model, "grads": grads, "optimizer": {"state": opt, "param_groups": [{"lr": 1e-4, "params": list(range(i))}]}}


def nbytes(state) -> int:  # noqa: ANN001
    from ckptzip.tree import flatten
    return sum(t.tensor.numel() * t.tensor.element_size() for t in flatten(state).tensors)


def timed(fn, reps: int) -> tuple[float, float]:  # noqa: ANN001
    """(first call, median of the next ``reps``) in seconds, device synced around each."""
    first, _ = first_call(fn, CUDA)
    return first, statistics.median(pipeline_timed(fn, reps, CUDA))


def same(a, b) -> None:  # noqa: ANN001
    from ckptzip.demo.compare import assert_state_equal
    assert_state_equal(a, b)


def resident(state, policy: Policy, reps: int) -> dict:  # noqa: ANN001
    from ckptzip.tree import flatten
    tensors = [t.tensor for t in flatten(state).tensors]
    plan = list(write_plan(tensors, policy))

    def encode() -> None:
        for key, idx in plan:  # each result dropped before the next batch (the writer holds one or two)
            encode_batch([tensors[i] for i in idx], policy, key.backend)

    first_e, enc = timed(encode, reps)
    keep = io.BytesIO()
    ckptzip.save(state, keep, codec=policy)
    regions = device_regions(ContainerReader(keep.getvalue()))

    def decode() -> list:
        return decode_resident(regions)

    first_d, dec = timed(decode, reps)
    raw = sum(t.numel() * t.element_size() for t in tensors)
    return {"encode_s": enc, "decode_s": dec, "encode_gbps": raw / enc / 1e9, "decode_gbps": raw / dec / 1e9,
            "first_encode_s": first_e, "first_decode_s": first_d}


def profile(fn, label: str, trace_dir: str | None = None) -> None:  # noqa: ANN001
    breakdown, p = profile_call(fn, CUDA)
    print(f"\n--- where the time goes: {label} ({breakdown['wall_seconds']:.3f} s profiled) ---")
    print(breakdown_table(breakdown))
    print(f"--- profile: {label} (top 18 by self CPU time) ---")
    print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=40))
    print(f"--- profile: {label} (top 12 by device time) ---")
    print(p.key_averages().table(sort_by="self_device_time_total", row_limit=12, max_name_column_width=40))
    if trace_dir:
        import cProfile
        import pstats
        with cProfile.Profile() as cp:
            fn()
            torch.cuda.synchronize()
        print(f"--- cProfile: {label} (main thread, top 25 by own time) ---")
        pstats.Stats(cp).sort_stats("tottime").print_stats(25)
        p.export_chrome_trace(f"{trace_dir}/{label.replace(' ', '-')}.json")


_FRESH = """
import cProfile, io, pstats, sys, time, torch, ckptzip
from ckptzip_bench.pipeline import DiscardSink as Sink
from ckptzip.demo.training import train
state = train("tiny", 30, device="cuda", seed=0).state()
torch.cuda.synchronize()
cp = cProfile.Profile()
if sys.argv[1:] == ["profile"]: cp.enable()
t = time.perf_counter(); ckptzip.save(state, Sink()); torch.cuda.synchronize(); first = time.perf_counter() - t
cp.disable()
if sys.argv[1:] == ["profile"]: pstats.Stats(cp, stream=sys.stderr).sort_stats("cumtime").print_stats(30)
t = time.perf_counter(); ckptzip.save(state, Sink()); torch.cuda.synchronize(); second = time.perf_counter() - t
buf = io.BytesIO(); ckptzip.save(state, buf); data = buf.getvalue()
t = time.perf_counter(); ckptzip.load(data, map_location="cuda"); torch.cuda.synchronize(); load = time.perf_counter() - t
t = time.perf_counter(); torch.save(state, Sink()); ts = time.perf_counter() - t
print(first, second, load, ts)
"""


def fresh_process_first_save(profile_it: bool) -> dict:
    """First save/load of a fresh process on the tiny demo state (kernel caches warm on disk)."""
    runs = []
    for _ in range(2):
        out = subprocess.run([sys.executable, "-c", _FRESH], capture_output=True, text=True, check=True)
        runs.append([float(x) for x in out.stdout.split()[-4:]])
    if profile_it:
        out = subprocess.run([sys.executable, "-c", _FRESH, "profile"], capture_output=True, text=True, check=True)
        print("--- cProfile of the first save of a fresh process (a third such process) ---")
        print(out.stderr[-6000:])
    first, second, load, torch_save = runs[-1]
    return {"first_save_s": first, "second_save_s": second, "first_load_s": load, "torch_save_s": torch_save,
            "first_process_ever_first_save_s": runs[0][0]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gb", type=float, default=10.0, help="synthetic state size (without --preset)")
    ap.add_argument("--preset", help="train this model preset instead of a synthetic state")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--presets", default="auto,portable")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--trace", help="with --profile: write Chrome traces of the profiled save and load here")
    ap.add_argument("--no-torch", action="store_true", help="skip the torch.save/torch.load baselines")
    ap.add_argument("--cpu-ratio", action="store_true",
                    help="also save a host copy of the state on the CPU path (codec auto) and compare its ratio")
    ap.add_argument("--switch-interval", type=float,
                    help="sys.setswitchinterval first: how much the GIL's hand-offs between threads cost")
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.switch_interval:
        sys.setswitchinterval(args.switch_interval)
    if args.preset:
        from ckptzip.demo.training import train
        start = time.perf_counter()
        result = train(args.preset, args.steps, device="cuda", seed=0)
        state = result.state()
        print(f"trained {args.preset} {args.steps} steps in {time.perf_counter() - start:.1f} s, "
              f"loss {result.losses[0]:.3f} -> {result.losses[-1]:.3f}")
    else:
        state = synthetic_state(args.gb, args.layers)
    raw = nbytes(state)
    from ckptzip.tree import flatten
    print(f"state: {raw / 1e9:.2f} GB in {len(flatten(state).tensors)} tensors")
    results: dict = {"raw_bytes": raw, "presets": {}}
    for name in args.presets.split(","):
        keep = io.BytesIO()
        ckptzip.save(state, keep, codec=name)
        blob = keep.getvalue()
        back = ckptzip.load(io.BytesIO(blob), map_location="cuda")
        same(state, back)
        del back
        print(f"{name}: bit-exact, ratio {raw / len(blob):.4f}")
        first_s, save_s = timed(lambda: ckptzip.save(state, DiscardSink(), codec=name), args.reps)
        first_l, load_s = timed(lambda: ckptzip.load(io.BytesIO(blob), map_location="cuda"), args.reps)
        _, load_bytes_s = timed(lambda: ckptzip.load(blob, map_location="cuda"), args.reps)
        res = resident(state, Policy.parse(name), args.reps)
        r = {"ratio": raw / len(blob), "save_s": save_s, "load_s": load_s, "save_gbps": raw / save_s / 1e9,
             "load_bytes_s": load_bytes_s,
             "load_gbps": raw / load_s / 1e9, "first_save_s": first_s, "first_load_s": first_l, **res}
        results["presets"][name] = r
        if args.cpu_ratio and name == "auto":
            results["cpu_auto"] = cpu_ratio(blob, raw, r["ratio"])
            print(json.dumps({"cpu_auto": results["cpu_auto"]}))
        print(json.dumps({name: r}, indent=1))
        if args.profile:
            profile(lambda: ckptzip.save(state, DiscardSink(), codec=name), f"save {name}", args.trace)
            profile(lambda: ckptzip.load(io.BytesIO(blob), map_location="cuda"), f"load {name}", args.trace)
    if not args.no_torch:
        torch_baselines(state, raw, results)
    results["first_save_fresh_process"] = fresh_process_first_save(args.profile)
    print(json.dumps({"first_save_fresh_process": results["first_save_fresh_process"]}))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


def cpu_ratio(gpu_blob: bytes, raw: int, gpu_ratio: float) -> dict:
    """The CPU path's ratio on the same state (a host copy, saved with ``auto`` on the CPU
    backend), against the GPU's: issue 10 asks for it within 1 %."""
    host = ckptzip.load(gpu_blob, map_location="cpu")
    sink = DiscardSink()
    start = time.perf_counter()
    ckptzip.save(host, sink, codec="auto")
    seconds = time.perf_counter() - start
    ratio = raw / sink.nbytes
    return {"ratio": ratio, "of_gpu_auto": ratio / gpu_ratio, "save_s": seconds, "threads": cpu_threads()}


def torch_baselines(state, raw: int, results: dict) -> None:  # noqa: ANN001
    buf = io.BytesIO()
    _, ts = timed(lambda: torch.save(state, DiscardSink()), 1)
    torch.save(state, buf)
    tblob = buf.getvalue()
    _, tl = timed(lambda: torch.load(io.BytesIO(tblob), map_location="cuda", weights_only=True), 1)
    results["torch"] = {"save_s": ts, "load_s": tl, "save_gbps": raw / ts / 1e9, "load_gbps": raw / tl / 1e9}
    print(json.dumps({"torch": results["torch"]}))


if __name__ == "__main__":
    sys.exit(main())
