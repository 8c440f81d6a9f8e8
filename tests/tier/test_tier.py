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

from ckptzip.api import write_checkpoint
from ckptzip.engine.policy import Policy
from ckptzip.engine.sources import DeltaBase
from ckptzip.errors import MissingBaseError, UnsafeLocationError, UsageError
from ckptzip.format import BaseRef
from ckptzip.tree import flatten
from ckptzip.manager import CheckpointManager, CheckpointSkippedWarning, MemoryTier
from ckptzip.tier import DamagedCopyWarning, ReplicationError
from ckptzip.tier import store as store_module


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


# ------------------------------------------------------------------------------ a shared machine

OTHER = 65534  # nobody
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="making a file another user's needs root")


def _plant(path: Path, kind: str, content: bytes) -> None:
    """A file another user (or no one) put at ``path``: a link to a file elsewhere, or (as root)
    a file of another user."""
    if kind == "link":
        elsewhere = path.parent.parent.parent / f"planted-{path.name}"
        elsewhere.write_bytes(content)
        path.symlink_to(elsewhere)
    else:
        path.write_bytes(content)
        os.chown(path, OTHER, OTHER)


KINDS = ["link", pytest.param("other user's file", marks=as_root)]


@pytest.mark.parametrize("kind", KINDS)
def test_a_planted_checkpoint_is_never_restored(where: tuple[Path, Path], kind: str) -> None:
    """A checkpoint planted in the tier was restored as the newest step."""
    run, shm = where
    tier = MemoryTier(keep=2, persist_every=5, path=shm)
    with CheckpointManager(run, memory_tier=tier) as manager:
        manager.save(1, state(1))
        manager.save(2, state(2))
        manager.wait()
        _plant(shm / "own" / "step_00000009.ckz", kind, _one_file(run.parent / "planted"))
        reader = CheckpointManager(run, memory_tier=tier)
        assert reader.all_steps() == [1, 2]
        assert_same(reader.restore(), state(2))
        assert reader.restored_from == "memory"


@pytest.mark.parametrize("kind", KINDS)
def test_a_planted_step_does_not_stop_checkpointing(where: tuple[Path, Path], kind: str) -> None:
    """A planted step_99999999 stopped checkpointing ("steps must increase")."""
    run, shm = where
    tier = MemoryTier(path=shm)
    with CheckpointManager(run, memory_tier=tier) as manager:
        manager.save(1, state(1))
        manager.wait()
        _plant(shm / "own" / "step_99999999.ckz", kind, b"planted")
    with CheckpointManager(run, memory_tier=tier) as manager:
        assert manager.latest_step() == 1
        manager.save(2, state(2))
        manager.wait()
        assert manager.all_steps() == [1, 2]


def test_a_link_planted_in_the_peer_shelf_is_never_written_through(where: tuple[Path, Path], tmp_path: Path) -> None:
    """A link planted in peer/ made the tier overwrite the file it pointed to."""
    run, shm = where
    manager = CheckpointManager(run, memory_tier=MemoryTier(path=shm))
    store = manager._tier
    assert store is not None
    victim = tmp_path / "victim"
    victim.write_bytes(b"the victim's file")
    (shm / "peer").mkdir(mode=0o700)
    (shm / "peer" / "step_00000003.ckz").symlink_to(victim)
    writer = store.hold(3, 10)
    assert writer is not None
    with writer as f:
        f.write(b"peer bytes")
    assert victim.read_bytes() == b"the victim's file"
    assert (shm / "peer" / "step_00000003.ckz").read_bytes() == b"peer bytes"
    manager.close()


@pytest.mark.parametrize("step", [-7, -1])
def test_a_peer_step_the_tier_would_not_name_is_refused(where: tuple[Path, Path], step: int) -> None:
    """A peer's step_-0000007.ckz was kept in the peer shelf, never listed and never retired."""
    run, shm = where
    with CheckpointManager(run, memory_tier=MemoryTier(path=shm)) as manager:
        assert manager._tier is not None
        with pytest.raises(ReplicationError, match=rf"a peer sent step {step}, which is not a step this tier names"):
            manager._tier.hold(step, 10)
        assert not (shm / "peer").exists() or os.listdir(shm / "peer") == []


def test_a_peer_copy_larger_than_the_tier_can_hold_evicts_nothing(where: tuple[Path, Path]) -> None:
    run, shm = where
    with CheckpointManager(run, memory_tier=MemoryTier(keep=5, persist_every=10, path=shm)) as manager:
        for step in (1, 2, 3):
            manager.save(step, state(step))
        manager.wait()
        assert manager._tier is not None
        with pytest.warns(UserWarning, match=r"has no room for the peer's step_00000007.ckz \(1125899906842624 bytes\)"):
            assert manager._tier.hold(7, 1 << 50) is None
        assert steps_in(shm / "own") == [1, 2, 3]


@pytest.mark.parametrize("mode", [0o777, 0o775])
def test_a_tier_root_others_may_write_in_is_refused(where: tuple[Path, Path], mode: int) -> None:
    """An existing root was accepted whatever its owner and mode, 0777 included."""
    run, shm = where
    shm.mkdir()
    os.chmod(shm, mode)
    with pytest.raises(UnsafeLocationError, match=rf"'{shm}' is not a private directory of this user"):
        CheckpointManager(run, memory_tier=MemoryTier(path=shm))


def test_the_default_root_is_created_private_and_refused_when_it_is_not(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The default root's name is predictable (/dev/shm/ckptzip-<uid>/...): one another user made
    first, or made writable, or a link, is refused, never used."""
    shared = tmp_path / "dev-shm"
    shared.mkdir()
    shared.chmod(0o1777)
    monkeypatch.setattr(store_module, "_SHM", str(shared))
    run = tmp_path / "run"
    tier = MemoryTier()
    with CheckpointManager(run, memory_tier=tier) as manager:
        manager.save(1, state(1))
    top = shared / f"ckptzip-{os.getuid()}"
    root = tier.root(str(run))
    assert root.parent == top
    for path in (top, root, root / "own"):
        assert path.stat().st_mode & 0o7777 == 0o700
    os.chmod(top, 0o777)
    with pytest.raises(UnsafeLocationError, match=rf"'{top}' above it is a directory owned by uid {os.geteuid()}, "
                                                  "mode 0777"):
        CheckpointManager(run, memory_tier=tier)
    os.chmod(top, 0o700)
    os.chmod(root, 0o722)
    with pytest.raises(UnsafeLocationError, match="others may write in it"):
        CheckpointManager(run, memory_tier=tier)


def test_a_durable_delta_whose_base_is_foreign_is_not_a_raw_error(where: tuple[Path, Path]) -> None:
    """A delta in the directory whose base name is not a step name raised a raw ValueError from
    the thread that persists copies (its retention asks each step's base)."""
    run, shm = where
    run.mkdir()
    base = drifting(1)
    ref = BaseRef(1, "foreign.ckz", "0123456789abcdef")
    with (run / "step_00000002.ckz").open("wb") as f:
        write_checkpoint(f, drifting(2), Policy.parse("portable"), base=DeltaBase(ref, flatten_tensors(base)))
    with CheckpointManager(run, keep_last=None, memory_tier=MemoryTier(path=shm)) as manager:
        manager.save(3, state(3))
        manager.wait(persisted=True)
        assert manager.all_steps() == [2, 3]
        with pytest.raises(MissingBaseError, match=r"'foreign\.ckz'.*which is not an earlier checkpoint of this directory"):
            manager.restore(2)


def flatten_tensors(obj: Any) -> dict[str, torch.Tensor]:
    return {item.name: item.tensor for item in flatten(obj).tensors}


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
