"""ckptzip.dcp with real process groups: FSDP2 + DTensor state saved on 4 ranks and loaded on 2
and 1, async_save, bit-exact checks, and size against DCP's FileSystemWriter (plain and zstd).

CPU ranks use gloo; the GPU test runs the same path on one GPU with NCCL.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from helpers import assert_same
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint._extension import ZStandard
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from ckptzip.codecs import gpu_first_ids, has_codec
from ckptzip.dcp import CompressedStorageReader, CompressedStorageWriter
from ckptzip.dcp._convert import _load_full_state
from ckptzip_bench.launch import launch

pytestmark = pytest.mark.slow

TABLE_SHAPE = (10, 6)  # split 3/3/3/1 over 4 ranks and 5/5 over 2: uneven shards


def _model(device: str, mesh: Any) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 256), nn.LayerNorm(256)).to(device)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _train(model: nn.Module, device: str, steps: int, seed: int) -> torch.optim.Optimizer:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(8, 256, generator=generator).to(device)
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return optimizer


def _table(mesh: Any, device: str, fill: bool) -> DTensor:
    full = torch.zeros(TABLE_SHAPE, dtype=torch.bfloat16)
    if fill:
        full = torch.randn(TABLE_SHAPE, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    return distribute_tensor(full.to(device), mesh, [Shard(0)])


def _state(model: nn.Module, optimizer: torch.optim.Optimizer, table: DTensor, step: int) -> dict[str, Any]:
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optim": optim_sd, "table": table, "step": step}


def _full_state(model: nn.Module, optimizer: torch.optim.Optimizer, table: DTensor, step: int) -> dict[str, Any]:
    """The unsharded state, on the CPU (a collective; the model and optimizer parts only on rank 0)."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
    return {"model": model_sd, "optim": optim_sd, "table": table.full_tensor().cpu(), "step": step}


def _set_state(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.iterdir())


def _save_worker(rank: int, world: int, root: Path, device: str) -> None:
    """Train, then save the same sharded state with ckptzip (sync and async) and with DCP's
    FileSystemWriter (plain and zstd); rank 0 keeps the unsharded state as the reference."""
    mesh = init_device_mesh(device.split(":")[0], (world,))
    model = _model(device, mesh)
    optimizer = _train(model, device, steps=3, seed=100)
    table = _table(mesh, device, fill=True)
    state = _state(model, optimizer, table, step=3)
    writers = {
        "ckptzip": CompressedStorageWriter(root / "ckptzip"),
        "dcp": FileSystemWriter(root / "dcp"),
        "dcp_zstd": FileSystemWriter(root / "dcp_zstd", _extensions=[ZStandard()]),
    }
    seconds = {}
    for name, writer in writers.items():
        dist.barrier()
        start = time.perf_counter()
        dcp.save(state, storage_writer=writer)
        seconds[name] = time.perf_counter() - start
    dcp.async_save(state, storage_writer=CompressedStorageWriter(root / "ckptzip_async")).result()
    full = _full_state(model, optimizer, table, step=3)
    if rank == 0:
        torch.save({"state": full, "seconds": seconds}, root / "reference.pt")
    dist.barrier()


def _load_and_compare(rank: int, world: int, root: Path, device: str, name: str, expected: Any) -> None:
    """Load checkpoint ``name`` into a differently trained model of this world size and compare the
    unsharded result bit-exactly with ``expected`` (on rank 0, which holds the unsharded state)."""
    mesh = init_device_mesh(device.split(":")[0], (world,))
    model = _model(device, mesh)
    optimizer = _train(model, device, steps=1, seed=200)  # creates optimizer state to load into
    table = _table(mesh, device, fill=False)
    state = _state(model, optimizer, table, step=0)
    dcp.load(state, storage_reader=CompressedStorageReader(root / name))
    _set_state(model, optimizer, state)
    full = _full_state(model, optimizer, table, step=state["step"])
    if rank == 0:
        assert_same(full, expected, name)


def _two_rank_worker(rank: int, world: int, root: Path, device: str) -> None:
    """Load the 4-rank checkpoints (resharding), then save and load this world's own state."""
    reference = torch.load(root / "reference.pt", weights_only=True)["state"]
    for name in ("ckptzip", "ckptzip_async"):
        _load_and_compare(rank, world, root, device, name, reference)
    _roundtrip_worker(rank, world, root, device)


def _roundtrip_worker(rank: int, world: int, root: Path, device: str) -> None:
    """Save (sync and async) and load back on the same ranks."""
    mesh = init_device_mesh(device.split(":")[0], (world,))
    model = _model(device, mesh)
    optimizer = _train(model, device, steps=2, seed=300)
    table = _table(mesh, device, fill=True)
    expected = _full_state(model, optimizer, table, step=2)
    state = _state(model, optimizer, table, step=2)
    dcp.save(state, storage_writer=CompressedStorageWriter(root / f"sync{world}"))
    dcp.async_save(state, storage_writer=CompressedStorageWriter(root / f"async{world}")).result()
    if device.startswith("cuda") and has_codec("ans", "cuda"):
        # GPU shards were compressed on the GPU: the stored pipelines name nvCOMP's codecs.
        metadata = CompressedStorageReader(root / f"sync{world}").read_metadata()
        codecs = {c["id"] for item in metadata.storage_data.values() for c in item.pipeline["codecs"]}
        assert codecs & set(gpu_first_ids()), codecs
    for name in (f"sync{world}", f"async{world}"):
        _load_and_compare(rank, world, root, device, name, expected)


@pytest.fixture(scope="module")
def saved_on_4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("dcp4")
    launch(_save_worker, 4, root, "cpu")
    return root


def test_load_on_2_ranks_and_roundtrip_on_2(saved_on_4: Path) -> None:
    launch(_two_rank_worker, 2, saved_on_4, "cpu")
    assert sorted(os.listdir(saved_on_4 / "sync2")) == [".metadata.ckz", "__0.ckzd", "__1.ckzd"]


def test_load_on_1_process(saved_on_4: Path) -> None:
    reference = torch.load(saved_on_4 / "reference.pt", weights_only=True)["state"]
    loaded = _load_full_state(saved_on_4 / "ckptzip")  # no process group
    # DCP rebuilds the nested dicts in its metadata's item order, not the optimizer's key order
    assert_same(loaded, reference, "one-process load", key_order=False)


def test_smaller_than_dcp_filesystem_writer_plain_and_zstd(saved_on_4: Path) -> None:
    sizes = {name: _dir_bytes(saved_on_4 / name) for name in ("ckptzip", "dcp", "dcp_zstd")}
    seconds = torch.load(saved_on_4 / "reference.pt", weights_only=True)["seconds"]
    print(f"\n4-rank FSDP2 + AdamW state: bytes {sizes}, save seconds {seconds}")
    # fp32 weights and Adam moments: only the sign/exponent byte plane compresses (docs/DCP.md).
    assert sizes["ckptzip"] < 0.95 * sizes["dcp_zstd"], sizes
    assert sizes["dcp_zstd"] < sizes["dcp"], sizes


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_one_gpu_nccl(tmp_path: Path) -> None:
    launch(_roundtrip_worker, 1, tmp_path, "cuda", backend="cpu:gloo,cuda:nccl")
