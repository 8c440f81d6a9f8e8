"""Issue 26's peer figures on one GPU machine: two ranks (processes sharing the GPU, a gloo
group over loopback) save a state of 7B-like shapes each (``--gib``, on the GPU) to a
``CheckpointManager`` whose memory tier replicates every commit to the other rank; the trainers
exit without closing, then rank 1's "node" is lost (its tier and directory deleted) and two fresh
processes restore: rank 0 from its own memory, rank 1 from its peer's copy.

Reported: each save's block and its time until committed and replicated; the link (a stream
of the compressed file's size from rank 0 to rank 1 in the tier's pieces, nothing read or
written, median of 3, in the same processes);
each restore's seconds, where it read, bit-exactness against the state rebuilt from its seed,
and a second restore in the same process (from memory on both ranks by then), so that the
peer restore's extra time can be set against the compressed bytes and the link's speed; each
process's peak RSS.

    python3 bench/peer_gpu.py --gib 8 --json peer.json
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import io
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

WORLD = 2
TIMEOUT = datetime.timedelta(minutes=10)


def _node(root: Path, rank: int) -> tuple[Path, Path]:
    """A rank's checkpoint directory and its memory tier."""
    return root / f"node{rank}" / "run", root / f"node{rank}" / "shm"


class _Zeros(io.RawIOBase):
    """``nbytes`` of a file that costs nothing to read (its pieces are sent as they are)."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes, self.at = nbytes, 0

    def seek(self, offset: int, whence: int = 0) -> int:
        self.at = self.nbytes if whence == 2 else offset
        return self.at

    def readinto(self, buffer: Any) -> int:
        n = min(len(buffer), self.nbytes - self.at)
        self.at += n
        return n


class _Discard(io.RawIOBase):
    """A file that keeps nothing of what is written to it."""

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        return memoryview(data).nbytes


def _link_gbs(nbytes: int) -> float:
    """GB/s of a stream of ``nbytes`` from rank 0 to rank 1 as the tier sends its files (pieces
    of ``PIECE_BYTES``), with nothing read or written: the link as the tier uses it (median of 3)."""
    from ckptzip.tier.ring import Ring

    ring = Ring(dist.new_group(backend="gloo", timeout=TIMEOUT))
    times = []
    for _ in range(3):
        dist.barrier()
        t = time.perf_counter()
        files = [(1, _Zeros(nbytes))] if ring.rank == 0 else None
        ring.stream(files, forward=True, send=ring.rank == 0, expect=ring.rank == 1,  # type: ignore[arg-type]
                    accept=lambda step, size: contextlib.nullcontext(_Discard()))  # kept (else never sent), not written
        dist.barrier()
        times.append(time.perf_counter() - t)
    return nbytes / statistics.median(times) / 1e9


def rank_main(mode: str, rank: int, port: int, root: Path, gib: float, device: str) -> None:
    """``save``: save step 1 (replicated), measure the link, exit without closing; ``restore``:
    restore twice (collectively) and check the state."""
    from ckptzip_bench.training_job import llama_like_state, nbytes, same

    from ckptzip.manager import CheckpointManager, MemoryTier

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                            timeout=TIMEOUT)
    torch.zeros(1, device=device)
    sync = torch.cuda.synchronize if device == "cuda" else lambda: None
    run, shm = _node(root, rank)
    group = dist.new_group(backend="gloo", timeout=TIMEOUT) if mode == "save" else "world"
    manager = CheckpointManager(run, keep_last=1, memory_tier=MemoryTier(keep=1, persist_every=1000, path=shm,
                                                                        replicate=group))
    row: dict[str, object] = {"rank": rank, "mode": mode}
    if mode == "save":
        state = llama_like_state(gib, device, seed=1 + rank)
        dist.barrier()
        sync()
        t = time.perf_counter()
        manager.save(1, state)
        sync()
        row["blocked_s"] = round(time.perf_counter() - t, 4)
        manager.wait()  # committed to the tier and replicated to the peer
        row["replicated_s"] = round(time.perf_counter() - t, 3)
        row["state_gb"] = round(nbytes(state) / 1e9, 2)
        own = sum(p.stat().st_size for p in (shm / "own").glob("*.ckz"))
        row["file_gb"] = round(own / 1e9, 3)
        row["link_gbs"] = round(_link_gbs(own), 2)
    else:
        for key in ("restore_s", "again_s"):
            dist.barrier()
            sync()
            t = time.perf_counter()
            state = manager.restore()
            sync()
            row[key] = round(time.perf_counter() - t, 3)
            row[key.replace("_s", "_from")] = manager.restored_from
            if key == "restore_s":
                row["bit_exact"] = same(state, llama_like_state(gib, device, seed=1 + rank))
            del state
    row["peak_rss_gb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6, 2)
    print(json.dumps(row), flush=True)
    dist.barrier()
    os._exit(0)  # no close(): the trainer is gone, its tier stays (and close would persist it to disk)


def _ranks(mode: str, root: Path, args: argparse.Namespace) -> list[dict[str, object]]:
    from ckptzip_bench.launch import free_port

    port = free_port()
    procs = [subprocess.Popen([sys.executable, __file__, "--rank", mode, str(r), str(port), str(root), str(args.gib),
                               args.device],
                              stdout=subprocess.PIPE, text=True) for r in range(WORLD)]
    rows = []
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=args.timeout_s)
            if proc.returncode != 0:
                raise RuntimeError(f"a {mode} rank exited with {proc.returncode}")
            rows.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for proc in procs:  # a rank whose peer failed would wait for it until the group's timeout
            if proc.poll() is None:
                proc.kill()
    return rows


def main() -> None:
    if sys.argv[1:2] == ["--rank"]:
        mode, rank, port, root, gib, device = sys.argv[2:8]
        rank_main(mode, int(rank), int(port), Path(root), float(gib), device)
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gib", type=float, default=8, help="each rank's state")
    p.add_argument("--shm", default="/dev/shm", help="where the ranks' memory tiers and directories live")
    p.add_argument("--device", default="cuda", help="where the states live (cpu: a dry run of the script)")
    p.add_argument("--timeout-s", type=float, default=400)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    where = torch.cuda.get_device_name() if args.device == "cuda" else args.device
    print(json.dumps({"device": where, "torch": torch.__version__, "ranks": WORLD}), flush=True)
    root = Path(tempfile.mkdtemp(prefix="ckptzip-peer-", dir=args.shm))
    try:
        rows = _ranks("save", root, args)
        shutil.rmtree(root / "node1")  # rank 1's node is lost: its tier and its files
        rows += _ranks("restore", root, args)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    for row in rows:
        print(json.dumps(row), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
