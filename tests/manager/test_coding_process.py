"""The manager's coding process (manager/_coding.py): a host snapshot's host tensors coded in a
child interpreter, fed through shared memory, its bytes back through a ring of shared buffers:
the same container, byte for byte, as the write in this process; a child that fails or dies
fails that checkpoint only, and the next write starts a new one."""

from __future__ import annotations

import io
import itertools
import logging
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import assert_same

import ckptzip
from ckptzip.memory import shared
from ckptzip.engine.policy import Policy
from ckptzip.engine.plan import GpuLimits
from ckptzip.engine.staged import stage_table, staged_table
from ckptzip.staging import HostStaged
from ckptzip.memory.pinned import PinnedPool
from ckptzip.memory.shared import shared_copy, shared_empty
from ckptzip.errors import CheckpointWriteError
from ckptzip.manager import _coding
from ckptzip.manager._coding import CodingProcess, _dumps, _loads
from ckptzip.tree import flatten

POLICY = Policy.parse("auto")


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(5)
    master = torch.randn(300, 257, generator=g)
    return {"master": master, "w": master.bfloat16(), "dup": master, "ints": torch.arange(1000),
            "empty": torch.empty(0, 3), "step": 11, "nested": {"m": torch.randn(4096, generator=g) * 1e-3}}


def _staged(state: dict[str, Any]) -> tuple[HostStaged, Any]:
    """A host snapshot's staging with every tensor left to host coding, in shared memory."""
    flat = flatten(state)
    tensors = [shared_copy(item.tensor) for item in flat.tensors]
    table = staged_table([item.name for item in flat.tensors], tensors, None)
    staged = HostStaged(stage_table(table, POLICY, GpuLimits.of(tensors, POLICY, None), PinnedPool(shared=True)), POLICY)
    return staged, flat.tree


def _in_place(state: dict[str, Any]) -> bytes:
    staged, tree = _staged(state)
    f = io.BytesIO()
    staged.write(f, tree)
    return f.getvalue()


@pytest.fixture
def small_ring(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two slots of 4 KiB: every write waits for slots to come back."""
    monkeypatch.setattr(_coding, "RING_SLOTS", 2)
    monkeypatch.setattr(_coding, "RING_SLOT_BYTES", 4096)


def test_the_child_writes_the_bytes_the_write_in_place_writes(small_ring: None) -> None:
    state = _state()
    process = CodingProcess()
    try:
        for _ in range(2):  # the same child, twice
            staged, tree = _staged(state)
            assert staged.state.rest and staged.state.shared
            f = io.BytesIO()
            entries = process.write(f, staged, tree)
            assert f.getvalue() == _in_place(state)
            assert [e.name for e in entries] == [e.name for e in ckptzip.open(io.BytesIO(f.getvalue())).entries()]
            assert_same(ckptzip.load(f.getvalue()), state)
    finally:
        process.close()


def test_the_childs_bytes_are_handed_to_the_disk_as_they_arrive(small_ring: None, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """As in-process writes do (storage/writeback.py): else a host with much memory keeps the
    whole checkpoint dirty until its fsync, which then writes it after the coding has ended."""
    from ckptzip.storage import writeback

    monkeypatch.setattr(writeback, "WRITEBACK_BYTES", 8192)
    advised: list[tuple[int, int]] = []
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, offset, length, how: advised.append((offset, length)),
                        raising=False)
    staged, tree = _staged(_state())
    process = CodingProcess()
    try:
        with open(tmp_path / "f", "wb") as f:
            process.write(f, staged, tree)
    finally:
        process.close()
    size = (tmp_path / "f").stat().st_size
    assert advised[0][0] == 0 and all(a + n == b for (a, n), (b, _) in itertools.pairwise(advised))
    assert size - 8192 < advised[-1][0] + advised[-1][1] <= size
    assert (tmp_path / "f").read_bytes() == _in_place(_state())


def test_tensors_in_shared_memory_cross_as_their_storages_once() -> None:
    base = shared_empty(1 << 12)
    views = {"a": base[:64].view(torch.float32), "b": base[64:192].view(torch.int16).view(8, 8),
             "t": base[256:512].view(torch.float32).view(8, 8).t(), "private": torch.arange(3)}
    storages, payload = _dumps(views)
    assert len(storages) == 1
    got = _loads(storages, payload)
    for key, value in views.items():
        assert got[key].dtype == value.dtype and got[key].stride() == value.stride()
        assert torch.equal(got[key].view(torch.uint8) if got[key].is_contiguous() else got[key],
                           value.view(torch.uint8) if value.is_contiguous() else value)
    got["a"][0] = 7.0  # the same memory, not a copy
    assert views["a"][0] == 7.0


def test_an_error_in_the_child_leaves_the_file_as_it_was_for_this_process_to_write() -> None:
    state = _state()
    process = CodingProcess()
    try:
        staged, _ = _staged(state)
        f = io.BytesIO(b"head")
        f.seek(4)
        assert process.write(f, staged, {"not json": object()}) is None  # its index cannot be written
        assert f.getvalue() == b"head" and process.failures == 1 and process.usable
        staged, tree = _staged(state)
        f = io.BytesIO()
        assert process.write(f, staged, tree) is not None
        assert f.getvalue() == _in_place(state) and process.failures == 0
    finally:
        process.close()


class _KillsTheChild(io.BytesIO):
    def __init__(self, process: CodingProcess, seekable: bool) -> None:
        super().__init__()
        self.process = process
        self._seekable = seekable

    def seekable(self) -> bool:
        return self._seekable

    def write(self, data: Any) -> int:
        child = self.process._child
        if child is not None:
            child.kill()
            child.wait()
        return super().write(data)


def test_a_child_that_dies_mid_write_leaves_a_rewound_file_to_this_process(small_ring: None) -> None:
    state = _state()
    process = CodingProcess()
    try:
        staged, tree = _staged(state)
        f = _KillsTheChild(process, seekable=True)
        assert process.write(f, staged, tree) is None
        assert f.getvalue() == b""
        staged, tree = _staged(state)
        f = io.BytesIO()
        assert process.write(f, staged, tree) is not None  # a new child
        assert f.getvalue() == _in_place(state)
    finally:
        process.close()


def test_a_child_that_dies_mid_write_to_a_stream_fails_that_checkpoint(small_ring: None) -> None:
    process = CodingProcess()
    try:
        staged, tree = _staged(_state())
        with pytest.raises(CheckpointWriteError, match=r"coding process failed while writing this checkpoint \(it "
                                                       r"exited with status -9\); it was not written, the previous "
                                                       r"ones are intact"):
            process.write(_KillsTheChild(process, seekable=False), staged, tree)
    finally:
        process.close()


def test_a_child_that_cannot_start_leaves_the_writes_to_this_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_coding.sys, "executable", "/nonexistent/python")
    process = CodingProcess()
    process.start()  # says why, raises nothing
    staged, tree = _staged(_state())
    for failures in range(1, _coding.MAX_FAILURES + 1):
        f = io.BytesIO()
        assert process.write(f, staged, tree) is None and f.getvalue() == b""
        assert process.failures == failures
    assert not process.usable


def test_ranks_of_one_host_share_the_cores_between_their_children(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CKPTZIP_THREADS", raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setattr(_coding, "cpu_threads", lambda: 64)
    env = _coding._child_environment()
    assert env["CKPTZIP_THREADS"] == "16" and env["CUDA_VISIBLE_DEVICES"] == ""
    monkeypatch.setenv("CKPTZIP_THREADS", "3")
    assert _coding._child_environment()["CKPTZIP_THREADS"] == "3"
    monkeypatch.delenv("CKPTZIP_THREADS")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert "CKPTZIP_THREADS" not in _coding._child_environment()


def test_the_ranks_of_a_host_are_counted_as_their_launcher_counts_them(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "SLURM_NTASKS_PER_NODE"):
        monkeypatch.delenv(name, raising=False)
    assert _coding.local_ranks() == 1
    for name, value, counted in (("SLURM_NTASKS_PER_NODE", "8", 8), ("MPI_LOCALNRANKS", "4", 4),
                                 ("OMPI_COMM_WORLD_LOCAL_SIZE", "2", 2), ("LOCAL_WORLD_SIZE", "1", 1)):
        monkeypatch.setenv(name, value)
        assert _coding.local_ranks() == counted  # each launcher's count before those after it
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "x")  # not a count: the next launcher's
    assert _coding.local_ranks() == 2


def test_a_child_gone_between_writes_is_replaced() -> None:
    state = _state()
    process = CodingProcess()
    try:
        process.start()
        assert process._child is not None
        process._child.kill()
        process._child.wait()
        staged, tree = _staged(state)
        f = io.BytesIO()
        process.write(f, staged, tree)
        assert f.getvalue() == _in_place(state)
    finally:
        process.close()
    assert process._child is None


def test_the_child_runs_at_a_lower_priority_and_sees_no_gpu() -> None:
    process = CodingProcess()
    try:
        process.start()
        assert process._child is not None
        pid = process._child.pid
        expected = min(19, os.getpriority(os.PRIO_PROCESS, 0) + _coding.NICENESS)
        deadline = time.monotonic() + 30
        while os.getpriority(os.PRIO_PROCESS, pid) != expected and time.monotonic() < deadline:
            time.sleep(0.05)  # it lowers its own priority as it starts
        assert os.getpriority(os.PRIO_PROCESS, pid) == expected
        with open(f"/proc/{pid}/environ", "rb") as f:
            assert b"\0CUDA_VISIBLE_DEVICES=\0" in b"\0" + f.read()
    finally:
        process.close()


def test_shared_memory_without_room_is_refused_not_touched(monkeypatch: pytest.MonkeyPatch) -> None:
    # touching shared memory beyond a small /dev/shm kills the process with SIGBUS: refuse first
    monkeypatch.setattr(shared, "shared_room", lambda: 1 << 30)
    with pytest.raises(CheckpointWriteError, match=r"shared memory \(/dev/shm\) has 1\.00 GiB free; 0\.88 GiB and a "
                                                   r"margin of 0\.25 GiB were needed"):
        shared_empty(900 << 20)
    assert shared_empty(1 << 20).is_shared()


def test_shared_memory_is_taken_all_or_none_when_made(monkeypatch: pytest.MonkeyPatch) -> None:
    # ranks of one host allocating at once could each pass the room check: the pages are reserved
    # at once, so an overdraft is an error here, never a SIGBUS at the first touch
    def no_room(fd: int, offset: int, length: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(shared.os, "posix_fallocate", no_room)
    with pytest.raises(CheckpointWriteError, match=r"shared memory \(/dev/shm\) could not take 0\.00 GiB: No space "
                                                   r"left on device"):
        shared_empty(1 << 20)


def test_closing_a_manager_while_prepare_reserves_leaves_no_coding_process_behind(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ckptzip.staging import HostSnapshots

    reserve = HostSnapshots.reserve

    def slow(self: HostSnapshots, staging: int, pinned: int) -> None:
        time.sleep(0.5)  # the reservation is still running when close() is called
        reserve(self, staging, pinned)

    monkeypatch.setattr(HostSnapshots, "reserve", slow)
    manager = ckptzip.CheckpointManager(tmp_path, snapshot="host")
    manager.prepare({"w": torch.ones(1 << 10)})
    coder = manager._snapshots._coder
    assert coder is not None
    manager.close()
    assert coder._child is None and manager._snapshots._reserving is None


def test_a_reservation_that_fails_is_a_warning_and_the_coding_process_still_starts(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    from ckptzip.staging import HostSnapshots

    def refused(self: HostSnapshots, staging: int, pinned: int) -> None:
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(HostSnapshots, "reserve", refused)
    with caplog.at_level(logging.WARNING, logger="ckptzip"), \
            ckptzip.CheckpointManager(tmp_path, snapshot="host") as manager:
        thread = manager._snapshots.reserve_host([torch.ones(1 << 10)])
        assert thread is not None
        thread.join()
        coder = manager._snapshots._coder
        assert coder is not None and coder._child is not None
    assert "ckptzip: prepare() could not reserve 0.00 GiB of pinned host memory; the first host snapshot will: " \
           "[Errno 12] Cannot allocate memory" in caplog.text


def test_a_child_whose_parent_is_gone_before_its_reply_exits_quietly(monkeypatch: pytest.MonkeyPatch) -> None:
    import multiprocessing
    import socket

    monkeypatch.setattr(_coding.os, "nice", lambda increment: 0)
    monkeypatch.setattr("sys.stdin", io.StringIO(bytes(multiprocessing.current_process().authkey).hex() + "\n"))
    ours, theirs = socket.socketpair()
    parent = multiprocessing.connection.Connection(ours.detach())
    parent.send(("ring", b"a ring", 16))
    parent.send(("write", b"not a staged state", b""))  # fails in the child, which then replies
    parent.close()  # gone before the reply
    _coding._child(theirs.detach())  # returns, rather than raising BrokenPipeError
