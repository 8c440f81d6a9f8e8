"""``StagedState.portable``: a staging handed to another process (as DCP's checkpoint process and
torch_checkpointing's writer process receive it) carries no CUDA object and no private memory,
and writes the container a staging written in place writes, byte for byte."""

from __future__ import annotations

import io
import pickle
import sys
from multiprocessing.reduction import ForkingPickler
from typing import Any

import pytest
import torch
from helpers import assert_same, shared_rss

import ckptzip
from ckptzip.engine.policy import Policy
from ckptzip.memory.pinned import PinnedPool
from ckptzip.memory.shared import shared_copy, shared_empty
from ckptzip.engine.plan import GpuLimits
from ckptzip.engine.staged import StagedState, stage_table, staged_table, write_staged
from ckptzip.tree import flatten

POLICY = Policy.parse("auto")


def _state(device: str) -> dict[str, Any]:
    g = torch.Generator(device=device).manual_seed(3)
    master = torch.randn(640, 512, generator=g, device=device)
    return {"master": master, "w": master.bfloat16(), "dup": master, "other": torch.randn(3000, generator=g, device=device),
            "ints": torch.arange(100, device=device), "empty": torch.empty(0, 4, device=device), "step": 7}


def _stage(state: dict[str, Any], pool: PinnedPool) -> tuple[StagedState, Any]:
    flat = flatten(state)
    tensors = [t.tensor for t in flat.tensors]
    staged = stage_table(staged_table([t.name for t in flat.tensors], tensors, None), POLICY,
                         GpuLimits.of(tensors, POLICY, None, 1 << 20), pool)
    return staged, flat.tree


def _written(staged: StagedState, tree: Any) -> bytes:
    f = io.BytesIO()
    write_staged(f, staged, tree, POLICY)
    return f.getvalue()


def _through_a_pickle(staged: StagedState) -> StagedState:
    """What torch.multiprocessing sends another process (received here, in this one)."""
    return _received(staged.portable())


def _received(portable: StagedState) -> StagedState:
    got = pickle.loads(bytes(ForkingPickler.dumps(portable)))
    assert isinstance(got, StagedState)
    return got


def test_shared_memory_helpers() -> None:
    t = torch.randn(5, 3).t()  # not contiguous
    copy = shared_copy(t)
    assert copy.is_shared() and copy.is_contiguous() and torch.equal(copy, t)
    assert shared_empty(10).is_shared() and shared_empty(0).numel() == 0
    assert shared_copy(torch.tensor(2.5)).shape == ()


def test_a_host_staging_crosses_as_shared_memory_and_writes_the_same_bytes() -> None:
    state = _state("cpu")
    staged, tree = _stage(state, PinnedPool())
    handed = _through_a_pickle(staged)
    assert handed.pool is None and not handed.jobs
    assert all(t.is_shared() or not t.numel() for t in handed.table.tensors)
    again, _ = _stage(state, PinnedPool())
    data = _written(handed, tree)
    assert data == _written(again, tree)
    assert_same(ckptzip.load(data), state)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("shared", [False, True])
def test_a_gpu_staging_crosses_without_cuda_objects(shared: bool) -> None:
    state = _state("cuda")
    pool = PinnedPool(1 << 20, sys.maxsize, shared=shared)
    staged, tree = _stage(state, pool)
    assert staged.jobs  # coded on the GPU
    portable = staged.portable()
    assert all(job.ready is None and job.release is None for job in portable.jobs)
    assert all(job.piece[0].is_shared() or not job.piece[1] for job in portable.jobs)
    assert all(not t.is_cuda for t in portable.table.tensors)
    if shared:  # the pool's own buffers, handed over as they are
        buffers = {job.piece[0].untyped_storage().data_ptr() for job in staged.jobs if job.piece[1]}
        assert buffers <= {job.piece[0].untyped_storage().data_ptr() for job in portable.jobs}
    handed = pickle.loads(bytes(ForkingPickler.dumps(portable)))
    staged.release()  # (a shared pool's buffers: once the other process is done with them)
    assert pool._free.qsize() == pool._created
    data = _written(handed, tree)
    again, _ = _stage(state, PinnedPool(1 << 20, sys.maxsize))
    assert data == _written(again, tree)
    assert_same(ckptzip.load(data, map_location="cpu"), {k: v.cpu() if isinstance(v, torch.Tensor) else v
                                                          for k, v in state.items()})


def test_the_copies_a_staging_hands_over_are_not_left_mapped_in_this_process() -> None:
    state = {"big": torch.randn(16 << 20), "step": 3}  # 64 MiB, copied to shared memory for the other process
    staged, tree = _stage(state, PinnedPool())

    before = shared_rss()
    portable = staged.portable()
    assert shared_rss() - before < 8 << 20  # its pages are the other process's to map
    assert_same(ckptzip.load(_written(_received(portable), tree)), state)
