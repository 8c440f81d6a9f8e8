"""Issue 26's GPU figures: the memory tier and deltas where training barely moves, on one GPU.

Parts (``--parts``, comma-separated):
- ``tier``: a state of 7B-like shapes (``--gib``; fp32 weights, both AdamW moments, bf16
  gradients) saved by a ``CheckpointManager`` with a memory tier in shared memory: how long
  ``save()`` blocked against a device-to-device copy of the state, how long until the tier held
  it, and the tier's bytes against the state's (how many more checkpoints the same RAM holds);
  ``--first`` says what the process does before that first save (``prepare``: the manager's
  ``prepare(state)``; ``warm``: the kernels made, as after a while of training); a second save's
  block is reported beside the first's.
  The trainer then exits without closing (as a crashed one would), leaving the tier behind.
- ``restore``: fresh processes restore the newest checkpoint from that tier onto the GPU:
  seconds and GB/s of the state's bytes (the interpreter's and CUDA's start excluded),
  bit-exact against the state rebuilt from its seed; ``--restore-prep`` variants first warm
  ckptzip up or have torch's allocator hold the state's memory, to tell what a fresh process pays.
- ``delta``: bf16 weights of the demo's Transformer (``--delta-preset``) trained in bf16 with
  AdamW on Python sources, one step apart, saved by an incremental manager: share of bit-identical elements,
  ratio of each step's XOR delta file, GB/s of the save (blocked plus background encode) and of
  the engine's incremental save alone (into a preallocated host buffer),
  at an RL-like learning rate (1e-6) and at a pre-training one (1e-4, against whole files).

    python3 bench/tier_gpu.py --gib 40 --delta-preset large --json tier-gpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any
from collections.abc import Callable
from pathlib import Path

import fsspec
import torch
import torch.nn.functional as F

import ckptzip
from ckptzip.demo.training import Transformer, get_preset, load_corpus
from ckptzip.api import write_checkpoint
from ckptzip.engine.policy import Policy
from ckptzip.engine.sources import DeltaBase
from ckptzip.format import BaseRef
from ckptzip.manager import CheckpointManager
from ckptzip_bench.training_job import RESULTS, Memory, blocked_save, report, same


def _tier_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


_SAVE = r"""
import json, os, sys, time, torch
sys.path.insert(0, sys.argv[4])
from ckptzip_bench.training_job import blocked_save, clone_seconds, llama_like_state, nbytes
from ckptzip.demo.training import Transformer, get_preset, load_corpus
from ckptzip.manager import CheckpointManager, MemoryTier
state = llama_like_state(float(sys.argv[3]))
clone = clone_seconds(state)
torch.cuda.empty_cache()
manager = CheckpointManager(sys.argv[1], keep_last=1, codec=sys.argv[5],
                            memory_tier=MemoryTier(keep=1, persist_every=1000, path=sys.argv[2]))
first = sys.argv[6].split("+")
if "prepare" in first:  # as a job does once its model and optimizer exist
    manager.prepare(state)
if "warm" in first:  # as when training ran a while before the first save: the kernels are ready
    import ckptzip
    ckptzip.warmup(wait=True)
t = time.perf_counter()
blocked = blocked_save(manager, 1, state)  # then waits for the tier's copy
ready = time.perf_counter() - t
second = blocked_save(manager, 2, state)
print(json.dumps({"blocked_s": blocked, "tier_ready_s": round(ready, 2), "d2d_clone_s": round(clone, 4),
                  "second_blocked_s": second,
                  "snapshot": manager.last_snapshot,                  "state_bytes": nbytes(state)}), flush=True)
os._exit(0)  # no close(): the trainer is gone, its tier stays
"""

_RESTORE = r"""
import json, os, sys, time, torch
sys.path.insert(0, sys.argv[4])
torch.zeros(1, device="cuda"); torch.cuda.synchronize()
from ckptzip_bench.training_job import llama_like_state, same
from ckptzip.demo.training import Transformer, get_preset, load_corpus
from ckptzip.manager import CheckpointManager, MemoryTier
import ckptzip
prep = sys.argv[5].split("+")
if "warmup" in prep:  # kernels and codecs made before the restore, as a job's start would
    ckptzip.warmup(wait=True)
if "memory" in prep:  # the state's GPU memory already held by torch's caching allocator
    torch.empty(int(float(sys.argv[3]) * 2**30) + (2 << 30), dtype=torch.uint8, device="cuda")
manager = CheckpointManager(sys.argv[1], memory_tier=MemoryTier(keep=1, persist_every=1000, path=sys.argv[2]))
torch.cuda.synchronize(); t = time.perf_counter()
state = manager.restore()
torch.cuda.synchronize(); seconds = time.perf_counter() - t
device = sorted({str(v.device) for v in state.values()})
exact = same(state, llama_like_state(float(sys.argv[3])))
del state
torch.cuda.synchronize(); t = time.perf_counter()
again = manager.restore()  # in a warm process: what the first paid beyond the process's start
torch.cuda.synchronize(); warm = time.perf_counter() - t
del again
files = [p for p in __import__("pathlib").Path(sys.argv[2]).rglob("*.ckz")]
buf = bytearray(max(p.stat().st_size for p in files))
t = time.perf_counter()
with open(files[0], "rb", buffering=0) as f:
    n = f.readinto(buf)
read = time.perf_counter() - t
print(json.dumps({"restore_s": round(seconds, 3), "warm_restore_s": round(warm, 3), "from": manager.restored_from, "devices": device,
                  "bit_exact": exact, "file_read_gbs": round(n / 1e9 / read, 1)}), flush=True)
os._exit(0)
"""


def part_tier(args: argparse.Namespace, root: Path) -> None:
    here = str(Path(__file__).parent)
    run, shm = root / "run", Path(args.shm) / f"ckptzip-tier-gpu-{os.getpid()}"
    args.run, args.shm_dir = run, shm
    t = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", _SAVE, str(run), str(shm), str(args.gib), here, args.codec,
                          args.first],
                         capture_output=True, text=True, timeout=args.part_timeout_s)
    total = time.perf_counter() - t
    if out.returncode != 0:
        report(part="tier", error=out.stderr[-800:])
        return
    row = json.loads(out.stdout.strip().splitlines()[-1])
    held = _tier_bytes(shm)
    args.state_bytes = row["state_bytes"]
    report(part="tier", codec=args.codec, first=args.first, state_gb=round(row["state_bytes"] / 1e9, 2), snapshot=row["snapshot"],
           blocked_s=row["blocked_s"], second_blocked_s=row["second_blocked_s"], tier_ready_s=row["tier_ready_s"], d2d_clone_s=row["d2d_clone_s"],
           blocked_of_clone=round(row["blocked_s"] / row["d2d_clone_s"], 2), tier_gb=round(held / 1e9, 2),
           checkpoints_per_raw=round(row["state_bytes"] / max(1, held), 4), process_s=round(total, 1))


def part_restore(args: argparse.Namespace, root: Path) -> None:
    here = str(Path(__file__).parent)
    for prep in args.restore_prep.split(","):
        rows = []
        for _ in range(args.restores):
            out = subprocess.run([sys.executable, "-c", _RESTORE, str(args.run), str(args.shm_dir), str(args.gib), here,
                                  prep], capture_output=True, text=True, timeout=args.part_timeout_s)
            if out.returncode != 0:
                report(part="restore", prep=prep, error=out.stderr[-800:])
                return
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        _report_restores(args, prep, rows)


def _report_restores(args: argparse.Namespace, prep: str, rows: list[dict[str, Any]]) -> None:
    size = args.state_bytes
    seconds = [r["restore_s"] for r in rows]
    report(part="restore", prep=prep, codec=args.codec, state_gb=round(size / 1e9, 2), restore_s=seconds,
           warm_restore_s=[r["warm_restore_s"] for r in rows],
           from_=rows[0]["from"], file_read_gbs=[r["file_read_gbs"] for r in rows],
           gbs_median=round(size / 1e9 / statistics.median(seconds), 1), devices=rows[0]["devices"],
           bit_exact=all(r["bit_exact"] for r in rows))


def _stored(run: str, step: int) -> int:
    fs = fsspec.filesystem("memory")
    return int(fs.size(f"/{run}/step_{step:08d}.ckz"))


def _delta_pipeline_s(weights: dict[str, torch.Tensor], base: dict[str, torch.Tensor], reps: int = 3) -> float:
    """Median seconds of the engine's incremental save of ``weights`` against ``base`` into a
    preallocated host buffer: the coding's own speed, without a store that grows by copying."""
    times = []
    for _ in range(reps):
        sink = Memory(sum(t.nbytes for t in weights.values()) // 2 + (64 << 20))
        torch.cuda.synchronize()
        t = time.perf_counter()
        write_checkpoint(sink, weights, Policy.parse("auto"), base=DeltaBase(BaseRef(0, "base.ckz", "0" * 64), base))
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _trainer(preset: str) -> tuple[torch.nn.Module, Callable[[torch.optim.Optimizer], None]]:
    """The demo's Transformer of ``preset`` in bf16 on the GPU, and a step function that trains it
    one batch of the standard library's Python sources with a given optimizer."""
    torch.manual_seed(0)
    config = get_preset(preset)
    model = Transformer(config).cuda().bfloat16()
    corpus = load_corpus().cuda()
    g = torch.Generator().manual_seed(1)

    def step(optimizer: torch.optim.Optimizer) -> None:
        at = torch.randint(0, corpus.numel() - config.seq_len - 1, (4,), generator=g).tolist()
        x = torch.stack([corpus[i : i + config.seq_len] for i in at]).long()
        y = torch.stack([corpus[i + 1 : i + config.seq_len + 1] for i in at]).long()
        loss = F.cross_entropy(model(x)[0].float().flatten(0, 1), y.flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    return model, step


def part_delta(args: argparse.Namespace, root: Path) -> None:
    model, train = _trainer(args.delta_preset)
    warm = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(args.warmup):  # weights that are not at their initialisation
        train(warm)
    del warm
    for lr in (1e-6, 1e-4):
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
        run = f"tier-gpu-delta-{lr:g}"  # in host memory: the pipeline's speed, not the disk's
        rows = []
        with CheckpointManager(f"memory://{run}", keep_last=None, incremental=args.delta_steps + 1) as manager:
            previous = {k: v.detach().clone() for k, v in model.state_dict().items()}
            manager.save(0, previous)
            manager.wait()
            for i in range(1, args.delta_steps + 1):
                train(optimizer)
                weights = model.state_dict()
                raw = sum(t.nbytes for t in weights.values())
                torch.cuda.synchronize()
                t = time.perf_counter()
                blocked = blocked_save(manager, i, weights)  # waits for the file after timing the block
                total = time.perf_counter() - t
                identical = sum(int((weights[k].view(torch.int16) == previous[k].view(torch.int16)).sum())
                                for k in weights) / sum(v.numel() for v in weights.values())
                stored = _stored(run, i)
                pipeline = _delta_pipeline_s(weights, previous)
                rows.append({"identical": round(identical, 5), "xor_ratio": round(raw / stored, 1),
                             "blocked_s": blocked, "save_gbs": round(raw / 1e9 / total, 1),
                             "pipeline_s": round(pipeline, 4), "pipeline_gbs": round(raw / 1e9 / pipeline, 1)})
                previous = {k: v.detach().clone() for k, v in weights.items()}
            whole = _stored(run, 0)
            restored = manager.restore(args.delta_steps)
        exact = same(dict(restored), {k: v for k, v in model.state_dict().items()})
        report(part="delta", preset=args.delta_preset, lr=lr, weights_gb=round(raw / 1e9, 2), whole_ratio=round(raw / whole, 3),
               steps=rows, median_xor_ratio=statistics.median(r["xor_ratio"] for r in rows),
               median_save_gbs=statistics.median(r["save_gbs"] for r in rows),
               median_pipeline_gbs=statistics.median(r["pipeline_gbs"] for r in rows), bit_exact=exact)
        del optimizer


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", default="tier,restore,delta")
    p.add_argument("--gib", type=float, default=40, help="size of the tier's 7B-like state")
    p.add_argument("--first", default="-", help="what the tier part does before its first save: - (nothing), "
                   "prepare (manager.prepare), warm (ckptzip.warmup, waited for), prepare+warm")
    p.add_argument("--restores", type=int, default=2)
    p.add_argument("--restore-prep", default="none",
                   help="comma-separated variants of what a fresh restoring process does first: none, warmup "
                        "(ckptzip.warmup), memory (the state's GPU memory allocated and cached), warmup+memory")
    p.add_argument("--codec", default="auto", help="the manager's codec for the tier parts")
    p.add_argument("--shm", default="/dev/shm", help="where the memory tier lives")
    p.add_argument("--delta-preset", default="large", help="the demo model trained in bf16 by the delta part")
    p.add_argument("--warmup", type=int, default=20, help="steps at lr 1e-3 before the delta part's steps")
    p.add_argument("--delta-steps", type=int, default=4)
    p.add_argument("--part-timeout-s", type=float, default=240)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    print(json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                      "ckptzip": ckptzip.__version__}), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        try:
            for name in args.parts.split(","):
                try:
                    globals()[f"part_{name}"](args, root)
                except Exception as exc:  # one part's failure is a result too
                    report(part=name, error=f"{type(exc).__name__}: {str(exc)[:500]}")
                torch.cuda.empty_cache()
        finally:
            shm = getattr(args, "shm_dir", None)
            if shm is not None:
                subprocess.run(["rm", "-rf", str(shm)], check=False)
    if args.json:
        Path(args.json).write_text(json.dumps(RESULTS, indent=1))


if __name__ == "__main__":
    main()
