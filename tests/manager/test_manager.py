"""CheckpointManager on a local directory (and an in-memory fsspec store): saving, committing,
retention, error reporting, back-pressure, damaged checkpoints, RNG state."""

from __future__ import annotations

import collections
import concurrent.futures
import importlib
import os
import random
import sys
import threading
import uuid
from pathlib import Path
from typing import Any

import fsspec
import numpy as np
import pytest
import torch
from fsspec.implementations.memory import MemoryFileSystem
from helpers import assert_same

from ckptzip.errors import (
    CheckpointNotFoundError,
    CheckpointWriteError,
    CkptzipError,
    CorruptCheckpointError,
    UnsupportedObjectError,
)
from ckptzip.engine import guard
from ckptzip.storage import LOCK_NAME
from ckptzip.manager import (
    CheckpointManager,
    CheckpointSkippedWarning,
    IgnoredFileWarning,
    _snapshot,
    capture_rng_state,
    restore_rng_state,
)
from ckptzip.errors import StorageUnavailableError

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def make_state(step: int, numel: int = 1000) -> dict[str, Any]:
    """A small training-like state that differs bit by bit between steps."""
    g = torch.Generator().manual_seed(step)
    weight = torch.randn(numel, generator=g)
    return {
        "step": step,
        "model": collections.OrderedDict(
            w=weight,
            w_t=torch.randn(8, 4, generator=g).t(),  # non-contiguous
            half=weight[:64].to(torch.bfloat16),
            mask=weight[:10] > 0,
            empty=torch.zeros(0, 3),
            scalar=torch.tensor(step, dtype=torch.float64),
        ),
        "optimizer": {"state": {0: {"exp_avg": weight * 0.5, "step": torch.tensor(float(step))}},
                      "param_groups": [{"lr": 1e-3 * (step + 1), "betas": (0.9, 0.95), "params": [0]}]},
        "extra": [None, b"\x00\xff", "text", 2.5, np.arange(3, dtype=np.int16)],
    }


def files(directory: Path) -> list[str]:
    """The directory's files, less the lock file a writing manager holds (tests/test_manager_lock.py)."""
    return sorted(n for n in os.listdir(directory) if n != LOCK_NAME)


# ----------------------------------------------------------------------- an fsspec store with a gate


class GatedMemoryFS(MemoryFileSystem):
    """In-memory object store whose commit markers wait for ``gate``: saves stay in flight until it opens."""

    protocol = "gatedmem"
    gate = threading.Event()

    def pipe_file(self, path: str, value: bytes, *args: Any, **kwargs: Any) -> None:
        if str(path).endswith(".commit"):
            assert self.gate.wait(timeout=30), "test left the gate closed"
        super().pipe_file(path, value, *args, **kwargs)


@pytest.fixture
def gated_url() -> Any:
    fsspec.register_implementation("gatedmem", GatedMemoryFS, clobber=True)
    GatedMemoryFS.gate.set()
    url = f"gatedmem://runs/{uuid.uuid4().hex}"
    yield url
    GatedMemoryFS.gate.set()
    for key in [k for k in GatedMemoryFS.store if k.startswith(url)]:
        del GatedMemoryFS.store[key]


# ------------------------------------------------------------------------------------ basics


@pytest.mark.parametrize("async_save", [True, False])
def test_restore_returns_saved_state_bit_exactly(tmp_path: Path, async_save: bool) -> None:
    with CheckpointManager(tmp_path, async_save=async_save) as manager:
        future = manager.save(3, make_state(3))
        if not async_save:
            assert future.done()
        manager.wait()
        assert future.result() is None
        assert_same(manager.restore(), make_state(3))
        assert_same(manager.restore(3), make_state(3))
    assert files(tmp_path) == ["step_00000003.ckz"]


def test_all_steps_latest_step_and_retention(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, keep_last=2)
    assert manager.all_steps() == [] and manager.latest_step() is None
    for step in (0, 5, 10, 15):
        manager.save(step, make_state(step))
    manager.wait()
    assert manager.all_steps() == [10, 15] and manager.latest_step() == 15
    assert files(tmp_path) == ["step_00000010.ckz", "step_00000015.ckz"]
    assert_same(manager.restore(10), make_state(10))
    manager.close()


def test_keep_last_none_keeps_everything(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path, keep_last=None) as manager:
        for step in range(5):
            manager.save(step, {"step": step})
    assert CheckpointManager(tmp_path).all_steps() == [0, 1, 2, 3, 4]


def test_steps_beyond_eight_digits_sort_numerically(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path, keep_last=2) as manager:
        for step in (99_999_999, 100_000_000, 100_000_001):
            manager.save(step, {"step": step})
    assert manager.all_steps() == [100_000_000, 100_000_001]
    assert manager.restore() == {"step": 100_000_001}


def test_retention_deletes_only_after_a_newer_commit(gated_url: str) -> None:
    with CheckpointManager(gated_url, keep_last=1) as manager:
        manager.save(1, {"step": 1}).result()
        GatedMemoryFS.gate.clear()
        future = manager.save(2, {"step": 2})
        assert not future.done()
        assert manager.all_steps() == [1]  # step 2 is written but not committed: step 1 stays
        assert manager.restore() == {"step": 1}
        GatedMemoryFS.gate.set()
        future.result(timeout=30)
        assert manager.all_steps() == [2]


def test_context_manager_waits_and_closes(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path) as manager:
        future = manager.save(7, make_state(7))
    assert future.done() and manager.all_steps() == [7]
    with pytest.raises(ValueError, match="is closed; create a new CheckpointManager"):
        manager.save(8, make_state(8))
    manager.close()  # closing twice is harmless


def test_snapshot_isolates_the_callers_later_changes(gated_url: str) -> None:
    state = make_state(1)
    expected = make_state(1)
    GatedMemoryFS.gate.clear()
    with CheckpointManager(gated_url) as manager:
        manager.save(1, state)
        state["model"]["w"].add_(1.0)  # an optimizer step
        state["optimizer"]["param_groups"][0]["lr"] = 99.0
        state["extra"][4][0] = 42
        state["step"] = 2
        GatedMemoryFS.gate.set()
    assert_same(CheckpointManager(gated_url).restore(), expected)


def test_should_save(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path) as manager:
        assert [s for s in range(10) if manager.should_save(s, every=4)] == [0, 4, 8]
        manager.save(4, {})
        assert not manager.should_save(4, every=4)  # pending counts as saved
        manager.wait()
        assert not manager.should_save(0, every=4) and manager.should_save(8, every=4)
        with pytest.raises(ValueError, match="every must be >= 1, got 0"):
            manager.should_save(8, every=0)
    assert not CheckpointManager(tmp_path).should_save(4, every=2)  # committed by an earlier run


def test_steps_must_increase(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path) as manager:
        manager.save(5, {})
        with pytest.raises(ValueError, match=r"cannot save step 5 .*step 5 is already saved or being saved"):
            manager.save(5, {})
        with pytest.raises(ValueError, match="step must be >= 0, got -1"):
            manager.save(-1, {})
    with pytest.raises(ValueError, match=r"cannot save step 3 .*step 5 is already saved"):
        CheckpointManager(tmp_path).save(3, {})


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"keep_last": 0}, "keep_last must be None .keep all. or >= 1, got 0"),
        ({"max_pending": 0}, "max_pending must be >= 1, got 0"),
        ({"snapshot": "gpu"}, "snapshot must be 'auto', 'device' or 'host', got 'gpu'"),
        ({"storage_options": {"key": "x"}}, "storage_options=.* were given for local path"),
    ],
)
def test_invalid_arguments(tmp_path: Path, kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        CheckpointManager(tmp_path, **kwargs)


def test_unknown_codec_is_rejected_up_front(tmp_path: Path) -> None:
    with pytest.raises(CkptzipError, match="codec='nope' is neither a preset"):
        CheckpointManager(tmp_path, codec="nope")


# ------------------------------------------------------------------------------------ errors


def test_unsupported_object_is_rejected_by_save_itself(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path) as manager:
        with pytest.raises(UnsupportedObjectError, match="at 'hook'"):
            manager.save(1, {"w": torch.ones(2), "hook": threading.Lock()})
        manager.save(1, {"w": torch.ones(2)})  # nothing was queued; step 1 is still free
    assert manager.all_steps() == [1]


@pytest.mark.parametrize("surfaces_from", ["save", "wait", "close"])
def test_background_failure_surfaces_from_next_call(tmp_path: Path, surfaces_from: str) -> None:
    (tmp_path / "step_00000002.ckz").mkdir()  # the commit's rename onto this name fails
    manager = CheckpointManager(tmp_path)
    manager.save(1, make_state(1))
    failed = manager.save(2, make_state(2))
    message = r"could not write checkpoint '.*step_00000002\.ckz': Is a directory"
    with pytest.raises(CheckpointWriteError, match=message):
        if surfaces_from == "save":
            manager.save(3, make_state(3))
        elif surfaces_from == "wait":
            manager.wait()
        else:
            manager.close()
    assert isinstance(failed.exception(), CheckpointWriteError)
    manager.wait()  # reported once, not again
    manager.close()
    assert manager.all_steps() == [1]
    assert not any(name.startswith(".") for name in files(tmp_path))  # the temporary file was removed


def test_every_failure_is_reported_once(gated_url: str) -> None:
    calls = []

    def failing_pipe_file(self: GatedMemoryFS, path: str, value: bytes, *args: Any, **kwargs: Any) -> None:
        calls.append(path)
        assert self.gate.wait(timeout=30)
        raise OSError(5, "injected I/O error")

    manager = CheckpointManager(gated_url, max_pending=2)
    GatedMemoryFS.gate.clear()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(GatedMemoryFS, "pipe_file", failing_pipe_file)
        manager.save(1, {"step": 1})
        manager.save(2, {"step": 2})  # both in flight: neither failure has been seen yet
        GatedMemoryFS.gate.set()
        for step in (1, 2):
            with pytest.raises(CheckpointWriteError, match=rf"step_0000000{step}\.ckz: .*injected I/O error"):
                manager.close()
    manager.close()
    assert len(calls) == 2 and manager.all_steps() == []


def test_back_pressure_bounds_saves_in_flight(gated_url: str) -> None:
    manager = CheckpointManager(gated_url, max_pending=2)
    GatedMemoryFS.gate.clear()
    first, second = manager.save(1, {"step": 1}), manager.save(2, {"step": 2})
    third = concurrent.futures.ThreadPoolExecutor(1).submit(manager.save, 3, {"step": 3})
    with pytest.raises(concurrent.futures.TimeoutError):
        third.result(timeout=0.5)  # two saves in flight: the third waits
    assert not first.done() and not second.done()
    GatedMemoryFS.gate.set()
    third.result(timeout=30).result(timeout=30)
    manager.close()
    assert manager.all_steps() == [1, 2, 3]


# --------------------------------------------------------------------------- damaged checkpoints


def damage(path: Path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "flip":
        data[len(data) // 2] ^= 0x01
    else:
        del data[len(data) // 2 :]
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["flip", "truncate"])
def test_restore_skips_a_damaged_newest_checkpoint_with_a_warning(tmp_path: Path, how: str) -> None:
    with CheckpointManager(tmp_path) as manager:
        manager.save(1, make_state(1))
        manager.save(2, make_state(2))
    damage(tmp_path / "step_00000002.ckz", how)
    with pytest.warns(CheckpointSkippedWarning, match="skipping damaged checkpoint of step 2 in .*: "):
        assert_same(manager.restore(), make_state(1))
    with pytest.raises(CorruptCheckpointError):
        manager.restore(2)  # an explicit step does not fall back


def test_restore_raises_when_every_checkpoint_is_damaged(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path) as manager:
        manager.save(1, make_state(1))
        manager.save(2, make_state(2))
    for step in (1, 2):
        damage(tmp_path / f"step_0000000{step}.ckz", "flip")
    with (
        pytest.warns(CheckpointSkippedWarning) as record,
        pytest.raises(CheckpointNotFoundError, match=r"all committed ones \(steps \[1, 2\]\) are damaged"),
    ):
        manager.restore()
    assert [str(w.message).split(" in ")[0] for w in record] == [
        "skipping damaged checkpoint of step 2",
        "skipping damaged checkpoint of step 1",
    ]


def test_restore_without_checkpoints(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path / "missing")
    with pytest.raises(CheckpointNotFoundError, match=r"no committed checkpoint in .*missing; nothing to restore"):
        manager.restore()
    manager.save(1, {}).result()
    with pytest.raises(CheckpointNotFoundError, match=r"no committed checkpoint of step 7 .*committed steps: \[1\]"):
        manager.restore(7)
    manager.close()


def test_leftovers_are_ignored_and_removed_after_the_next_commit(tmp_path: Path) -> None:
    leftover = tmp_path / ".step_00000009.ckz.tmp-123-0a1b2c3d"  # ckptzip.api.atomic_file's temporary name
    leftover.write_bytes(b"partial")
    unrelated = ["notes.txt", ".notes.txt.tmp-1-ab", "step_1.ckz"]
    for name in unrelated:
        (tmp_path / name).write_bytes(b"user data")
    with pytest.warns(IgnoredFileWarning, match="'step_1.ckz'$"):  # named like a checkpoint: reported
        reader = CheckpointManager(tmp_path)
    assert reader.all_steps() == [] and reader.latest_step() is None
    reader.close()
    assert leftover.exists()  # a manager that only reads never deletes
    with pytest.warns(IgnoredFileWarning, match="'step_1.ckz'$"), CheckpointManager(tmp_path) as writer:
        writer.save(1, {}).result()
    assert files(tmp_path) == sorted(["step_00000001.ckz", *unrelated])


def restore_while_saving(reader: CheckpointManager, writer: CheckpointManager, steps: int, numel: int) -> list[int]:
    """Save ``make_state`` for ``steps`` steps while another thread restores the newest checkpoint
    again and again, checking each bit-exactly. Returns the steps that thread restored."""
    stop = threading.Event()

    def read() -> list[int]:
        restored = []
        while not stop.is_set():
            try:
                state = reader.restore()
            except CheckpointNotFoundError:
                continue  # nothing committed yet
            assert_same(state, make_state(state["step"], numel=numel))
            restored.append(state["step"])
        return restored

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        reading = pool.submit(read)
        with writer:
            for step in range(steps):
                writer.save(step, make_state(step, numel=numel))
        stop.set()
        return reading.result()


def test_readers_see_only_whole_checkpoints_while_old_ones_are_retired(tmp_path: Path) -> None:
    restored = restore_while_saving(CheckpointManager(tmp_path), CheckpointManager(tmp_path, keep_last=1), 12, 20_000)
    assert restored and restored == sorted(restored)


# ------------------------------------------------------------------------------------- RNG


def test_rng_state_roundtrip_through_a_checkpoint(tmp_path: Path) -> None:
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    with CheckpointManager(tmp_path) as manager:
        manager.save(1, {"rng": capture_rng_state()})
    draws = (random.random(), np.random.rand(3).tolist(), torch.rand(3))
    random.seed(9)
    np.random.seed(9)
    torch.manual_seed(9)
    restore_rng_state(manager.restore()["rng"])
    again = (random.random(), np.random.rand(3).tolist(), torch.rand(3))
    assert_same(again, draws)


# ------------------------------------------------------------------------------------ storage


def test_missing_fsspec_implementation_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    registry = importlib.import_module("fsspec.registry")._registry
    monkeypatch.delitem(registry, "s3", raising=False)  # as if s3fs had never been imported
    monkeypatch.setitem(sys.modules, "s3fs", None)
    with pytest.raises(StorageUnavailableError, match=r"'s3' protocol needs a package .*pip install \"ckptzip\[s3\]\""):
        CheckpointManager("s3://bucket/run")


# ------------------------------------------------------------------------------------- GPU


@pytest.mark.parametrize("snapshot", ["auto", "device", "host"])
def test_host_state_snapshot_isolates_later_changes(tmp_path: Path, snapshot: str) -> None:
    state = make_state(1)["model"]
    expected = type(state)((k, v.clone()) for k, v in state.items())
    with CheckpointManager(tmp_path, snapshot=snapshot) as manager:
        manager.save(1, state)
        for v in state.values():
            v.bitwise_not_() if v.dtype == torch.bool else v.add_(1)  # the caller may change it at once
        manager.wait()
        assert manager.last_snapshot == ("host" if snapshot == "host" else "device")
        assert_same(manager.restore(1), expected)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("snapshot", ["auto", "device", "host"])
def test_cuda_state_snapshot_isolates_later_kernels(tmp_path: Path, snapshot: str) -> None:
    state = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in make_state(1)["model"].items()}
    big = torch.randn(1 << 24, device="cuda")
    state["big"] = big
    expected = {k: v.cpu() for k, v in state.items()}
    with CheckpointManager(tmp_path, snapshot=snapshot) as manager:
        for _ in range(3):  # reused buffers too
            step = (manager.latest_step() or 0) + 1
            manager.save(step, state)
            big.mul_(2.0).add_(1.0)  # queued right behind the snapshot on the current stream
            manager.wait()
            restored = manager.restore(map_location="cpu")
            assert_same({k: restored[k] for k in expected}, expected)
            assert restored["big"].device.type == "cpu"
            expected["big"] = big.cpu()
        if snapshot == "auto":  # a device copy once an optimizer step has shown the training's peak
            assert manager.last_snapshot == ("device" if guard.stepped() else "host"), manager.last_snapshot_reason
        else:
            assert manager.last_snapshot == snapshot
    torch.cuda.synchronize()


def nan_payloads(device: str) -> dict[str, torch.Tensor]:
    """Tensors of every element width whose bits a round trip through float would change (NaN
    payloads and signs of bf16 and fp16)."""
    bits = torch.tensor([0x7FC1, 0xFF81, 0x7F81, 0x8000, 0x0001, 0x7F80, 0xFFFF, 0x7C01], dtype=torch.int32).to(torch.int16)
    return {
        "bf16": bits.view(torch.bfloat16).to(device),
        "fp16": bits.view(torch.float16).to(device),
        "bf16_strided": bits.view(torch.bfloat16).repeat(4).view(4, 8).t().to(device),  # not contiguous
        # every other element width: 4, 8, 16 and 1 bytes
        "fp32": bits.view(torch.float32).to(device),
        "c64": bits.repeat(2).view(torch.complex64).to(device),
        "c128": bits.repeat(4).view(torch.complex128).to(device),
        "flags": torch.tensor([True, False, True], device=device),
    }


@pytest.mark.parametrize("snapshot", ["device", "host"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, cuda])])
def test_snapshots_keep_nan_payloads_bit_for_bit(tmp_path: Path, device: str, snapshot: str) -> None:
    state = nan_payloads(device)
    with CheckpointManager(tmp_path, snapshot=snapshot) as manager:
        manager.save(1, state)
        manager.wait()
        assert_same(manager.restore(1, map_location="cpu"), {k: v.cpu() for k, v in state.items()})


@pytest.mark.gpu
@cuda
def test_auto_takes_a_host_snapshot_without_room_and_it_needs_little_gpu_memory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_snapshot.gpu, "beside_training", lambda device: 0)  # as if training left nothing at its peak
    g = torch.Generator(device="cuda").manual_seed(0)
    state = {f"w{i}": torch.randn(1 << 26, device="cuda", generator=g) for i in range(6)}  # 1.6 GB
    state["h"] = torch.randn(1 << 20, device="cuda", generator=g).bfloat16()
    expected = {k: v.cpu() for k, v in state.items()}
    with CheckpointManager(tmp_path) as manager:
        for step in (1, 2):  # the second save reuses the pinned buffers
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            manager.save(step, state)
            for v in state.values():
                v.add_(1)
            manager.wait()
            assert manager.last_snapshot == "host"
            assert torch.cuda.max_memory_allocated() - before < 1.5 * 2**30
            assert_same(manager.restore(step, map_location="cpu"), expected)
            expected = {k: v.cpu() for k, v in state.items()}
