"""Host snapshots (manager/_snapshot.py): the share of a state that crosses the link raw while the
GPU codes the rest, and the file such a snapshot writes."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from helpers import assert_same

import ckptzip
from ckptzip.engine.policy import Policy
from ckptzip.manager import CheckpointManager, _snapshot
from ckptzip.manager._snapshot import HOST_RAW_SHARE, raw_share
from ckptzip.series import STEP_NAME

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
MIB = 1 << 20


def test_the_raw_share_is_the_tail_of_the_table_up_to_its_bytes() -> None:
    nbytes = [100] * 10
    assert raw_share(nbytes, list(range(10)), 0.4) == {6, 7, 8, 9}
    assert raw_share(nbytes, [0, 2, 4, 6, 8], 0.4) == {6, 8}  # only candidates, by their bytes
    assert raw_share(nbytes, list(range(10)), 0.0) == set()
    assert raw_share([], [], 0.4) == set()


def test_a_tensor_that_would_overshoot_the_share_is_passed_over_for_smaller_ones() -> None:
    nbytes = [100, 100, 100, 100, 600]  # 40 % of 1000 is 400: the last tensor alone is 600
    assert raw_share(nbytes, list(range(5)), 0.4) == {0, 1, 2, 3}
    assert raw_share([1000], [0], 0.4) == set()  # a lone tensor is coded on its GPU


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
        pinned = manager._snapshots._free[(torch.device("cpu"), True)]
        raw = [f"w{i}" for i in range(10 - round(10 * HOST_RAW_SHARE), 10)]  # copied raw, to one buffer
        assert len(pinned) == 1
        assert pinned[0].numel() >= sum(state[name].nbytes for name in raw)
        assert_same(manager.restore(1, map_location="cpu"), {k: v.cpu() for k, v in state.items()})


def test_where_host_memory_cannot_be_registered_snapshot_buffers_are_pageable(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    def refused(nbytes: int, shared: bool = False) -> _snapshot.Slab:
        raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed with CUDA error 801")

    monkeypatch.setattr(_snapshot, "Slab", refused)
    pool = _snapshot.SnapshotPool("host", Policy.parse("auto"))
    with caplog.at_level(logging.WARNING, logger="ckptzip"):
        buffer = pool._acquire((torch.device("cpu"), True), 1 << 20)
    assert buffer.numel() == 1 << 20 and buffer.device.type == "cpu"
    assert "snapshot buffers in pageable host memory (copies to them are slower): cudaHostRegister of 1048576 bytes" \
        in caplog.text
