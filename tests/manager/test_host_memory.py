"""A manager never takes a snapshot the host's memory cannot hold (manager/_snapshot.py): where
one would take more than the host can give beside a margin (every training process of the host as
much), the checkpoint is written before ``save`` returns, in a synchronous save's bounded memory."""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import assert_same

from ckptzip.manager import CheckpointManager, _snapshot

GIB = 1 << 30
STATE_MIB = 64
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _state(device: str = "cpu") -> dict[str, torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(3)  # four tensors of 64 MiB
    return {f"w{i}": torch.randn((STATE_MIB << 20) // 4, generator=g, device=device) for i in range(4)}


def _host_has(monkeypatch: pytest.MonkeyPatch, available: int | None) -> None:
    monkeypatch.setattr(_snapshot, "host_available", lambda: available)


@pytest.fixture(autouse=True)
def _one_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    """No launcher's count of the host's ranks: one training process, unless a test sets one."""
    for name in ("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "SLURM_NTASKS_PER_NODE"):
        monkeypatch.delenv(name, raising=False)


def test_a_save_the_hosts_memory_cannot_snapshot_is_written_before_it_returns(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    _host_has(monkeypatch, 300 << 20)  # 0.25 GiB and a fifth of 0.29 GiB do not fit
    state = _state()
    expected = {k: v.clone() for k, v in state.items()}
    with caplog.at_level(logging.WARNING, logger="ckptzip"), CheckpointManager(tmp_path) as manager:
        for step in (1, 2):
            future = manager.save(step, state)
            assert future.done() and future.result() is None  # committed already
            assert manager.last_snapshot == "direct"
            assert manager.last_snapshot_reason == ("a snapshot of the state needs 0.25 GiB more host memory, but the "
                                                    "host has 0.29 GiB available, of which 0.06 GiB are left to the "
                                                    "training")
            assert manager.all_steps() == list(range(1, step + 1))
            for v in state.values():
                v.mul_(2.0)  # after save returned: not in the checkpoint
            assert_same(manager.restore(step), expected)
            expected = {k: v.clone() for k, v in state.items()}
        assert manager._snapshots._buffers.pooled_host() == 0  # nothing was copied
    warnings = [r.getMessage() for r in caplog.records if "without a snapshot" in r.getMessage()]
    assert warnings == ["ckptzip: writing checkpoints before save returns, without a snapshot: "
                        + str(manager.last_snapshot_reason)]  # once, not every save


def test_each_training_process_of_the_host_is_counted_as_taking_as_much(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _host_has(monkeypatch, 2 * GIB)  # 0.25 GiB and a fifth fit; 8 times 0.25 GiB do not
    state = _state()
    with CheckpointManager(tmp_path / "one") as manager:
        manager.save(1, state)
        assert manager.last_snapshot == "device"  # a CPU state's copy, taken
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    with CheckpointManager(tmp_path / "eight") as manager:
        manager.save(1, state)
        assert manager.last_snapshot == "direct"
        assert "needs 0.25 GiB more host memory (and each of the 8 training processes of this host as much)" in str(
            manager.last_snapshot_reason)
        assert_same(manager.restore(1), state)


def test_a_save_written_at_once_waits_for_the_saves_in_flight_and_keeps_step_order(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    state = _state()
    first = {k: v.clone() for k, v in state.items()}
    gate = threading.Event()
    with CheckpointManager(tmp_path, max_pending=2) as manager:
        write = manager._write

        def held(step: int, body: Any) -> None:  # the first write waits for the gate: still in flight
            gate.wait(30)
            write(step, body)

        monkeypatch.setattr(manager, "_write", held)
        _host_has(monkeypatch, 64 * GIB)
        pending = manager.save(1, state)
        assert manager.last_snapshot == "device"
        for v in state.values():
            v.add_(1.0)
        _host_has(monkeypatch, 256 << 20)  # its buffers are in use: the next snapshot would need 0.25 GiB more
        threading.Timer(0.3, gate.set).start()
        manager.save(2, state)
        assert pending.done() and manager.last_snapshot == "direct"
        assert manager.all_steps() == [1, 2]
        assert_same(manager.restore(1), first)
        assert_same(manager.restore(2), state)


def test_where_the_hosts_memory_cannot_be_read_snapshots_are_taken(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _host_has(monkeypatch, None)
    state = _state()
    with CheckpointManager(tmp_path) as manager:
        manager.save(1, state)
        assert manager.last_snapshot == "device"
        manager.wait()
        assert_same(manager.restore(1), state)


@pytest.mark.gpu
@cuda
def test_a_gpu_states_host_snapshot_the_host_cannot_hold_is_neither_reserved_nor_taken(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    _host_has(monkeypatch, 300 << 20)
    state = _state("cuda")
    expected = {k: v.cpu() for k, v in state.items()}
    with caplog.at_level(logging.WARNING, logger="ckptzip"), CheckpointManager(tmp_path, snapshot="host") as manager:
        assert manager._snapshots.reserve_host(list(state.values())) is None
        manager.save(1, state)
        for v in state.values():
            v.mul_(2.0)
        assert manager.last_snapshot == "direct"
        assert manager._snapshots._host_held() == 0  # no pinned staging, no copies
        assert_same({k: v.cpu() for k, v in manager.restore(1).items()}, expected)
    assert any(r.getMessage().startswith("ckptzip: prepare() reserves no host memory: a snapshot of the state needs")
               for r in caplog.records)
