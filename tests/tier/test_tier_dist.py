"""The memory tier across ranks (gloo, loopback): ring replication of every commit, and a
collective restore that gives every rank the newest step complete on every rank, bit-exact,
after the loss of one rank's node (its tier and files), torn steps, damaged tier copies and
kill -9 of the trainers at any moment.

Ranks are separate processes started here (so they can be killed); run as a script, this file
is one rank: ``python test_tier_dist.py <mode> <rank> <world> <port> <root> [out]``.
"""

from __future__ import annotations

import datetime
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from helpers import assert_same

import ckptzip
from ckptzip_bench.launch import free_port
from ckptzip.manager import CheckpointManager, MemoryTier

pytestmark = pytest.mark.slow

WORLD = 3
TIMEOUT = datetime.timedelta(seconds=60)  # a rank waiting for a dead peer gives up after this


def rank_state(rank: int, step: int) -> dict[str, Any]:
    """Weights that drift per step and differ per rank (incremental saves store deltas)."""
    w = torch.randn(1 << 14, generator=torch.Generator().manual_seed(rank))
    return {"step": step, "rank": rank, "w": w * (1 + 1e-4 * step), "b": torch.arange(64) + step * 100 + rank}


def paths(root: Path, rank: int) -> tuple[Path, Path]:
    """A rank's "node": its checkpoint directory and its memory tier."""
    return root / f"node{rank}" / "run", root / f"node{rank}" / "shm"


def manager(rank: int, root: Path, group: Any) -> CheckpointManager:
    run, shm = paths(root, rank)
    tier = MemoryTier(keep=2, persist_every=4, path=shm, replicate=group)
    return CheckpointManager(run, keep_last=2, incremental=3, memory_tier=tier)


def rank_main(mode: str, rank: int, world: int, port: int, root: Path, out: str) -> None:
    """One rank: ``save-N`` saves steps 1..N and exits without closing (as a crash after the last
    commit would); ``forever`` saves until killed; ``restore`` writes what it restored to ``out``."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=TIMEOUT)
    group = "world" if mode == "restore" else dist.new_group(backend="gloo", timeout=TIMEOUT)
    m = manager(rank, root, group)
    if mode == "restore":
        latest = m.latest_step()
        state = m.restore()
        assert state["step"] == latest
        ckptzip.save(state, out)
        print(json.dumps({"step": latest, "from": m.restored_from}), flush=True)
        m.close()
        dist.destroy_process_group()
        return
    step = (m.latest_step() or 0) + 1
    last = int(mode.removeprefix("save-")) if mode.startswith("save-") else None
    while last is None or step <= last:
        m.save(step, rank_state(rank, step))
        print(step, flush=True)
        step += 1
    m.wait()
    os._exit(0)  # no close(): the newest commits stay in memory and on the peer only


def ranks(mode: str, root: Path, out: Path | None = None) -> list[subprocess.Popen[str]]:
    port = free_port()
    return [subprocess.Popen([sys.executable, __file__, mode, str(r), str(WORLD), str(port), str(root),
                              str(out / f"rank{r}.ckz") if out else "-"], stdout=subprocess.PIPE, text=True)
            for r in range(WORLD)]


def finish(procs: list[subprocess.Popen[str]]) -> list[str]:
    outputs = []
    for proc in procs:
        try:
            stdout, _ = proc.communicate(timeout=240)
        finally:
            if proc.poll() is None:
                proc.kill()
        assert proc.returncode == 0, f"rank exited with {proc.returncode}"
        outputs.append(stdout)
    return outputs


def restore_all(root: Path, tmp: Path) -> list[dict[str, Any]]:
    """Restore on every rank; check every rank got the same step, bit-exact; what each said."""
    out = tmp / f"out-{time.monotonic_ns()}"
    out.mkdir()
    reports = [json.loads(text.strip().splitlines()[-1]) for text in finish(ranks("restore", root, out))]
    assert len({r["step"] for r in reports}) == 1, reports
    for rank, report in enumerate(reports):
        assert_same(ckptzip.load(out / f"rank{rank}.ckz"), rank_state(rank, report["step"]))
    return reports


def test_a_lost_node_restores_from_its_peer(tmp_path: Path) -> None:
    root = tmp_path / "nodes"
    finish(ranks("save-5", root))
    shutil.rmtree(root / "node1")  # its tier and its files
    reports = restore_all(root, tmp_path)
    assert [r["step"] for r in reports] == [5] * WORLD
    assert [r["from"] for r in reports] == ["memory", "peer", "memory"]
    reports = restore_all(root, tmp_path)  # the fetched copy now is in its own tier
    assert [r["from"] for r in reports] == ["memory"] * WORLD


def test_a_step_missing_on_one_rank_is_restored_on_none(tmp_path: Path) -> None:
    root = tmp_path / "nodes"
    finish(ranks("save-5", root))
    name = "step_00000005.ckz"
    (paths(root, 0)[1] / "own" / name).unlink()  # torn: rank 0 never committed step 5 ...
    (paths(root, 1)[1] / "peer" / name).unlink()  # ... so its peer never got it
    reports = restore_all(root, tmp_path)
    assert [r["step"] for r in reports] == [4] * WORLD


def test_a_job_resumed_from_the_agreed_step_replaces_the_newer_steps_of_single_ranks(tmp_path: Path) -> None:
    root = tmp_path / "nodes"
    finish(ranks("save-5", root))
    name = "step_00000005.ckz"
    (paths(root, 0)[1] / "own" / name).unlink()  # rank 0 never committed step 5; ranks 1 and 2 did
    (paths(root, 1)[1] / "peer" / name).unlink()
    finish(ranks("save-7", root))  # resumes after the agreed step 4: ranks 1 and 2 save 5 again
    reports = restore_all(root, tmp_path)
    assert [r["step"] for r in reports] == [7] * WORLD


def test_a_damaged_tier_copy_is_replaced_by_the_peers(tmp_path: Path) -> None:
    root = tmp_path / "nodes"
    finish(ranks("save-5", root))
    own = paths(root, 2)[1] / "own" / "step_00000005.ckz"
    data = bytearray(own.read_bytes())
    data[len(data) // 2] ^= 0x10
    own.write_bytes(bytes(data))
    reports = restore_all(root, tmp_path)
    assert [r["step"] for r in reports] == [5] * WORLD
    assert reports[2]["from"] == "peer"
    held = sorted(os.listdir(paths(root, 0)[1] / "peer"))  # retention bounds the peer copies
    assert held[-1] == "step_00000005.ckz" and len(held) <= 3


def test_kill_9_of_every_trainer_at_any_moment(tmp_path: Path) -> None:
    chance = random.Random(2026)
    root = tmp_path / "nodes"
    for trial in range(3):
        procs = ranks("forever", root)
        for _ in range(chance.randint(2, 5)):
            for proc in procs:
                assert proc.stdout is not None and proc.stdout.readline()
        time.sleep(chance.uniform(0.0, 0.3))
        victims = procs[:]
        chance.shuffle(victims)
        for proc in victims:  # one dies; the job's launcher then stops the others
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=60)
        if trial == 2:
            shutil.rmtree(root / f"node{chance.randrange(WORLD)}")  # and a node is lost
        expected = _newest_complete(root)
        reports = restore_all(root, tmp_path)
        assert reports[0]["step"] == expected


def _newest_complete(root: Path) -> int:
    """The newest step that every rank holds in its own tier or directory, or its successor's tier."""
    def steps(path: Path) -> set[int]:
        return {int(n[5:-4]) for n in os.listdir(path) if n.endswith(".ckz")} if path.is_dir() else set()
    available = []
    for rank in range(WORLD):
        run, shm = paths(root, rank)
        available.append(steps(run) | steps(shm / "own") | steps(paths(root, (rank + 1) % WORLD)[1] / "peer"))
    return max(set.intersection(*available))


if __name__ == "__main__":
    mode, rank, world, port, root, out = sys.argv[1:7]
    rank_main(mode, int(rank), int(world), int(port), Path(root), out)
