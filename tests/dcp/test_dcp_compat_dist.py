"""DCP compatibility on 2 gloo ranks, against FileSystemWriter/Reader and ckptzip's: DTensor
resharding (placement and mesh changes), ShardedTensor resharding, and a DDP run saved and
resumed bit-exactly with a torchtitan-style io.BytesIO train state.

One launch per storage runs every case, so the suite costs two process-group start-ups.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from dcp_storages import STORAGES
from helpers import assert_same
from torch import nn
from torch.distributed._shard import sharded_tensor
from torch.distributed._shard.sharding_spec import ChunkShardingSpec
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.nn.parallel import DistributedDataParallel

from ckptzip_bench.launch import launch

pytestmark = pytest.mark.slow

FULL = torch.arange(8 * 6, dtype=torch.float32).reshape(8, 6).mul_(1.25).sub_(7)


def _sharded(full: torch.Tensor, dim: int, world: int) -> Any:
    """A ShardedTensor of ``full`` split along ``dim``, one chunk per rank."""
    spec = ChunkShardingSpec(dim=dim, placements=[f"rank:{r}/cpu" for r in range(world)])
    tensor = sharded_tensor.empty(spec, *full.shape)
    for shard in tensor.local_shards():
        region = full
        for d, (start, size) in enumerate(zip(shard.metadata.shard_offsets, shard.metadata.shard_sizes)):
            region = region.narrow(d, start, size)
        shard.tensor.copy_(region)
    return tensor


def _check_sharded(tensor: Any, full: torch.Tensor, where: str) -> None:
    for shard in tensor.local_shards():
        region = full
        for d, (start, size) in enumerate(zip(shard.metadata.shard_offsets, shard.metadata.shard_sizes)):
            region = region.narrow(d, start, size)
        assert_same(shard.tensor, region.contiguous(), where)


def _reshard(rank: int, world: int, root: Path, storage: str) -> None:
    """Save DTensor and ShardedTensor state split by rows; load it split by columns, replicated,
    and on a 2-D mesh."""
    s = STORAGES[storage]
    mesh = init_device_mesh("cpu", (world,))
    dcp.save({"dt": distribute_tensor(FULL, mesh, [Shard(0)]), "st": _sharded(FULL, 0, world)},
             storage_writer=s.writer(root / "reshard"))
    mesh_2d = init_device_mesh("cpu", (1, world))
    targets = {
        "columns": (mesh, [Shard(1)]), "replicated": (mesh, [Replicate()]), "2-D mesh": (mesh_2d, [Shard(0), Shard(1)]),
    }
    for name, (target_mesh, placements) in targets.items():
        empty = torch.zeros_like(FULL)
        state = {"dt": distribute_tensor(empty, target_mesh, placements), "st": _sharded(empty, 1, world)}
        dcp.load(state, storage_reader=s.reader(root / "reshard"))
        assert_same(state["dt"].full_tensor(), FULL, f"DTensor {name}")
        _check_sharded(state["st"], FULL, f"ShardedTensor {name}")


def _ddp(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 3)))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, rank: int, step: int) -> None:
    generator = torch.Generator().manual_seed(1000 * step + rank)
    model(torch.randn(4, 12, generator=generator)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def _ddp_resume(rank: int, world: int, root: Path, storage: str) -> None:
    """Train 3 steps, save with a BytesIO train state, resume a fresh model from it: the state
    and the next step match the uninterrupted run bit for bit."""
    s = STORAGES[storage]
    model, optimizer = _ddp(seed=0)
    for step in range(3):
        _step(model, optimizer, rank, step)
    loader = io.BytesIO(b"shard position 3 of the data loader")
    loader.seek(6)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd, "train": {"step": 3, "loader": loader}},
             storage_writer=s.writer(root / "ddp"))

    resumed, resumed_optimizer = _ddp(seed=1)
    model_sd, optim_sd = get_state_dict(resumed, resumed_optimizer)
    state = {"model": model_sd, "optim": optim_sd, "train": {"step": 0, "loader": io.BytesIO()}}
    dcp.load(state, storage_reader=s.reader(root / "ddp"))
    set_state_dict(resumed, resumed_optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    train = state["train"]
    assert (train["step"], train["loader"].getvalue(), train["loader"].tell()) == (3, loader.getvalue(), 6)
    _step(model, optimizer, rank, 3)
    _step(resumed, resumed_optimizer, rank, 3)
    assert_same(get_state_dict(resumed, resumed_optimizer), get_state_dict(model, optimizer), "after resume")


def _every_case(rank: int, world: int, root: Path, storage: str) -> None:
    _reshard(rank, world, root, storage)
    dist.barrier()
    _ddp_resume(rank, world, root, storage)


@pytest.mark.parametrize("storage", sorted(STORAGES))
def test_resharding_and_ddp_resume(storage: str, tmp_path: Path) -> None:
    launch(_every_case, 2, tmp_path, storage)
