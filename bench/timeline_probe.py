"""Where each thread of a GPU save and load spends its time, function by function.

Wraps the engine's stages (encoding, its host syncs, staging copies, the sink, the uploader and
the decoder) with timers that record each call's thread and self time (time in wrapped callees
taken out), runs warm saves to a file object that discards its input and loads from bytes in
host memory of a synthetic training state, and prints per thread the seconds of each stage
(medians over --reps). A stage whose time is mostly waiting (a sync, a queue, a pool) says so
in its name. Usage: python bench/timeline_probe.py --gb 12 --layers 16 --presets auto,fast
"""

from __future__ import annotations

import argparse
import collections
import functools
import io
import json
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

import ckptzip
from ckptzip import api
from ckptzip.codecs import nvcomp
from ckptzip.engine import decode, encode, plan, reader, staging, writer
from ckptzip.engine.policy import Policy
from ckptzip.format import index
from ckptzip.manager import _snapshot
from ckptzip.format import writer as container
from ckptzip_bench.pipeline import DiscardSink
from engine_probe import nbytes, synthetic_state

_local = threading.local()
_totals: dict[tuple[str, str], float] = collections.defaultdict(float)
_calls: dict[tuple[str, str], int] = collections.defaultdict(int)
_lock = threading.Lock()


def _timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        stack = getattr(_local, "stack", None)
        if stack is None:
            stack = _local.stack = []
        stack.append(0.0)
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            elapsed = time.perf_counter() - start
            children = stack.pop()
            if stack:
                stack[-1] += elapsed
            key = (threading.current_thread().name.split("_")[0], name)
            with _lock:
                _totals[key] += elapsed - children
                _calls[key] += 1
    return wrapper


STAGES: list[tuple[Any, str, str]] = [
    (encode, "encode_batch", "encode: other"),
    (encode, "split_planes", "encode: split planes (launch)"),
    (encode, "_plane_entropies", "encode: entropies (sync)"),
    (encode, "segment_sums", "encode: gather + sums (launch)"),
    (encode, "_choose_codecs", "encode: choose codecs"),
    (writer, "start_batch", "encode: start (other)"),
    (encode, "_queue_codecs", "encode: queue codecs"),
    (encode.PendingBatch, "finish", "encode: finish"),
    (writer, "_entropies_ahead", "save: entropies ahead"),
    (nvcomp, "_read", "nvcomp: read sizes (sync)"),
    (nvcomp._NvcompCodec, "_launch", "nvcomp: launch"),
    (writer._InOrder, "put", "queue put (waits when full)"),
    (writer._Sink, "_record", "sink: index records"),
    (container.ContainerWriter, "append", "sink: append"),
    (staging.PinnedPool, "acquire", "pinned pool acquire (waits)"),
    (torch.cuda.Event, "synchronize", "event synchronize (waits)"),
    (writer, "_finish", "finish (index)"),
    (reader._Uploader, "_read", "upload: read into pinned"),
    (reader._Uploader, "get", "decode: wait for upload"),
    (decode, "decode_batch", "decode: other"),
    (decode, "verify_digests", "decode: verify digests (sync)"),
    (decode, "_decode_coded", "decode: codecs"),
    (decode, "_rebuild", "decode: rebuild"),
    (reader, "verify_checksums", "load: verify checksums"),
    (api, "flatten", "save: flatten"),
    (writer, "write_state", "save: other"),
    (writer, "rewrite_table", "save: duplicates and casts"),
    (plan.GpuLimits, "of", "save: memory budget"),
    (plan, "save_batches", "save: plan"),
    (writer, "_encode_all", "save: encoding loop"),
    (writer._InOrder, "close", "pipeline close (waits for the tail)"),
    (api.CheckpointReader, "__init__", "load: open"),
    (index.Index, "parse", "load: index parse"),
    (reader, "read_tensors", "load: other"),
    (reader, "_decode_all", "load: decoding loop"),
    (reader._Uploader, "close", "load: uploader close"),
    (staging.PinnedPool, "reserve", "pinned pool reserve"),
    (staging.PinnedPool, "trim", "pinned pool trim"),
    (_snapshot.SnapshotPool, "take", "snapshot: take (other)"),
    (_snapshot.SnapshotPool, "_copy", "snapshot: device copies"),
    (writer, "stage_state", "snapshot: stage (other)"),
]


def install() -> None:
    for owner, attr, name in STAGES:
        setattr(owner, attr, _timed(name, getattr(owner, attr)))


def report(label: str, runs: list[dict[tuple[str, str], float]], walls: list[float]) -> dict[str, Any]:
    keys = sorted({k for r in runs for k in r})
    rows = {f"{thread} | {name}": round(statistics.median(r.get((thread, name), 0.0) for r in runs), 4)
            for thread, name in keys}
    print(f"\n{label}: wall {statistics.median(walls):.3f} s (median of {len(walls)})")
    for key, seconds in sorted(rows.items()):
        if seconds >= 0.002:
            print(f"  {seconds:8.3f}  {key}")
    return {"wall_s": statistics.median(walls), "stages_s": rows}


def measure(label: str, call: Callable[[], Any], reps: int) -> dict[str, Any]:
    call()  # warm
    runs, walls = [], []
    for _ in range(reps):
        torch.cuda.synchronize()
        _totals.clear()
        _calls.clear()
        start = time.perf_counter()
        call()
        torch.cuda.synchronize()
        walls.append(time.perf_counter() - start)
        runs.append(dict(_totals))
    return report(label, runs, walls)


def profiled(call: Callable[[], Any]) -> None:
    """Print where one more call's GPU time goes (torch.profiler), and how busy the GPU was."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    wall = time.perf_counter() - start
    events = prof.key_averages()
    busy = sum(e.self_device_time_total for e in events) / 1e6
    print(f"profiled: wall {wall:.3f} s (with the profiler), GPU busy {busy:.3f} s (kernels and copies, summed)")
    print(events.table(sort_by="self_device_time_total", row_limit=22, max_name_column_width=60))


def host_profiled(call: Callable[[], Any], rows: int = 30) -> None:
    """Print where one more call's calling thread spends its time, function by function
    (cProfile, own time first): what the per-batch host work of a GPU save is made of."""
    import cProfile
    import pstats

    torch.cuda.synchronize()
    profiler = cProfile.Profile()
    profiler.enable()
    call()
    torch.cuda.synchronize()
    profiler.disable()
    pstats.Stats(profiler).sort_stats("tottime").print_stats(rows)


def _save(state: dict[str, torch.Tensor], preset: str | Policy) -> None:
    ckptzip.save(state, DiscardSink(), codec=preset)


def _load(data: bytes) -> None:
    ckptzip.load(data, map_location="cuda")


def host_snapshots(gib: float, free: float, saves: int, wait_s: float) -> list[dict[str, Any]]:
    """Host snapshots of a ``gib`` GiB 7B-like state with ``free`` GiB of GPU memory left:
    ``prepare`` first, then ``saves`` saves; per save the seconds it blocked and its stages."""
    from ckptzip_bench.discard import written
    from ckptzip_bench.training_job import fill_gpu, llama_like_state

    state = llama_like_state(gib)
    filler = fill_gpu(int(free * (1 << 30)))
    manager = ckptzip.CheckpointManager("discard://timeline-host", keep_last=1, async_save=True, snapshot="host")
    manager.prepare(state)
    time.sleep(wait_s)
    rows = []
    for step in range(saves):
        torch.cuda.synchronize()
        _totals.clear()
        start = time.perf_counter()
        manager.save(step, state)
        torch.cuda.synchronize()
        blocked = time.perf_counter() - start
        stages = {f"{t} | {n}": round(v, 4) for (t, n), v in sorted(_totals.items()) if v >= 0.002}
        manager.wait()
        snapshots = manager._snapshots
        raw = sum(b.numel() for b in snapshots._free.get((torch.device("cpu"), True), []))
        rows.append({"save": step, "blocked_s": round(blocked, 4), "stages_s": stages,
                     "stored_gb": round(written("timeline-host") / 1e9, 3),
                     "pinned_gb": round((snapshots._staging.reserved + raw) / 1e9, 3),
                     "raw_share_gb": round(raw / 1e9, 3)})
        print(json.dumps(rows[-1]), flush=True)
    manager.close()
    del filler
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gb", type=float, default=12.0)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--presets", default="auto,fast")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--lanes", type=int, help="GPU batches coded at once (default: the engine's choice)")
    ap.add_argument("--batch-mib", type=int, help="GPU batch size of saves (default: the engine's)")
    ap.add_argument("--host-gib", type=float, help="also: host snapshots of a 7B-like state this large")
    ap.add_argument("--host-free", type=float, default=3.0, help="GiB of GPU memory left free for them")
    ap.add_argument("--host-saves", type=int, default=4)
    ap.add_argument("--free", type=float, help="saves only, with the GPU filled to leave this many GiB free")
    ap.add_argument("--chunk-kib", type=int, help="stored chunk size of every stream (default: each codec's)")
    ap.add_argument("--profile", action="store_true", help="also: torch.profiler's table of one more save")
    ap.add_argument("--host-profile", action="store_true",
                    help="also: cProfile of one more save's calling thread (its host work, function by function)")
    ap.add_argument("--json")
    args = ap.parse_args()
    install()
    if args.batch_mib:
        plan.SAVE_BATCH_BYTES["cuda"] = args.batch_mib << 20
    if args.lanes:
        plan.lanes = lambda budgets, batch_cap: args.lanes
    out: dict[str, Any] = {}
    if args.host_gib:
        out["host snapshots"] = host_snapshots(args.host_gib, args.host_free, args.host_saves, 10.0)
        torch.cuda.empty_cache()
    presets = [p for p in args.presets.split(",") if p]
    state = synthetic_state(args.gb, args.layers) if presets else {}
    filler = None
    if args.free is not None:
        from ckptzip_bench.training_job import fill_gpu

        filler = fill_gpu(int(args.free * (1 << 30)))
    for name in presets:
        preset = Policy(name, args.chunk_kib << 10) if args.chunk_kib else name
        out[f"{name} save"] = measure(f"{name} save", functools.partial(_save, state, preset), args.reps)
        sink = DiscardSink()
        ckptzip.save(state, sink, codec=preset)
        out[f"{name} save"]["ratio"] = round(nbytes(state) / sink.nbytes, 5)
        print(f"  ratio {out[f'{name} save']['ratio']}")
        if args.profile:
            profiled(functools.partial(_save, state, preset))
        if args.host_profile:
            host_profiled(functools.partial(_save, state, preset))
        if filler is not None:
            continue
        blob = io.BytesIO()
        ckptzip.save(state, blob, codec=preset)
        out[f"{name} load"] = measure(f"{name} load", functools.partial(_load, blob.getvalue()), args.reps)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
