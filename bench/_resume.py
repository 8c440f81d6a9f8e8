"""What bench/deepspeed_gpu.py and bench/megatron_gpu.py share: start the ranks, compare states
bit for bit, and report one JSON line (exit status 1 when a check failed)."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ckptzip_bench.launch import launch
from ckptzip.tree import iter_leaves

_REPORT = "report.json"


def state_bytes(tree: Any) -> dict[str, bytes]:
    """Every tensor of ``tree`` by its path, as its raw bytes (what "bit-exact" compares)."""
    return {
        path: value.detach().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()
        for path, value in iter_leaves(tree)
        if isinstance(value, torch.Tensor)
    }


def differing(got: dict[str, bytes], want: dict[str, bytes]) -> list[str]:
    """The paths whose bytes differ, or that only one of the two states holds."""
    return sorted(path for path in got.keys() | want.keys() if got.get(path) != want.get(path))


def directory_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def checked(directory: Path, save_s: float, load_s: float, load_diff: list[str], resume_diff: list[str],
            world: int) -> dict[str, Any]:
    """One engine's or backend's entry of the report, its checks gathered from every rank: the
    paths (up to 8) where a loaded state differs from the saved one, or a resumed run from an
    uninterrupted one."""
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, (load_diff, resume_diff))
    loads = sorted({p for g in gathered for p in g[0]})
    resumes = sorted({p for g in gathered for p in g[1]})
    entry = {"bytes": directory_bytes(directory), "save_s": round(save_s, 3), "load_s": round(load_s, 3),
             "load_bit_exact": not loads, "resume_bit_exact": not resumes}
    if loads:
        entry["load_differs"] = loads[:8]
    if resumes:
        entry["resume_differs"] = resumes[:8]
    return entry


def arguments(description: str) -> argparse.ArgumentParser:
    """A parser with the options every such bench takes (ranks, steps, batch size, report file)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--nproc", type=int, default=1)
    parser.add_argument("--steps", type=int, default=5, help="steps before the save, and again after it")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--json", help="also write the report here")
    return parser


def write_report(root: Path, report: dict[str, Any], results: dict[str, dict[str, Any]],
                 ok: bool | None = None) -> None:
    """What rank 0 hands to :func:`run`: ``report`` and ``results`` (by engine or backend), with
    the versions, the GPU and ``ok`` added (default: whether every load and resume was bit-exact)."""
    if ok is None:
        ok = all(r["load_bit_exact"] and r["resume_bit_exact"] for r in results.values())
    report |= {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(0), "results": results, "ok": ok}
    (root / _REPORT).write_text(json.dumps(report))


def run(worker: Callable[..., None], args: argparse.Namespace) -> None:
    """``worker(rank, world, args, root)`` on ``args.nproc`` GPUs (NCCL), rank 0 ending with
    :func:`write_report`. Prints the report as one line, writes it to ``args.json`` if given, and
    exits 1 unless it is ok."""
    with tempfile.TemporaryDirectory() as root:
        launch(worker, args.nproc, args, Path(root), backend="nccl")
        report = json.loads((Path(root) / _REPORT).read_text())
    print(json.dumps(report), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    if not report["ok"]:
        sys.exit(f"{sys.argv[0]}: a loaded or resumed state differs from the saved or uninterrupted one")
