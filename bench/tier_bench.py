"""Issue 26's CPU figures: the memory tier and deltas where training barely moves.

1. ``rss``: 100 saves of a state to a manager with a memory tier (keep 2, persisted every 10th);
   the process's RSS and the tier's bytes after each save.
2. ``restore``: a fresh process restores the newest checkpoint from the tier; seconds and GB/s of
   the state's bytes (load only, the interpreter's start excluded).
3. ``replicate``: two gloo ranks on loopback; time of the ring exchange of one checkpoint, and of
   a save with and without replication.
4. ``delta``: a model's bf16 weights trained directly in bf16 (AdamW, lr 1e-6, RL-like) saved each
   step with ``incremental``: bit-identical share, ratio per step of the XOR delta file (the
   format's sparse coding where it pays: format 2.2), of its stored streams alone, and of the
   earlier prototype sparse coding of the changed elements (gaps of their positions and XOR of
   their values, each zstd-coded; stream bytes only) for comparison.

    python3 bench/tier_bench.py --out tier.json               # every part, CPU, a few minutes
    python3 bench/tier_bench.py --parts delta --steps 5 --out delta.json
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
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
import zstandard

import ckptzip
from ckptzip.demo.training import Transformer, get_preset, load_corpus
from ckptzip_bench.launch import launch
from ckptzip.manager import CheckpointManager, MemoryTier
from ckptzip.tier.ring import Ring


def _state(step: int, mb: int) -> dict[str, Any]:
    """``mb`` MB of fp32 weights that drift per step (so every save writes new bytes)."""
    w = torch.randn(mb << 18, generator=torch.Generator().manual_seed(0))
    return {"step": step, "w": w * (1 + 1e-3 * step)}


def _rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("VmRSS"))


def _tier_bytes(shm: Path) -> int:
    return sum(p.stat().st_size for p in shm.rglob("*") if p.is_file())


def rss(root: Path, mb: int, saves: int) -> dict[str, Any]:
    shm = root / "shm"
    tier = MemoryTier(keep=2, persist_every=10, path=shm)
    rows = []
    start = time.perf_counter()
    with CheckpointManager(root / "run", keep_last=2, memory_tier=tier) as manager:
        for step in range(1, saves + 1):
            manager.save(step, _state(step, mb))
            manager.wait()
            rows.append((_rss(), _tier_bytes(shm)))
    seconds = time.perf_counter() - start
    rss_mb = [r / 2**20 for r, _ in rows]
    return {"state_mb": mb, "saves": saves, "seconds": seconds, "rss_mb_first": rss_mb[0], "rss_mb_max": max(rss_mb),
            "rss_mb_last": rss_mb[-1], "rss_mb_after_10": rss_mb[min(9, saves - 1)],
            "tier_mb_max": max(t for _, t in rows) / 2**20, "tier_mb_last": rows[-1][1] / 2**20}


def restore(root: Path, mb: int, repeats: int) -> dict[str, Any]:
    """Time a restore from the tier that ``rss`` filled, in fresh processes."""
    code = ("import sys, time; from ckptzip.manager import CheckpointManager, MemoryTier; "
            "m = CheckpointManager(sys.argv[1], memory_tier=MemoryTier(path=sys.argv[2])); "
            "t = time.perf_counter(); s = m.restore(); t = time.perf_counter() - t; "
            "print(t, m.restored_from, s['w'].nbytes)")
    runs = []
    for _ in range(repeats):
        out = subprocess.run([sys.executable, "-c", code, str(root / "run"), str(root / "shm")],
                             capture_output=True, text=True, check=True).stdout.split()
        runs.append((float(out[0]), out[1], int(out[2])))
    seconds = statistics.median(r[0] for r in runs)
    return {"state_mb": mb, "from": runs[0][1], "seconds_median": seconds, "gb_per_s": runs[0][2] / seconds / 1e9,
            "runs": [r[0] for r in runs]}


def _replicate_rank(rank: int, world: int, root: str, mb: int, saves: int, out: str) -> None:
    torch.set_num_threads(1)
    ring = Ring(dist.new_group(backend="gloo"))
    data = (Path(root) / "shm" / "own").glob("step_*.ckz")
    blob = np.fromfile(sorted(data)[-1], dtype=np.uint8)
    bundle = torch.from_numpy(blob)
    shifts = []
    for _ in range(5):
        dist.barrier()
        t = time.perf_counter()
        ring.shift(bundle, forward=True, send=True, expect=True)
        shifts.append(time.perf_counter() - t)
    per_save = {}
    for replicate in (None, "world"):
        tier = MemoryTier(keep=2, persist_every=saves + 1, path=Path(root) / f"rep{replicate}-{rank}",
                          replicate=replicate)
        with CheckpointManager(Path(root) / f"rep{replicate}-run{rank}", memory_tier=tier) as manager:
            times = []
            for step in range(1, saves + 1):
                state = _state(step, mb)
                dist.barrier()
                t = time.perf_counter()
                manager.save(step, state)
                manager.wait()
                times.append(time.perf_counter() - t)
        per_save[str(replicate)] = statistics.median(times)
    if rank == 0:
        Path(out).write_text(json.dumps({"ranks": world, "compressed_mb": blob.nbytes / 2**20,
                                         "shift_s_median": statistics.median(shifts),
                                         "shift_gb_per_s": blob.nbytes / statistics.median(shifts) / 1e9,
                                         "save_s_median_without": per_save["None"],
                                         "save_s_median_with": per_save["world"]}))


def replicate(root: Path, mb: int, saves: int) -> dict[str, Any]:
    out = root / "replicate.json"
    launch(_replicate_rank, 2, str(root), mb, saves, str(out))
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def _sparse_bytes(old: torch.Tensor, new: torch.Tensor) -> int:
    """Bytes of the prototype sparse coding of ``new`` against ``old`` (16-bit tensors)."""
    a, b = old.reshape(-1).view(torch.int16).numpy(), new.reshape(-1).view(torch.int16).numpy()
    where = np.flatnonzero(a != b)
    gaps = np.diff(where, prepend=-1).astype(np.uint32)
    values = (a[where] ^ b[where]).view(np.uint16)
    planes = [values.view(np.uint8)[0::2].tobytes(), values.view(np.uint8)[1::2].tobytes()]
    coder = zstandard.ZstdCompressor(level=3)
    gap_planes = [gaps.view(np.uint8)[i::4].tobytes() for i in range(4)]
    return 16 + sum(len(coder.compress(p)) for p in [*gap_planes, *planes])


def delta(root: Path, preset: str, steps: int, warmup: int) -> dict[str, Any]:
    torch.manual_seed(0)
    config = get_preset(preset)
    model = Transformer(config).to(torch.bfloat16)
    corpus = load_corpus()
    generator = torch.Generator().manual_seed(1)

    def step(optimizer: torch.optim.Optimizer) -> None:
        at = torch.randint(0, corpus.numel() - config.seq_len - 1, (4,), generator=generator)
        x = torch.stack([corpus[i : i + config.seq_len] for i in at.tolist()]).long()
        y = torch.stack([corpus[i + 1 : i + config.seq_len + 1] for i in at.tolist()]).long()
        loss = F.cross_entropy(model(x)[0].float().flatten(0, 1), y.flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    pretrain = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(warmup):  # weights that are not at their initialisation
        step(pretrain)
    rl = torch.optim.AdamW(model.parameters(), lr=1e-6)
    rows = []
    with CheckpointManager(root / "delta", keep_last=None, incremental=steps + 1) as manager:
        previous = {k: v.clone() for k, v in model.state_dict().items()}
        manager.save(0, previous)
        for i in range(1, steps + 1):
            step(rl)
            weights = {k: v.clone() for k, v in model.state_dict().items()}
            manager.save(i, weights)
            manager.wait()
            raw = sum(t.nbytes for t in weights.values())
            same = sum(int((weights[k].view(torch.int16) == previous[k].view(torch.int16)).sum()) for k in weights)
            path = root / "delta" / f"step_{i:08d}.ckz"
            with ckptzip.open(path) as reader:
                entries = reader.entries()
                version = reader._reader.index.version
            sparse = sum(_sparse_bytes(previous[k], weights[k]) for k in weights)
            rows.append({"step": i, "raw_mb": raw / 2**20, "identical": same / sum(t.numel() for t in weights.values()),
                         "format": ".".join(map(str, version)), "file_ratio": raw / path.stat().st_size,
                         "streams_ratio": raw / sum(e.compressed_nbytes for e in entries),
                         "sparse_tensors": sum(bool(e.transforms) and e.transforms[0]["id"] == "sparse" for e in entries),
                         "tensors": len(entries), "prototype_ratio": raw / sparse})
            previous = weights
        whole = (root / "delta" / "step_00000000.ckz").stat().st_size
    assert all(torch.equal(manager.restore(i)[k], v) for i in [steps] for k, v in previous.items())
    return {"preset": preset, "lr": 1e-6, "dtype": "bfloat16", "whole_ratio": rows[0]["raw_mb"] * 2**20 / whole,
            "steps": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default="rss,restore,replicate,delta")
    parser.add_argument("--mb", type=int, default=64, help="state size of the tier parts, MB")
    parser.add_argument("--saves", type=int, default=100)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--steps", type=int, default=5, help="RL steps of the delta part")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--out")
    args = parser.parse_args()
    parts = args.parts.split(",")
    result: dict[str, Any] = {"torch": torch.__version__, "ckptzip": ckptzip.__version__, "cpus": os.cpu_count()}
    with tempfile.TemporaryDirectory(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as tmp:
        root = Path(tmp)
        if "rss" in parts or "restore" in parts or "replicate" in parts:
            result["rss"] = rss(root, args.mb, args.saves if "rss" in parts else 3)
        if "restore" in parts:
            result["restore"] = restore(root, args.mb, 3)
        if "replicate" in parts:
            result["replicate"] = replicate(root, args.mb, 5)
        if "delta" in parts:
            result["delta"] = delta(root, args.preset, args.steps, args.warmup)
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
