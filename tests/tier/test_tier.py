"""CheckpointManager with a memory tier, one rank: commits to shared memory, background
persistence every M-th save, restore from the fastest valid tier, damaged copies, retention,
budget with back-pressure, delta chains, and kill -9 of the trainer.

Run as a script, this file is the child process that saves until it is killed.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import assert_same

from ckptzip.errors import UsageError
from ckptzip.manager import CheckpointManager, CheckpointSkippedWarning, MemoryTier
from ckptzip.tier import DamagedCopyWarning


def state(step: int, n: int = 1 << 15) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {"step": step, "w": torch.randn(n, generator=g), "b": torch.randint(0, 100, (100,), generator=g)}


def drifting(step: int) -> dict[str, Any]:
    """Weights that move a little per step, so incremental saves store deltas."""
    w = torch.randn(1 << 15, generator=torch.Generator().manual_seed(0))
    return {"step": step, "w": w * (1 + 1e-4 * step), "b": torch.arange(100) + step}


def steps_in(path: Path) -> list[int]:
    return sorted(int(n[5:-4]) for n in os.listdir(path) if n.startswith("step_") and n.endswith(".ckz")) \
        if path.is_dir() else []


def flip(path: Path) -> None:
    """Damage a byte in the middle of a file."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.fixture
def where(tmp_path: Path) -> tuple[Path, Path]:
    return tmp_path / "run", tmp_path / "shm"


def test_saves_commit_to_memory_and_every_mth_to_the_directory(where: tuple[Path, Path]) -> None:
    run, shm = where
    tier = MemoryTier(keep=2, persist_every=3, path=shm)
    with CheckpointManager(run, keep_last=2, memory_tier=tier) as manager:
        for step in range(1, 8):
            manager.save(step, state(step))
            manager.wait()
            assert steps_in(shm / "own") == list(range(max(1, step - 1), step + 1))
        manager.wait(persisted=True)
        assert steps_in(run) == [3, 6]
        assert manager.all_steps() == [3, 6, 7]
    assert steps_in(run) == [6, 7]  # close() persists the newest; keep_last counts the directory

    reader = CheckpointManager(run, memory_tier=tier)
    assert reader.restored_from is None
    assert_same(reader.restore(), state(7))
    assert reader.restored_from == "memory"
    assert_same(reader.restore(6), state(6))
    assert reader.restored_from == "memory"


def test_restore_reads_the_directory_when_the_tier_is_gone(where: tuple[Path, Path]) -> None:
    run, shm = where
    with CheckpointManager(run, memory_tier=MemoryTier(path=shm)) as manager:
        for step in (1, 2):
            manager.save(step, state(step))
    for name in os.listdir(shm / "own"):
        os.unlink(shm / "own" / name)
    reader = CheckpointManager(run, memory_tier=MemoryTier(path=shm))
    assert_same(reader.restore(), state(2))
    assert reader.restored_from == "directory"


def test_a_damaged_memory_copy_is_not_used(where: tuple[Path, Path]) -> None:
    run, shm = where
    tier = MemoryTier(keep=3, persist_every=2, path=shm)
    with CheckpointManager(run, keep_last=None, memory_tier=tier) as manager:
        for step in (1, 2, 3):
            manager.save(step, state(step))
        manager.wait()
        manager.wait(persisted=True)
        flip(shm / "own" / "step_00000002.ckz")  # also in the directory
        flip(shm / "own" / "step_00000003.ckz")  # only in memory
        reader = CheckpointManager(run, memory_tier=tier)
        with pytest.warns(CheckpointSkippedWarning, match="step 3"), pytest.warns(DamagedCopyWarning, match="00000002"):
            assert_same(reader.restore(), state(2))
        assert reader.restored_from == "directory"
        manager.save(4, state(4))  # the writer goes on


def test_retention_keeps_the_newest_durable_and_every_base(where: tuple[Path, Path]) -> None:
    run, shm = where
    tier = MemoryTier(keep=2, persist_every=2, path=shm)
    with CheckpointManager(run, keep_last=1, incremental=3, memory_tier=tier) as manager:
        for step in range(1, 12):
            manager.save(step, drifting(step))
            manager.wait()
            assert max(steps_in(shm / "own")) == step  # latest is whole in memory
    durable = steps_in(run)
    for name in os.listdir(shm / "own"):  # the node's memory is gone: the directory alone restores
        os.unlink(shm / "own" / name)
    reader = CheckpointManager(run, memory_tier=tier)
    assert reader.all_steps() == durable
    for step in durable:
        assert_same(reader.restore(step), drifting(step))
        assert reader.restored_from == "directory"
    assert durable[-1] == 11
    assert len(durable) > 1, "no chain was persisted; the test did not test bases"


def test_budget_bounds_the_tier_with_back_pressure(where: tuple[Path, Path]) -> None:
    run, shm = where
    size = len(_one_file(run.parent / "probe"))
    tier = MemoryTier(keep=10, persist_every=1, budget=int(2.5 * size), path=shm)
    with CheckpointManager(run, keep_last=2, memory_tier=tier) as manager:
        for step in range(1, 9):
            manager.save(step, state(step))
            manager.wait()
            held = sum(p.stat().st_size for p in (shm / "own").iterdir())
            assert held <= tier.budget and max(steps_in(shm / "own")) == step
    reader = CheckpointManager(run, memory_tier=tier)
    assert_same(reader.restore(), state(8))

    small = MemoryTier(budget=size // 2, path=shm.parent / "small")
    with CheckpointManager(run.parent / "big", memory_tier=small) as manager, \
            pytest.warns(UserWarning, match="budget"):
        manager.save(1, state(1))
        manager.save(2, state(2))
        manager.wait()
        assert steps_in(run.parent / "big") == [1, 2] and steps_in(shm.parent / "small" / "own") == []
    assert_same(CheckpointManager(run.parent / "big", memory_tier=small).restore(), state(2))


def _one_file(directory: Path) -> bytes:
    with CheckpointManager(directory) as manager:
        manager.save(1, state(1))
    return (directory / "step_00000001.ckz").read_bytes()


def test_tier_settings_are_checked() -> None:
    for bad in ({"keep": 0}, {"persist_every": 1.5}, {"budget": -1}, {"replicate": "everyone"}):
        with pytest.raises(UsageError):
            MemoryTier(**bad)  # type: ignore[arg-type]


def test_default_tier_lives_in_shared_memory_named_after_the_directory(tmp_path: Path) -> None:
    root = MemoryTier().root(str(tmp_path / "run"))
    assert root != MemoryTier().root(str(tmp_path / "other"))
    if os.path.isdir("/dev/shm"):
        assert root.parts[:3] == ("/", "dev", "shm")


# ------------------------------------------------------------------------------ kill -9


def save_forever(run: str, shm: str) -> None:
    """Child: save consecutive steps until killed, printing each step whose save returned."""
    tier = MemoryTier(keep=2, persist_every=3, path=shm)
    manager = CheckpointManager(run, keep_last=2, incremental=3, memory_tier=tier)
    step = (manager.latest_step() or 0) + 1
    while True:
        manager.save(step, drifting(step))
        print(step, flush=True)
        step += 1


@pytest.mark.slow
def test_sigkill_at_any_moment_restores_the_newest_commit_from_memory(where: tuple[Path, Path]) -> None:
    run, shm = where
    chance = random.Random(26)
    tier = MemoryTier(keep=2, persist_every=3, path=shm)
    returned = torn = 0
    for _ in range(8):
        proc = subprocess.Popen([sys.executable, __file__, str(run), str(shm)], stdout=subprocess.PIPE, text=True)
        for _ in range(chance.randint(1, 4)):
            assert proc.stdout is not None
            returned = int(proc.stdout.readline())
        time.sleep(chance.uniform(0.0, 0.2))
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
        torn += any(n.endswith(".tmp") for n in os.listdir(shm / "own"))
        reader = CheckpointManager(run, memory_tier=tier)
        steps = reader.all_steps()
        assert steps[-1] >= returned - 1  # save() returned; at most that one was still being written
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # nothing listed is damaged
            for step in steps:
                assert_same(reader.restore(step), drifting(step))
            assert_same(reader.restore(), drifting(steps[-1]))
        assert reader.restored_from == "memory"
        for step in steps_in(run):  # the directory alone restores every step it holds
            durable = CheckpointManager(run)
            assert_same(durable.restore(step), drifting(step))
    assert torn, "no kill landed inside a write to the tier; the test did not test torn copies"


if __name__ == "__main__":
    save_forever(*sys.argv[1:3])
