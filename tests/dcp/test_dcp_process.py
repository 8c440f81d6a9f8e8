"""``dcp.async_save`` with DCP's checkpoint process (``AsyncCheckpointerType.PROCESS``) through
ckptzip's writer: the staged dict and the writer cross to the process with no CUDA object in
them, the files hold what was there when ``async_save`` returned, bit for bit, and a writer used
for several saves keeps no staging from one to the next.

The writer stages GPU tensors (coded on the GPU); on a CPU machine its staging is exercised by
having it stage host tensors the same way (``_staging.staged_here``), so the hand-over to the
process (placeholders, shared memory, the table) runs here too; the GPU cases are marked gpu.
"""

from __future__ import annotations

import pickle
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from helpers import assert_same
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from ckptzip.dcp import CompressedStorageReader, CompressedStorageWriter
from ckptzip.dcp import _staging
from ckptzip.errors import UsageError


def _state(device: str, mesh: Any = None) -> dict[str, Any]:
    g = torch.Generator(device=device).manual_seed(7)
    w = torch.randn(384, 256, generator=g, device=device)
    state: dict[str, Any] = {
        "model": {"w": w, "tied": w, "b": torch.randn(256, generator=g, device=device).bfloat16(),
                  "nan": torch.tensor([float("nan"), -0.0, 1.5], device=device).bfloat16(),
                  "empty": torch.empty(0, 3, device=device)},
        "optim": {"step": torch.tensor(3.0), "exp_avg": torch.randn(384, 256, generator=g, device=device),
                  "groups": [{"lr": 1e-3, "params": [0, 1]}]},
        "step": 12,
    }
    if mesh is not None:
        state["sharded"] = DTensor.from_local(torch.randn(64, 32, generator=g, device=device), mesh, [Shard(0)])
        state["replicated"] = DTensor.from_local(torch.arange(10, device=device), mesh, [Replicate()])
    return state


def _copy(value: Any, target: bool = False) -> Any:
    """A snapshot of ``value`` (``target``: zeros of its shapes, to load into)."""
    if isinstance(value, dict):
        return {k: _copy(v, target) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy(v, target) for v in value]
    if isinstance(value, DTensor):
        local = torch.zeros_like(value._local_tensor) if target else value._local_tensor.clone()
        return DTensor.from_local(local, value.device_mesh, value.placements, run_check=False)
    if isinstance(value, torch.Tensor):
        return torch.zeros_like(value) if target else value.clone()
    return value


def _local(value: Any) -> Any:
    """DTensors as their local tensors, on the host (what is compared bit for bit)."""
    if isinstance(value, dict):
        return {k: _local(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_local(v) for v in value]
    if isinstance(value, DTensor):
        return value._local_tensor.cpu()
    return value.cpu() if isinstance(value, torch.Tensor) else value


def _mutate(state: dict[str, Any]) -> None:
    for t in (*state["model"].values(), state["optim"]["exp_avg"]):
        t.add_(1)
    if "sharded" in state:
        state["sharded"]._local_tensor.add_(1)


def _saves_in_a_process(rank: int, world: int, root: Path, device: str, stager: str) -> None:
    if device == "cpu" and stager == "writer":
        _staging.staged_here = lambda t: True  # stage host tensors as GPU ones are (see the module)
    mesh = init_device_mesh(device, (world,))
    state = _state(device, mesh)
    writer = CompressedStorageWriter(root / "unused")
    async_stager = None
    for k in range(3):
        if stager == "default":  # as torchtitan's async_with_pinned_mem passes it (a new one each save:
            gpu = device == "cuda"  # torch 2.11 leaves one unusable after its first async_save)
            async_stager = DefaultStager(StagingOptions(use_pinned_memory=gpu, use_shared_memory=True,
                                                        use_async_staging=True, use_non_blocking_copy=gpu))
        before = _copy(state)
        future = dcp.async_save(state, checkpoint_id=root / f"s{k}", storage_writer=writer,
                                async_checkpointer_type=AsyncCheckpointerType.PROCESS, async_stager=async_stager)
        if async_stager is not None:
            future.staging_completion.result()
            future = future.upload_completion
        _mutate(state)  # training goes on once staging is done
        future.result()
        assert len(writer._staged) == 0, f"save {k}: the writer kept {len(writer._staged)} stagings"
        target = _copy(before, target=True)
        dcp.load(target, storage_reader=CompressedStorageReader(root / f"s{k}"))
        assert_same(_local(target), _local(before), f"save {k}")
        if device == "cuda":
            torch.cuda.synchronize()  # the caller's CUDA context is intact
            assert torch.equal((state["model"]["w"] * 0).sum().cpu(), torch.tensor(0.0))
        if async_stager is not None:
            async_stager.close()  # its save is written
    dist.barrier()


def _devices() -> list[Any]:
    return ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA device")])]


@pytest.mark.slow
@pytest.mark.parametrize("stager", ["writer", "default"])
@pytest.mark.parametrize("device", _devices())
def test_process_mode_saves_bit_exactly_and_keeps_no_staging(tmp_path: Path, device: str, stager: str) -> None:
    from ckptzip_bench.launch import launch

    launch(_saves_in_a_process, 1, tmp_path, device, stager,
           backend="cpu:gloo,cuda:nccl" if device == "cuda" else "gloo")


def test_staged_gpu_tensors_are_placeholders_found_by_offset(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(_staging, "staged_here", lambda t: True)
    state = _state("cpu")
    writer = CompressedStorageWriter(tmp_path / "a")
    staged = writer.stage(state)
    w, tied, exp_avg = staged["model"]["w"], staged["model"]["tied"], staged["optim"]["exp_avg"]
    assert w.is_meta and (w.dtype, w.shape) == (torch.float32, (384, 256))
    assert tied.storage_offset() == w.storage_offset() != exp_avg.storage_offset()  # one entry for both
    pending = writer._staged[0]
    assert pending is not None
    assert pending.position(exp_avg) == exp_avg.storage_offset() - 1
    stranger = torch.empty(384, 256, device="meta")[:]  # offset 0: no staged position
    with pytest.raises(UsageError, match="matches nothing it staged"):
        pending.position(stranger)
    writer.close()
    assert len(writer._staged) == 0


def test_pickling_the_writer_hands_its_staging_over(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """What DCP's process checkpointer does: the writer and the staged dict in one message."""
    monkeypatch.setattr(_staging, "staged_here", lambda t: True)
    state = _state("cpu")
    writer = CompressedStorageWriter(tmp_path / "p")
    writer.set_up_storage_writer(True)
    staged = writer.stage(state)
    message = bytes(ForkingPickler.dumps((staged, writer)))
    assert len(writer._staged) == 0  # handed over, not kept
    got_dict, got_writer = pickle.loads(message)
    (handed,) = got_writer._staged
    assert all(t.is_meta or t.is_shared() or not t.numel() for t in handed.host.state.table.tensors)
    dcp.save(got_dict, storage_writer=got_writer, no_dist=True)
    target = _copy(state, target=True)
    dcp.load(target, storage_reader=CompressedStorageReader(tmp_path / "p"), no_dist=True)
    assert_same(target, state)


def test_a_meta_tensor_without_its_staging_is_refused(tmp_path: Path) -> None:
    with pytest.raises(CheckpointException) as excinfo:
        dcp.save({"w": torch.empty(4, device="meta")}, storage_writer=CompressedStorageWriter(tmp_path), no_dist=True)
    ((error, _),) = excinfo.value.failures.values()
    assert isinstance(error, UsageError)
    assert "item 'w' (chunk at offsets [0]) is a meta tensor" in str(error)


def test_a_sharded_tensor_staged_on_a_gpu_is_refused_by_the_process_checkpointer(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A ShardedTensor's shards are found by their memory, which DCP's process does not share."""
    monkeypatch.setattr(_staging, "staged_here", lambda t: True)
    writer = CompressedStorageWriter(tmp_path / "p")
    writer.stage(_state("cpu"))
    pending = writer._staged[0]
    assert pending is not None
    pending.positions[_staging.key_of(torch.ones(1))] = 0  # as a ShardedTensor's shard is recorded
    with pytest.raises(UsageError, match="ShardedTensor on a GPU"):
        ForkingPickler.dumps(writer)
    assert len(writer._staged) == 0 and not pending.host.state.jobs  # given back, not kept
