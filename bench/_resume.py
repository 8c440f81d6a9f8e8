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

from ckptzip.dcp._launch import launch
from ckptzip.tree import iter_leaves

_REPORT = "report.json"


def state_bytes(tree: Any) -> list[tuple[str, bytes]]:
    """Every tensor of ``tree`` with its path, as its raw bytes (what "bit-exact" compares)."""
    return [
        (path, value.detach().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
        for path, value in iter_leaves(tree)
        if isinstance(value, torch.Tensor)
    ]


def directory_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def write_report(root: Path, report: dict[str, Any]) -> None:
    """What rank 0 hands to :func:`run`; ``report["ok"]`` says whether every check passed."""
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
