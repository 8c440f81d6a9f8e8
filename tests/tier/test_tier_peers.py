"""What a peer can and cannot do to a rank's memory tier (two gloo ranks on loopback, managers
with replicated tiers): a fetch brings the step asked for and the bases the rank lacks, never a
replacement of the rank's own copy of a step; steps this tier would not name are refused."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from ckptzip_bench.launch import launch
from helpers import assert_same

import ckptzip
from ckptzip.manager import CheckpointManager, MemoryTier


def drifting(rank: int, step: int) -> dict[str, Any]:
    """Weights that move a little per step, so incremental saves store deltas."""
    w = torch.randn(1 << 14, generator=torch.Generator().manual_seed(rank))
    return {"step": step, "w": w * (1 + 1e-4 * step), "b": torch.arange(64) + 100 * step + rank}


def _manager(rank: int, tmp: Path, group: dist.ProcessGroup) -> CheckpointManager:
    tier = MemoryTier(keep=3, persist_every=100, path=tmp / f"shm{rank}", replicate=group)
    return CheckpointManager(tmp / f"run{rank}", keep_last=3, incremental=3, memory_tier=tier)


def _worker(rank: int, world: int, tmp_text: str) -> None:
    tmp = Path(tmp_text)
    group = dist.new_group(backend="gloo")
    manager = _manager(rank, tmp, group)
    for step in (1, 2, 3):  # 2 and 3 are deltas, each on the one before
        manager.save(step, drifting(rank, step))
    manager.wait()
    own = tmp / "shm0" / "own"
    if rank == 0:
        (own / "step_00000003.ckz").unlink()  # torn: rank 0 lacks step 3, its successor holds it
        before = (own / "step_00000002.ckz").read_bytes()
    else:  # the successor's copy of rank 0's step 2 is not rank 0's own (another run's, a peer's fault)
        ckptzip.save({"w": torch.zeros(3)}, tmp / "shm1" / "peer" / "step_00000002.ckz")
    dist.barrier()
    restorer = _manager(rank, tmp, group)
    assert restorer.latest_step() == 3
    assert_same(restorer.restore(), drifting(rank, 3))
    assert restorer.restored_from == ("peer" if rank == 0 else "memory")
    if rank == 0:
        assert (own / "step_00000002.ckz").read_bytes() == before  # the only copy of rank 0's step 2
        assert sorted(os.listdir(own)) == ["step_00000001.ckz", "step_00000002.ckz", "step_00000003.ckz"]
    dist.barrier()


def test_a_fetch_never_replaces_the_ranks_own_copy_of_a_step(tmp_path: Path) -> None:
    """A peer's copy of step 2 replaced the rank's own only copy of step 2 (in memory, not yet
    persisted), and the rank restored the peer's bytes."""
    launch(_worker, 2, str(tmp_path))
