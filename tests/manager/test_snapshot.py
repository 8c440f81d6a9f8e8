"""A manager's host snapshots (manager/_snapshot.py, staged by staging/host.py): the share of a state
that crosses the link raw while the GPU codes the rest, the file such a snapshot writes, and its
plan, made once."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import assert_same

import ckptzip
from ckptzip.manager import CheckpointManager
from ckptzip.engine import GpuLimits, Policy
from ckptzip.staging import HOST_RAW_SHARE
from ckptzip.staging.plan import HOST_SNAPSHOT_BATCH_BYTES
from ckptzip.series import STEP_NAME

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
MIB = 1 << 20


@pytest.mark.gpu
@cuda
def test_a_host_snapshot_codes_its_raw_share_on_the_host_and_restores_bit_exactly(tmp_path: Path) -> None:
    g = torch.Generator(device="cuda").manual_seed(7)
    state = {f"w{i}": torch.randn(1 << 22, device="cuda", generator=g) * 0.02 for i in range(10)}  # 16 MiB each
    expected = {k: v.cpu() for k, v in state.items()}
    with CheckpointManager(tmp_path, snapshot="host") as manager:
        manager.prepare(state)
        for step in (1, 2):  # the second reuses the raw copies' pinned buffer
            manager.save(step, state)
            for v in state.values():
                v.mul_(2.0)  # queued right behind the snapshot: it must not reach the copies
            manager.wait()
            restored = manager.restore(step)  # where it was saved from: the raw share too, though coded on the host
            assert {str(v.device) for v in restored.values()} == {"cuda:0"}
            assert_same({k: v.cpu() for k, v in restored.items()}, expected)
            expected = {k: v.cpu() for k, v in state.items()}
    with ckptzip.open(tmp_path / STEP_NAME.format(2)) as reader:
        codecs = {e.name: {s.codec["id"] for s in e.streams} for e in reader.entries()}
    raw = [f"w{i}" for i in range(10 - round(10 * HOST_RAW_SHARE), 10)]
    assert all("zstd" in codecs[name] for name in raw)  # coded on the host
    assert all("gdeflate" in codecs[name] for name in codecs if name not in raw)  # on the GPU


@pytest.mark.gpu
@cuda
def test_a_save_right_after_prepare_uses_the_reserved_buffer_not_a_second_one(tmp_path: Path) -> None:
    g = torch.Generator(device="cuda").manual_seed(8)
    state = {f"w{i}": torch.randn(1 << 22, device="cuda", generator=g) for i in range(10)}
    with CheckpointManager(tmp_path, snapshot="host") as manager:
        manager.prepare(state)
        manager.save(1, state)  # before the reservation can have finished
        manager.wait()
        pinned = manager._snapshots._buffers._free[(torch.device("cpu"), True)]
        raw = [f"w{i}" for i in range(10 - round(10 * HOST_RAW_SHARE), 10)]  # copied raw, to one buffer
        assert len(pinned) == 1
        assert pinned[0].numel() >= sum(state[name].nbytes for name in raw)
        assert_same(manager.restore(1, map_location="cpu"), {k: v.cpu() for k, v in state.items()})


@pytest.mark.gpu
@cuda
def test_a_host_snapshot_derives_its_gpu_limits_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    of = GpuLimits.of.__func__  # type: ignore[attr-defined]
    in_save: list[int | None] = []

    def counted(cls: type[GpuLimits], tensors: list[torch.Tensor], policy: Policy, gpu_memory: int | None,
                batch_cap: int | None = None) -> Any:
        if threading.current_thread() is threading.main_thread():  # not the kernels' warm-up, nor the worker
            in_save.append(batch_cap)
        return of(cls, tensors, policy, gpu_memory, batch_cap)

    monkeypatch.setattr(GpuLimits, "of", classmethod(counted))
    g = torch.Generator(device="cuda").manual_seed(9)
    state = {f"w{i}": torch.randn(1 << 20, device="cuda", generator=g) for i in range(4)}
    with CheckpointManager(tmp_path, snapshot="host", overlap=False) as manager:
        in_save.clear()
        manager.save(1, state)
        assert in_save == [HOST_SNAPSHOT_BATCH_BYTES]  # the plan's, handed to the staging
        manager.wait()
        assert_same(manager.restore(1, map_location="cpu"), {k: v.cpu() for k, v in state.items()})
