"""The manager inside a training loop: it never takes the memory training needs, and a save that
reads the state while training goes on restores the state as it was when ``save`` was called.

The GPU tests train a small model with a large batch, so that torch caches the activations between
steps (the working set a training job has, which a static tensor filling the GPU does not)."""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from helpers import assert_same

import ckptzip
from ckptzip.engine import guard
from ckptzip.memory import gpu as gpu_memory
from ckptzip.errors import SnapshotAbandonedError
from ckptzip.manager import CheckpointManager
from ckptzip.tier import MemoryTier
from ckptzip.staging.reading import Reading

GIB = 1 << 30
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


class Loop:
    """An MLP whose activations dwarf its state (``width`` wide, ``rows`` a batch), fused AdamW."""

    def __init__(self, width: int = 2048, depth: int = 8, rows: int = 1 << 15, norm: bool = False) -> None:
        torch.manual_seed(0)
        layers: list[torch.nn.Module] = []
        for _ in range(depth):
            layers += [torch.nn.Linear(width, width), torch.nn.GELU()]
            if norm:
                layers.append(torch.nn.BatchNorm1d(width))
        self.model = torch.nn.Sequential(*layers).cuda()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3, fused=True)
        self.rows, self.width = rows, width
        self.generator = torch.Generator(device="cuda").manual_seed(1)

    def step(self) -> None:
        x = torch.randn(self.rows, self.width, device="cuda", generator=self.generator)
        self.model(x).float().square().mean().backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def state(self) -> dict[str, object]:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}


def _host(state: object) -> object:
    """A host copy of ``state``'s tensors, as they are now."""
    if isinstance(state, torch.Tensor):
        return state.detach().cpu().clone()
    if isinstance(state, dict):
        out = type(state)((k, _host(v)) for k, v in state.items())
        if hasattr(state, "_metadata"):  # a module's state_dict keeps its version metadata
            out._metadata = state._metadata  # type: ignore[attr-defined]
        return out
    if isinstance(state, list):
        return [_host(v) for v in state]
    return state


def _saves_while_training(manager: CheckpointManager, steps: int) -> dict[int, object]:
    """Train and save steps 1 to ``steps``, each save's read overlapping the next training step
    (whose optimizer step waits for it); the state each save was given, copied to the host."""
    loop = Loop(rows=1 << 13)
    saved = {}
    for step in range(1, steps + 1):
        loop.step()
        saved[step] = _host(loop.state())
        manager.save(step, loop.state())
        assert manager.last_snapshot_overlapped, manager.last_snapshot_reason
        loop.step()
    return saved


@pytest.fixture
def fresh_gpu() -> Iterator[None]:
    if torch.cuda.is_available():
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    yield
    if torch.cuda.is_available():
        torch.cuda.set_per_process_memory_fraction(1.0)
        gc.collect()
        torch.cuda.empty_cache()


@gpu
@needs_cuda
def test_auto_never_takes_the_training_cache_for_a_device_copy(tmp_path: Path, fresh_gpu: None) -> None:
    # The GPU made as small as the training's peak and a little more: between two steps, the free
    # memory and torch's cache (the activations) have room for a copy of the state; at the peak,
    # beside the activations, they do not.
    with CheckpointManager(tmp_path) as manager:
        loop = Loop()
        loop.step()
        loop.step()  # the moments exist: this step's peak is every step's
        torch.cuda.synchronize()
        total = torch.cuda.get_device_properties(0).total_memory
        state_bytes = sum(p.nbytes for p in loop.model.parameters()) * 3
        torch.cuda.set_per_process_memory_fraction((torch.cuda.max_memory_reserved() + state_bytes // 2) / total)
        loop.step()
        assert gpu_memory.available(torch.device("cuda", 0)) > state_bytes + 2 * GIB  # the old rule's room
        # what that rule did: a copy of the state out of the cache, and the next step runs out of memory
        taken = torch.empty(state_bytes, dtype=torch.uint8, device="cuda")
        with pytest.raises(torch.OutOfMemoryError):
            loop.step()
        del taken
        gc.collect()
        loop.optimizer.zero_grad(set_to_none=True)
        loop.step()
        for step in (1, 2, 3):
            expected = _host(loop.state())
            manager.save(step, loop.state())
            assert manager.last_snapshot == "host", manager.last_snapshot_reason
            assert "the training leaves" in (manager.last_snapshot_reason or "")
            loop.step()  # no out-of-memory error: the save took only what the peak leaves
            loop.step()
            manager.wait()
            assert_same(manager.restore(step, map_location="cpu"), expected)


@gpu
@needs_cuda
@pytest.mark.parametrize(("snapshot", "host_coding"), [("auto", "process"), ("host", "process"), ("host", "thread")])
def test_a_save_read_while_training_goes_on_restores_the_state_as_it_was_saved(
        tmp_path: Path, fresh_gpu: None, snapshot: str, host_coding: str) -> None:
    with CheckpointManager(tmp_path, snapshot=snapshot, host_coding=host_coding) as manager:  # type: ignore[arg-type]
        loop = Loop(rows=1 << 13)
        for step in range(1, 4):
            loop.step()
            expected = _host(loop.state())
            manager.save(step, loop.state())
            if snapshot == "host":
                assert manager.last_snapshot_overlapped, manager.last_snapshot_reason
            loop.step()  # its optimizer step waits for the read
            loop.step()
            manager.wait()
            assert_same(manager.restore(step, map_location="cpu"), expected)
            coder = manager._snapshots._coder
            # a host snapshot read while training goes on copies every tensor raw: a child codes them
            assert (coder is not None and coder._child is not None) == (host_coding == "process" and
                                                                         manager.last_snapshot == "host")


@gpu
@needs_cuda
@pytest.mark.parametrize("host_coding", ["process", "thread"])
def test_saves_to_the_memory_tier_inside_a_loop_restore_from_memory_as_saved(
        tmp_path: Path, fresh_gpu: None, host_coding: str) -> None:
    tier = MemoryTier(keep=2, persist_every=2, path=tmp_path / "shm")
    with CheckpointManager(tmp_path / "run", snapshot="host", memory_tier=tier,
                           host_coding=host_coding) as manager:  # type: ignore[arg-type]
        saved = _saves_while_training(manager, 3)
        manager.wait(persisted=True)
    reader = CheckpointManager(tmp_path / "run", memory_tier=MemoryTier(path=tmp_path / "shm"))
    assert_same(reader.restore(3, map_location="cpu"), saved[3])
    assert reader.restored_from == "memory"
    assert_same(reader.restore(2, map_location="cpu"), saved[2])


@gpu
@needs_cuda
def test_incremental_saves_inside_a_loop_restore_every_step_as_saved(tmp_path: Path, fresh_gpu: None) -> None:
    # deltas are rewritten against the last save's host copy while the read overlaps training
    with CheckpointManager(tmp_path, snapshot="host", incremental=3, keep_last=None) as manager:
        saved = _saves_while_training(manager, 4)
        manager.wait()
        for step, expected in saved.items():
            assert_same(manager.restore(step, map_location="cpu"), expected)


@gpu
@needs_cuda
def test_tensors_no_optimizer_owns_are_copied_before_save_returns(tmp_path: Path, fresh_gpu: None) -> None:
    # BatchNorm's running statistics change in every forward, which the optimizer's hook does not see
    with CheckpointManager(tmp_path, snapshot="host") as manager:
        loop = Loop(rows=1 << 12, depth=4, norm=True)
        loop.step()
        expected = _host(loop.state())
        manager.save(1, loop.state())
        assert manager.last_snapshot_overlapped
        with torch.no_grad():
            loop.model(torch.randn(loop.rows, loop.width, device="cuda"))  # updates the running statistics
        loop.step()
        manager.wait()
        assert_same(manager.restore(1, map_location="cpu"), expected)


@gpu
@needs_cuda
def test_a_writer_inside_guard_waits_for_the_read(tmp_path: Path, fresh_gpu: None) -> None:
    with CheckpointManager(tmp_path, snapshot="host") as manager:
        loop = Loop(rows=1 << 12)
        loop.step()
        expected = _host(loop.state())
        manager.save(1, loop.state())
        with manager.guard(), torch.no_grad():
            for p in loop.model.parameters():
                p.data.mul_(2)  # a writer the version counters and the hook do not see
        manager.wait()
        assert_same(manager.restore(1, map_location="cpu"), expected)


@gpu
@needs_cuda
def test_dcp_async_save_inside_a_training_loop_restores_bit_exactly(tmp_path: Path, fresh_gpu: None) -> None:
    import torch.distributed.checkpoint as dcp

    from ckptzip.dcp import CompressedStorageReader, CompressedStorageWriter

    loop = Loop(rows=1 << 13)
    loop.step()
    state = {k: v for k, v in loop.model.state_dict().items()}
    expected = _host(state)
    future = dcp.async_save(state, storage_writer=CompressedStorageWriter(tmp_path / "ckpt"))
    loop.step()
    loop.step()
    future.result()
    restored = {k: torch.empty_like(v) for k, v in state.items()}
    dcp.load(restored, storage_reader=CompressedStorageReader(tmp_path / "ckpt"))
    assert_same(_host(restored), expected)


# ------------------------------------------------------------------------------ on the CPU


def test_an_optimizer_step_waits_for_a_read_in_flight() -> None:
    guard.watch()
    p = torch.nn.Parameter(torch.zeros(4))
    p.grad = torch.ones(4)
    optimizer = torch.optim.SGD([p], lr=1.0)
    release = threading.Event()
    seen: list[float] = []

    def read() -> int:
        release.wait(5)
        seen.append(float(p.detach()[0]))  # the optimizer has not stepped yet
        return 7

    reading = Reading(read, {}, {})
    stepper = threading.Thread(target=optimizer.step)
    stepper.start()
    time.sleep(0.2)
    assert float(p.detach()[0]) == 0.0  # the step waits
    release.set()
    stepper.join(5)
    assert reading.result() == 7
    assert seen == [0.0]
    assert float(p.detach()[0]) == -1.0
    assert guard.stepped()


def test_a_read_that_outlasts_the_wait_is_abandoned_and_its_checkpoint_refused(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(guard, "WAIT_SECONDS", 0.1)
    release = threading.Event()
    reading = Reading(lambda: release.wait(5), {}, {})
    guard.wait_for_reads()  # a writer stops waiting after WAIT_SECONDS
    release.set()
    with pytest.raises(SnapshotAbandonedError, match="did not end within 0 s"):
        reading.result()


def test_a_failed_read_raises_its_error_and_lets_writers_go_on() -> None:
    def read() -> None:
        raise OSError("disk on fire")

    reading = Reading(read, {}, {})
    guard.wait_for_reads()
    with pytest.raises(OSError, match="disk on fire"):
        reading.result()


def test_what_optimizers_own_is_their_parameters_and_state_not_buffers_or_gradients() -> None:
    guard.watch()
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    owned = guard.owned_storages()
    sd = model.state_dict()
    assert guard.owned(sd["0.weight"], owned) and guard.owned(sd["1.bias"], owned)
    assert all(guard.owned(t, owned) for st in optimizer.state.values() for t in st.values())
    assert not guard.owned(sd["1.running_mean"], owned)
    assert not guard.owned(model[0].weight.grad, owned)  # type: ignore[arg-type]


def test_work_beside_training_gets_what_the_training_leaves_at_its_peak(monkeypatch: pytest.MonkeyPatch) -> None:
    # the loop: 80 GB, training peaks at 63.6 GB reserved; between steps 40 GB of it is cache
    stats = {"free": 16.4e9, "reserved": 63.6e9, "peak": 63.6e9, "allocated": 23.6e9, "fraction": 1.0}

    class Props:
        total_memory = int(80e9)

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (int(stats["free"]), int(80e9)))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: int(stats["reserved"]))
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: int(stats["peak"]))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: int(stats["allocated"]))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: Props())
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device=None: stats["fraction"])
    device = torch.device("cuda", 0)
    assert gpu_memory.available(device) == int(16.4e9) + int(40e9)  # what a call done before the next step borrows
    assert gpu_memory.beside_training(device) == int(16.4e9) - int(0.02 * 80e9)  # the margin: 2 % of the GPU
    stats["reserved"] = 30e9  # the caller emptied torch's cache: the peak still counts
    stats["free"] = 50e9
    assert gpu_memory.beside_training(device) == int(50e9) + int(30e9) - int(63.6e9) - int(1.6e9)
    stats["fraction"] = 0.5  # torch reserves at most 40 GB: less than the peak
    assert gpu_memory.beside_training(device) == 0
    with gpu_memory.capped({device: 123}):
        assert gpu_memory.budget(device, None, "save").nbytes == 123  # never raises: the engine codes on the host
    stats["reserved"] = stats["allocated"] = 40e9
    with pytest.raises(ckptzip.GpuMemoryError):
        gpu_memory.budget(device, None, "save")


def test_overlap_must_be_a_bool(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="overlap must be True or False, got 'yes'"):
        CheckpointManager(tmp_path, overlap="yes")  # type: ignore[arg-type]
