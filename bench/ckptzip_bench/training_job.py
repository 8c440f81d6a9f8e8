"""ckptzip under a training job's conditions (issue 21), on one GPU.

Parts (``--parts``, comma-separated):
- ``filled``: a state of 7B-like shapes (fp32 weights and both AdamW moments, bf16 gradients);
  the GPU filled so that only ``--free`` GiB stay free beside it; save to a file object that
  discards its input, and load from bytes in host memory with the same room beside the tensors
  returned; bit-exact against the state; speed against the unconstrained run of the same process.
- ``repeat``: many saves and loads of one state in one process, ``memory_reserved()`` after each.
- ``manager``: ``CheckpointManager(snapshot="auto")`` with the GPU filled as training fills it:
  what it chose and why, how long ``save()`` blocked, reserved memory after each save.
- ``host``: host snapshots of a large state (``--host-gib``) with ``--host-free`` GiB free, to
  a store that discards checkpoint bytes (storage is measured separately): how long each
  ``save()`` blocked, with ``manager.prepare(state)`` called when the job starts and without it,
  the pinned staging held and the process's host RSS against the compressed size.
- ``fresh``: new processes with empty Triton and ckptzip caches (a new node): first save and
  first load with the kernels ckptzip ships compiled, with Triton compiling them
  (``CKPTZIP_AOT_KERNELS=0``), and with ``ckptzip.warmup()`` started when the job starts, against
  a warm process.

Prints one JSON object per measurement (``--json`` collects them in a file) and a table last.

    ckptzip bench training-job --gib 32 --free 1,2,3 --parts filled,repeat,manager,fresh
    python -m ckptzip_bench.training_job ...   (the same, from bench/ of a checkout)
"""

from __future__ import annotations

import argparse
import collections
import faulthandler
import io
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, BinaryIO, cast

import numpy as np
import torch

import ckptzip
from ckptzip.memory.gpu import available as available_gpu_memory
from .oomtrace import recording, summary
from .pipeline import discard_sink

GIB = 1 << 30
RESULTS: list[dict[str, Any]] = []


def report(**row: Any) -> None:
    RESULTS.append(row)
    print(json.dumps(row), flush=True)


class Memory(io.RawIOBase):
    """A binary file into one preallocated host buffer (no regrowth, unlike BytesIO)."""

    def __init__(self, capacity: int) -> None:
        self.buffer = np.empty(capacity, dtype=np.uint8)
        self.n = 0

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        view = np.frombuffer(memoryview(b).cast("B"), dtype=np.uint8)
        self.buffer[self.n : self.n + view.size] = view
        self.n += view.size
        return view.size

    def data(self) -> memoryview:
        return memoryview(self.buffer.data)[: self.n]

    def file(self) -> BinaryIO:
        return cast(BinaryIO, self)  # a RawIOBase is a binary file object; typeshed says otherwise


def host_rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("VmRSS:"))


def llama_like_state(gib: float, device: str = "cuda", seed: int = 1) -> dict[str, torch.Tensor]:
    """Tensors of a 7B Llama's shapes (hidden 4096, MLP 11008, vocabulary 32000), as many layers
    as ``gib`` allows: fp32 weights N(0, 0.02), AdamW moments, bf16 gradients."""
    g = torch.Generator(device=device).manual_seed(seed)
    shapes: dict[str, tuple[int, ...]] = {"embed": (32000, 4096), "head": (32000, 4096)}
    per_layer: dict[str, tuple[int, ...]] = {"q": (4096, 4096), "k": (4096, 4096), "v": (4096, 4096), "o": (4096, 4096),
                 "gate": (11008, 4096), "up": (11008, 4096), "down": (4096, 11008), "norm": (4096,)}
    layer_bytes = sum(int(np.prod(s)) for s in per_layer.values()) * 14
    fixed = sum(int(np.prod(s)) for s in shapes.values()) * 14
    layers = max(1, int((gib * GIB - fixed) // layer_bytes))
    for i in range(layers):
        shapes.update({f"layers.{i}.{k}": s for k, s in per_layer.items()})
    state: dict[str, torch.Tensor] = {}
    for name, shape in shapes.items():
        w = torch.randn(shape, generator=g, device=device) * 0.02
        state[f"model.{name}"] = w
        state[f"opt.{name}.exp_avg"] = torch.randn(shape, generator=g, device=device) * 1e-4
        state[f"opt.{name}.exp_avg_sq"] = torch.rand(shape, generator=g, device=device) * 1e-8
        state[f"grad.{name}"] = (torch.randn(shape, generator=g, device=device) * 1e-3).bfloat16()
    return state


def nbytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def fill_gpu(leave: int) -> torch.Tensor | None:
    """Allocate what is free on the GPU except ``leave`` bytes (as training's tensors would)."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info()
    take = free - leave
    return torch.empty(take, dtype=torch.uint8, device="cuda") if take > 0 else None


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8)) for k in a)


def same_on_host(restored: dict[str, torch.Tensor], state: dict[str, torch.Tensor]) -> bool:
    """``same`` for tensors restored to the host: each state tensor is copied to the host in turn
    (the GPU has no room for the restored copy)."""
    return restored.keys() == state.keys() and all(
        torch.equal(restored[k].reshape(-1).view(torch.uint8), state[k].reshape(-1).view(torch.uint8).cpu())
        for k in state)


def mib(n: int) -> float:
    return round(n / (1 << 20), 1)


def timed(fn: Any) -> tuple[float, Any]:
    torch.cuda.synchronize()
    t = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t, out


class OutOfMemoryCount(logging.Handler):
    """Counts the engine's log records of batches that ran out of GPU memory."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.count = 0
        self.reasons: collections.Counter[str] = collections.Counter()

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "ran out of memory" in message:
            self.count += 1
            # "... ran out of memory on cuda:0 (<the failure>); coding batches ..."
            self.reasons[message.partition(" ran out of memory on ")[2].partition(" (")[2].rpartition("); ")[0]] += 1


def part_filled(args: argparse.Namespace) -> None:
    retries = OutOfMemoryCount()
    logging.getLogger("ckptzip").addHandler(retries)
    logging.getLogger("ckptzip").setLevel(logging.INFO)
    state = llama_like_state(args.gib)
    size = nbytes(state)
    sink = Memory(size + (1 << 30))
    ckptzip.save(state, sink.file())  # the bytes the loads read, and a first save (compiles, creates codecs)
    data = sink.data()
    base_save = [timed(lambda: ckptzip.save(state, discard_sink()))[0] for _ in range(3)]
    base_load: list[float] = []
    for _ in range(2):
        seconds, out = timed(lambda: ckptzip.load(data))
        base_load.append(seconds)
        del out
    report(part="filled", free_gib=None, state_gb=round(size / 1e9, 2), ratio=round(size / sink.n, 4),
           save_s=[round(s, 3) for s in base_save], save_gbs=round(size / 1e9 / statistics.median(base_save), 1),
           load_s=[round(s, 3) for s in base_load], load_gbs=round(size / 1e9 / statistics.median(base_load), 1))
    for leave in [] if args.loads_only else args.free:
        filler = fill_gpu(int(leave * GIB))
        row: dict[str, Any] = {"part": "filled", "free_gib": leave}
        retries.count = 0
        retries.reasons.clear()
        try:
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            budget = available_gpu_memory(torch.device("cuda", 0))
            with recording(args.trace_oom):
                saves = [timed(lambda: ckptzip.save(state, discard_sink()))[0] for _ in range(3)]
            if args.trace_oom and retries.count:
                row["oom_trace"] = summary()
            row.update(budget_mib=mib(budget), peak_beside_state_mib=mib(torch.cuda.max_memory_allocated() - before))
            row.update(save_s=[round(s, 3) for s in saves],
                       save_gbs=round(size / 1e9 / statistics.median(saves), 1),
                       of_unconstrained=round(statistics.median(base_save) / statistics.median(saves), 3))
        except Exception as exc:
            row.update(save_error=f"{type(exc).__name__}: {str(exc)[:300]}")
        row["reserved_after_save_mib"] = mib(torch.cuda.memory_reserved())
        row["batches_out_of_memory"] = retries.count
        row["out_of_memory_reasons"] = dict(retries.reasons)
        del filler
        report(**row)
    state.clear()  # loads: room for the tensors a load returns, plus ``leave``
    for leave in args.free:
        filler = fill_gpu(size + int(leave * GIB))
        row = {"part": "filled-load", "free_gib": leave}
        try:
            with recording(args.trace_oom):
                seconds, out = timed(lambda: ckptzip.load(data))
            row.update(load_s=round(seconds, 3), load_gbs=round(size / 1e9 / seconds, 1))
        except Exception as exc:
            out = None
            row.update(load_error=f"{type(exc).__name__}: {str(exc)[:600]}")
            if args.trace_oom:
                row["oom_trace"] = summary()
        row["reserved_after_load_mib"] = mib(torch.cuda.memory_reserved())
        del filler
        if out is not None:
            row["bit_exact"] = same(out, llama_like_state(args.gib))  # the same seed: the same state
        del out
        torch.cuda.empty_cache()
        report(**row)


def part_repeat(args: argparse.Namespace) -> None:
    state = llama_like_state(args.repeat_gib)
    size = nbytes(state)
    sink = Memory(size + (1 << 30))
    ckptzip.save(state, sink.file())
    data = sink.data()
    reserved: list[float] = []
    times: list[float] = []
    for _ in range(args.repeats):
        seconds, _ = timed(lambda: ckptzip.save(state, discard_sink()))
        times.append(seconds)
        reserved.append(mib(torch.cuda.memory_reserved()))
    load_reserved: list[float] = []
    load_times: list[float] = []
    for _ in range(args.repeats):
        seconds, out = timed(lambda: ckptzip.load(data))
        load_times.append(seconds)
        del out
        load_reserved.append(mib(torch.cuda.memory_reserved()))
    ok = same(ckptzip.load(data), state)
    report(part="repeat", state_gb=round(size / 1e9, 2), saves=args.repeats, bit_exact=ok,
           save_median_s=round(statistics.median(times), 4), load_median_s=round(statistics.median(load_times), 4),
           reserved_after_save_mib=reserved, reserved_after_load_mib=load_reserved,
           allocated_end_mib=mib(torch.cuda.memory_allocated()))


def clone_seconds(state: dict[str, torch.Tensor]) -> float:
    """A device-to-device copy of the state into one buffer (what a device snapshot must at least
    do), median of 5."""
    flat = torch.empty(nbytes(state), dtype=torch.uint8, device="cuda")

    def copy() -> None:
        offset = 0
        for t in state.values():
            n = t.numel() * t.element_size()
            flat[offset : offset + n].copy_(t.reshape(-1).view(torch.uint8))
            offset += n

    return statistics.median(timed(copy)[0] for _ in range(5))


def blocked_save(manager: ckptzip.CheckpointManager, step: int, state: dict[str, torch.Tensor]) -> float:
    """Seconds ``manager.save`` held the caller (its GPU work included); then waits for the write."""
    torch.cuda.synchronize()
    t = time.perf_counter()
    manager.save(step, state)
    torch.cuda.synchronize()
    seconds = round(time.perf_counter() - t, 4)
    manager.wait()
    return seconds


def part_manager(args: argparse.Namespace) -> None:
    import fsspec

    from . import discard  # noqa: F401  (registers discard://)

    state = llama_like_state(args.manager_gib)
    size = nbytes(state)
    clone = clone_seconds(state)
    torch.cuda.empty_cache()
    for leave in args.manager_free:
        filler = fill_gpu(int(leave * GIB))
        run = f"manager-{leave}"  # in host memory: the manager's pipeline, not the disk
        # many saves go to a store that discards them (an in-memory store grows by copying), and
        # are not restored
        many = args.manager_saves > 10
        manager = ckptzip.CheckpointManager(f"{'discard' if many else 'memory'}://{run}", keep_last=1,
                                            async_save=True)
        blocks: list[float] = []
        reserved: list[float] = []
        modes: list[str | None] = []
        for step in range(args.manager_saves):
            if step % 20 == 19:
                print(json.dumps({"progress": "manager", "free_gib": leave, "saves": step,
                                  "median_block_s": statistics.median(blocks)}), flush=True)
            blocks.append(blocked_save(manager, step, state))
            modes.append(manager.last_snapshot)
            reserved.append(mib(torch.cuda.memory_reserved()))
        reason = manager.last_snapshot_reason
        restored, error, trace = None, None, None
        try:
            with recording(args.trace_oom and not many):
                restored = None if many else manager.restore(map_location="cpu")
        except Exception as exc:
            error = f"{type(exc).__name__}: {str(exc)[:600]}"
            trace = summary() if args.trace_oom else None
        manager.close()
        later = statistics.median(blocks[1:]) if len(blocks) > 1 else blocks[0]
        report(part="manager", free_gib=leave, state_gb=round(size / 1e9, 2), saves=len(blocks),
               first_block_s=blocks[0], median_block_s=round(later, 4), last_block_s=blocks[-1],
               d2d_clone_s=round(clone, 4), median_of_clone=round(later / clone, 2),
               modes=sorted(set(modes)), reason=reason, reserved_first_mib=reserved[0],
               reserved_last_mib=reserved[-1], blocks_s=blocks if len(blocks) <= 10 else None,
               reserved_every_10_mib=reserved[::10], restore_error=error, oom_trace=trace,
               bit_exact=None if restored is None else same_on_host(restored, state))
        del restored, filler
        if not many:
            fsspec.filesystem("memory").rm(f"/{run}", recursive=True)


def part_host(args: argparse.Namespace) -> None:
    from .discard import written

    state = llama_like_state(args.host_gib)
    size = nbytes(state)
    for prepared in (True, False):
        filler = fill_gpu(int(args.host_free * GIB))
        rss0 = host_rss()
        run = f"host-{prepared}"
        manager = ckptzip.CheckpointManager(f"discard://{run}", keep_last=1, async_save=True, snapshot="host")
        if prepared:
            manager.prepare(state)
            time.sleep(args.job_start_s)  # the job's first steps, while the staging is reserved
        blocks, stored, staging, rss = [], [], [], []
        for step in range(args.host_saves):
            blocks.append(blocked_save(manager, step, state))
            stored.append(written(run))
            staging.append(manager._snapshots._staging.reserved)  # the bench looks inside
            rss.append(host_rss() - rss0)
        manager.close()
        report(part="host", prepared=prepared, free_gib=args.host_free, state_gb=round(size / 1e9, 2),
               blocks_s=blocks, stored_gb=round(stored[-1] / 1e9, 2), ratio=round(size / max(1, stored[-1]), 4),
               staging_gb=[round(b / 1e9, 2) for b in staging],
               staging_of_stored=round(staging[-1] / max(1, stored[-1]), 3),
               rss_growth_gb=[round(b / 1e9, 2) for b in rss], rss_of_stored=round(rss[-1] / max(1, stored[-1]), 3))
        del manager, filler
        torch.cuda.empty_cache()


_FRESH = r"""
import io, json, os, sys, time, torch
t0 = time.perf_counter(); torch.zeros(1, device="cuda"); torch.cuda.synchronize(); init = time.perf_counter() - t0
import ckptzip
from ckptzip.memory.gpu import available as available_gpu_memory
warm = sys.argv[1] == "warmup"
if warm:
    ckptzip.warmup()
    time.sleep(float(sys.argv[2]))  # the job's first training steps
g = torch.Generator(device="cuda").manual_seed(0)
state = {f"w{i}": torch.randn(1 << 22, generator=g, device="cuda") * 0.02 for i in range(20)}
state.update({f"g{i}": (torch.randn(1 << 22, generator=g, device="cuda") * 1e-3).bfloat16() for i in range(10)})
state["step"] = torch.tensor(7)
class D(io.RawIOBase):
    def writable(self): return True
    def write(self, b): return memoryview(b).nbytes
def timed(f):
    torch.cuda.synchronize(); t = time.perf_counter(); r = f(); torch.cuda.synchronize(); return time.perf_counter() - t, r
first_save, _ = timed(lambda: ckptzip.save(state, D()))
later_save = min(timed(lambda: ckptzip.save(state, D()))[0] for _ in range(3))
buf = io.BytesIO(); ckptzip.save(state, buf); data = buf.getvalue()
open(sys.argv[3], "wb").write(data)
print(json.dumps({"first_save": round(first_save, 3), "later_save": round(later_save, 3), "cuda_init": round(init, 3),
                  "triton_imported": "triton" in sys.modules}))
"""

_FRESH_LOAD = r"""
import json, sys, time, torch
torch.zeros(1, device="cuda"); torch.cuda.synchronize()
import ckptzip
from ckptzip.memory.gpu import available as available_gpu_memory
data = open(sys.argv[1], "rb").read()
if sys.argv[2] == "warmup":
    ckptzip.warmup(wait=True)  # as the manager does while the job starts; timed separately below
def timed(f):
    torch.cuda.synchronize(); t = time.perf_counter(); r = f(); torch.cuda.synchronize(); return time.perf_counter() - t, r
first, _ = timed(lambda: ckptzip.load(data))
later = min(timed(lambda: ckptzip.load(data))[0] for _ in range(3))
print(json.dumps({"first_load": round(first, 3), "later_load": round(later, 3),
                  "load_triton_imported": "triton" in sys.modules}))
"""


def part_fresh(args: argparse.Namespace) -> None:
    """A new node: empty Triton and ckptzip caches; ``cold`` with the kernels ckptzip ships
    compiled, ``cold-jit`` with Triton compiling them (``CKPTZIP_AOT_KERNELS=0``), ``warmup``
    with ``ckptzip.warmup()`` at job start."""
    for mode in ("cold", "cold-jit", "warmup"):
        with tempfile.TemporaryDirectory() as cache, tempfile.TemporaryDirectory() as files:
            env = dict(os.environ, TRITON_CACHE_DIR=os.path.join(cache, "triton"),
                       CKPTZIP_CACHE_DIR=os.path.join(cache, "ckptzip"),
                       CKPTZIP_AOT_KERNELS="0" if mode == "cold-jit" else "1")
            path = os.path.join(files, "s.ckz")
            saved = subprocess.run([sys.executable, "-c", _FRESH, mode, str(args.job_start_s), path], env=env,
                                   capture_output=True, text=True, timeout=300)
            row: dict[str, Any] = {"part": "fresh", "mode": mode}
            row.update(json.loads(saved.stdout.strip().splitlines()[-1]) if saved.returncode == 0
                       else {"error": saved.stderr[-500:]})
            with tempfile.TemporaryDirectory() as cache2:  # the restore of a failed job: a new node again
                loaded = subprocess.run([sys.executable, "-c", _FRESH_LOAD, path, mode],
                                        env=dict(env, TRITON_CACHE_DIR=os.path.join(cache2, "triton"),
                                                 CKPTZIP_CACHE_DIR=os.path.join(cache2, "ckptzip")),
                                        capture_output=True, text=True, timeout=300)
            row.update(json.loads(loaded.stdout.strip().splitlines()[-1]) if loaded.returncode == 0
                       else {"load_error": loaded.stderr[-500:]})
            row["exit_codes"] = [saved.returncode, loaded.returncode]
            report(**row)


PARTS = ("filled", "repeat", "manager", "host", "fresh")


def configure(p: argparse.ArgumentParser) -> None:
    """The training-job benchmark's arguments (``ckptzip bench training-job``, or this module run)."""
    p.description = __doc__
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.add_argument("--parts", default="filled,repeat,manager,fresh", help=f"comma-separated, of {', '.join(PARTS)}")
    p.add_argument("--gib", type=float, default=32, help="size of the 7B-like state")
    p.add_argument("--free", default="3,2,1", help="GiB left free beside the state (the first also runs a load)")
    p.add_argument("--repeat-gib", type=float, default=4)
    p.add_argument("--repeats", type=int, default=100)
    p.add_argument("--manager-gib", type=float, default=8, help="size of the manager's state (stored in memory)")
    p.add_argument("--manager-free", default="40,3,1", help="GiB left free beside the state for the manager")
    p.add_argument("--manager-saves", type=int, default=5)
    p.add_argument("--host-gib", type=float, default=40, help="size of the state of host snapshots")
    p.add_argument("--host-free", type=float, default=3, help="GiB left free beside it")
    p.add_argument("--host-saves", type=int, default=3)
    p.add_argument("--job-start-s", type=float, default=20,
                   help="seconds between warmup() (or prepare()) and the first save")
    p.add_argument("--json", default=None, help="write every measurement here as a JSON list")
    p.add_argument("--loads-only", action="store_true", help="filled: skip the saves with the GPU filled")
    p.add_argument("--trace-oom", action="store_true",
                   help="record torch's allocator history around filled saves, loads and restores; summarise "
                        "it where a batch ran out of memory or a call failed")
    p.add_argument("--watchdog-s", type=float, default=0, help="dump every thread's stack and exit after this")


def run(args: argparse.Namespace) -> int:
    """Run the parts asked for; 2 (and nothing run) without a CUDA device or for an unknown part."""
    parts = [name for name in args.parts.split(",") if name]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown or not torch.cuda.is_available():
        why = f"unknown part(s) {', '.join(unknown)}: choose from {', '.join(PARTS)}" if unknown else \
            "it measures a GPU under a training job's conditions and needs a CUDA device"
        print(f"ckptzip bench training-job: error: {why}", file=sys.stderr)
        return 2
    if args.watchdog_s:
        faulthandler.dump_traceback_later(args.watchdog_s, exit=True)
    args.free = [float(x) for x in args.free.split(",") if x]
    args.manager_free = [float(x) for x in args.manager_free.split(",") if x]
    print(json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                      "ckptzip": ckptzip.__version__}), flush=True)
    for name in parts:
        try:
            globals()[f"part_{name}"](args)
        except Exception as exc:  # one part's failure is a result too
            report(part=name, error=f"{type(exc).__name__}: {str(exc)[:500]}")
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(RESULTS, f, indent=1)
    return 0


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m ckptzip_bench.training_job")
    configure(p)
    sys.exit(run(p.parse_args()))


if __name__ == "__main__":
    main()
