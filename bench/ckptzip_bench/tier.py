"""The memory tier and deltas where training barely moves (issue 26), on the CPU.

Parts (``--parts``, comma-separated):
- ``rss``: ``--saves`` saves of a ``--mb`` MB state that changes every save, to a manager with a
  memory tier (keep 2, persisted every 10th), each waited for: the process's RSS and the tier's
  bytes after each save.
- ``restore``: fresh processes restore the newest checkpoint from the tier ``rss`` filled:
  seconds and GB/s of the state's bytes (the load only; the interpreter's start excluded).
- ``replicate``: two gloo ranks on loopback, each saving to a tier of its own with and without
  ``replicate="world"``: the median time of a save waited for.
- ``delta``: a model's weights trained directly in bf16 (AdamW at lr 1e-6, as RL fine-tuning
  moves them) saved every step with ``incremental``: the share of bit-identical elements, the
  format version, the ratio of each step's file and of its stored streams alone, and how many
  tensors were coded sparse.

Prints one JSON document (``--json`` writes it to a file too).

    ckptzip bench tier --parts rss,restore,replicate,delta
    python -m ckptzip_bench.tier ...   (the same, from bench/ of a checkout)
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

import torch
import torch.distributed as dist
import torch.nn.functional as F

import ckptzip
from ckptzip.demo.training import Transformer, get_preset, load_corpus
from ckptzip.format import ContainerReader
from ckptzip.manager import CheckpointManager, MemoryTier
from ckptzip.transforms import Sparse
from .launch import launch

PARTS = ("rss", "restore", "replicate", "delta")
PERSIST_EVERY = 10  # the rss part's tier persists every this-many-th save, as a job's would


def _state(step: int, mb: float) -> dict[str, Any]:
    """``mb`` MB of fp32 weights that drift per step, so that every save writes new bytes."""
    w = torch.randn(int(mb * (1 << 18)), generator=torch.Generator().manual_seed(0))
    return {"step": step, "w": w * (1 + 1e-3 * step)}


def _rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("VmRSS"))


def _bytes_under(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def part_rss(root: Path, mb: float, saves: int) -> dict[str, Any]:
    shm = root / "shm"
    rows = []
    start = time.perf_counter()
    tier = MemoryTier(keep=2, persist_every=PERSIST_EVERY, path=shm)
    with CheckpointManager(root / "run", keep_last=2, memory_tier=tier) as manager:
        for step in range(1, saves + 1):
            manager.save(step, _state(step, mb))
            manager.wait()
            rows.append((_rss() / 2**20, _bytes_under(shm) / 2**20))
    rss_mb = [r for r, _ in rows]
    return {"state_mb": mb, "saves": saves, "seconds": time.perf_counter() - start, "rss_mb_first": rss_mb[0],
            "rss_mb_after_10": rss_mb[min(9, saves - 1)], "rss_mb_max": max(rss_mb), "rss_mb_last": rss_mb[-1],
            "tier_mb_max": max(t for _, t in rows), "tier_mb_last": rows[-1][1]}


_RESTORE = """
import sys, time
from ckptzip.manager import CheckpointManager, MemoryTier
from ckptzip.transforms import Sparse
manager = CheckpointManager(sys.argv[1], memory_tier=MemoryTier(path=sys.argv[2]))
start = time.perf_counter()
state = manager.restore()
print(time.perf_counter() - start, manager.restored_from, state["w"].nbytes)
"""


def part_restore(root: Path, repeats: int) -> dict[str, Any]:
    """A restore from the tier that :func:`part_rss` filled, in fresh processes."""
    runs = []
    for _ in range(repeats):
        out = subprocess.run([sys.executable, "-c", _RESTORE, str(root / "run"), str(root / "shm")],
                             capture_output=True, text=True, check=True, timeout=300).stdout.split()
        runs.append((float(out[0]), out[1], int(out[2])))
    seconds = statistics.median(r[0] for r in runs)
    return {"from": sorted({r[1] for r in runs}), "seconds_median": seconds, "gb_per_s": runs[0][2] / seconds / 1e9,
            "runs": [r[0] for r in runs]}


def _replicate_rank(rank: int, world: int, root: str, mb: float, saves: int, out: str) -> None:
    medians = {}
    for replicate in (None, "world"):
        tier = MemoryTier(keep=2, persist_every=saves + 1, path=Path(root) / f"tier-{replicate}-{rank}",
                          replicate=replicate)
        with CheckpointManager(Path(root) / f"run-{replicate}-{rank}", memory_tier=tier) as manager:
            seconds = []
            for step in range(1, saves + 1):
                state = _state(step, mb)
                dist.barrier()
                start = time.perf_counter()
                manager.save(step, state)
                manager.wait()
                seconds.append(time.perf_counter() - start)
        medians[str(replicate)] = statistics.median(seconds)
    if rank == 0:
        Path(out).write_text(json.dumps({"ranks": world, "save_s_median_without": medians["None"],
                                         "save_s_median_with": medians["world"]}))


def part_replicate(root: Path, mb: float, saves: int) -> dict[str, Any]:
    out = root / "replicate.json"
    launch(_replicate_rank, 2, str(root), mb, saves, str(out))
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def _rl_model(preset: str, warmup: int) -> tuple[torch.nn.Module, Any]:
    """A bf16 model trained ``warmup`` steps at lr 1e-3 (weights not at their initialisation), and
    the step function that trains it further."""
    torch.manual_seed(0)
    config = get_preset(preset)
    model = Transformer(config).to(torch.bfloat16)
    corpus = load_corpus()
    generator = torch.Generator().manual_seed(1)

    def step(optimizer: torch.optim.Optimizer) -> None:
        at = torch.randint(0, corpus.numel() - config.seq_len - 1, (4,), generator=generator).tolist()
        x = torch.stack([corpus[i : i + config.seq_len] for i in at]).long()
        y = torch.stack([corpus[i + 1 : i + config.seq_len + 1] for i in at]).long()
        loss = F.cross_entropy(model(x)[0].float().flatten(0, 1), y.flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    pretrain = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(warmup):
        step(pretrain)
    return model, step


def part_delta(root: Path, preset: str, steps: int, warmup: int) -> dict[str, Any]:
    model, step = _rl_model(preset, warmup)
    rl = torch.optim.AdamW(model.parameters(), lr=1e-6)
    rows = []
    folder = root / "delta"
    with CheckpointManager(folder, keep_last=None, incremental=steps + 1) as manager:
        previous = {k: v.clone() for k, v in model.state_dict().items()}
        manager.save(0, previous)
        for i in range(1, steps + 1):
            step(rl)
            weights = {k: v.clone() for k, v in model.state_dict().items()}
            manager.save(i, weights)
            manager.wait()
            raw = sum(t.nbytes for t in weights.values())
            same = sum(int((weights[k].view(torch.int16) == previous[k].view(torch.int16)).sum()) for k in weights)
            path = folder / f"step_{i:08d}.ckz"
            with open(path, "rb") as f:
                index = ContainerReader(f).index
            rows.append({"step": i, "raw_mb": raw / 2**20,
                         "identical": same / sum(t.numel() for t in weights.values()),
                         "format": ".".join(map(str, index.version)), "file_ratio": raw / path.stat().st_size,
                         "streams_ratio": raw / sum(e.compressed_nbytes for e in index.tensors),
                         "sparse_tensors": sum(isinstance(e.transform, Sparse) for e in index.tensors),
                         "tensors": len(index.tensors)})
            previous = weights
        restored = manager.restore(steps)
    if not all(torch.equal(restored[k].view(torch.uint8), v.view(torch.uint8)) for k, v in previous.items()):
        raise AssertionError(f"step {steps} did not restore bit-exactly")
    whole = (folder / "step_00000000.ckz").stat().st_size
    return {"preset": preset, "lr": 1e-6, "dtype": "bfloat16", "whole_ratio": rows[0]["raw_mb"] * 2**20 / whole,
            "steps": rows}


def configure(p: argparse.ArgumentParser) -> None:
    """The tier benchmark's arguments (``ckptzip bench tier``, or this module run)."""
    p.description = __doc__
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    p.add_argument("--mb", type=float, default=64, help="size of the tier parts' state, MB")
    p.add_argument("--saves", type=int, default=100, help="saves of the rss part")
    p.add_argument("--restores", type=int, default=3, help="fresh processes of the restore part")
    p.add_argument("--preset", default="tiny", help="model of the delta part")
    p.add_argument("--steps", type=int, default=5, help="RL steps of the delta part")
    p.add_argument("--warmup", type=int, default=20, help="steps at lr 1e-3 before them")
    p.add_argument("--json", default=None, help="write the result here too")


def run(args: argparse.Namespace) -> int:
    """Run the parts asked for; 2 (and nothing run) for an unknown part."""
    parts = [name for name in args.parts.split(",") if name]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        print(f"ckptzip bench tier: error: unknown part(s) {', '.join(unknown)}: choose from {', '.join(PARTS)}",
              file=sys.stderr)
        return 2
    result: dict[str, Any] = {"torch": torch.__version__, "ckptzip": ckptzip.__version__, "cpus": os.cpu_count()}
    with tempfile.TemporaryDirectory(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as tmp:
        root = Path(tmp)
        if {"rss", "restore"} & set(parts):
            result["rss"] = part_rss(root, args.mb, args.saves if "rss" in parts else 1)
        if "restore" in parts:
            result["restore"] = part_restore(root, args.restores)
        if "replicate" in parts:
            result["replicate"] = part_replicate(root, args.mb, 5)
        if "delta" in parts:
            result["delta"] = part_delta(root, args.preset, args.steps, args.warmup)
    text = json.dumps(result, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text)
    return 0


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m ckptzip_bench.tier")
    configure(p)
    sys.exit(run(p.parse_args()))


if __name__ == "__main__":
    main()
