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
from ckptzip.engine import decode, encode, reader, staging, writer
from ckptzip.format import index
from ckptzip.format import writer as container
from ckptzip_bench.pipeline import DiscardSink
from engine_probe import synthetic_state

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
    (encode, "_assemble", "encode: assemble"),
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
    (writer.GpuLimits, "of", "save: memory budget"),
    (writer, "plan_batches", "save: plan"),
    (writer, "_encode_all", "save: encoding loop"),
    (writer._InOrder, "close", "pipeline close (waits for the tail)"),
    (api.CheckpointReader, "__init__", "load: open"),
    (index.Index, "parse", "load: index parse"),
    (reader, "read_tensors", "load: other"),
    (reader, "_decode_all", "load: decoding loop"),
    (reader._Uploader, "close", "load: uploader close"),
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


def _save(state: dict[str, torch.Tensor], preset: str) -> None:
    ckptzip.save(state, DiscardSink(), codec=preset)


def _load(data: bytes) -> None:
    ckptzip.load(data, map_location="cuda")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gb", type=float, default=12.0)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--presets", default="auto,fast")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--lanes", type=int, help="GPU batches coded at once (default: the engine's choice)")
    ap.add_argument("--json")
    args = ap.parse_args()
    state = synthetic_state(args.gb, args.layers)
    install()
    if args.lanes:
        writer.lanes = lambda budgets, batch_cap: args.lanes
    out: dict[str, Any] = {}
    for preset in args.presets.split(","):
        out[f"{preset} save"] = measure(f"{preset} save", functools.partial(_save, state, preset), args.reps)
        blob = io.BytesIO()
        ckptzip.save(state, blob, codec=preset)
        out[f"{preset} load"] = measure(f"{preset} load", functools.partial(_load, blob.getvalue()), args.reps)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
