"""CheckpointManager across process deaths: SIGKILL at random moments of a save loop, and a
training run killed after a checkpoint that resumes bit-identically in a fresh process.

Run as a script, this file is the child process: ``python test_manager_crash.py <mode> ...``.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers import assert_same
from torch import nn

import ckptzip
from ckptzip.manager import CheckpointManager, capture_rng_state, restore_rng_state
from ckptzip.storage import LOCK_NAME
from ckptzip.storage.files import _TEMP


def big_state(step: int) -> dict[str, Any]:
    """~8 MB that differs bit by bit between steps, so a save takes long enough to be interrupted."""
    g = torch.Generator().manual_seed(step)
    return {"step": step, "w": torch.randn(1 << 21, generator=g), "b": torch.randint(0, 100, (1000,), generator=g)}


def drifting_state(step: int) -> dict[str, Any]:
    """~8 MB of weights that drift slowly between steps (so incremental saves store XOR deltas)."""
    w = torch.randn(1 << 21, generator=torch.Generator().manual_seed(0))
    return {"step": step, "w": w * (1 + 1e-4 * step), "b": torch.arange(1000) + step}


STATES = {"save-forever": big_state, "save-forever-incremental": drifting_state}


def child(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, __file__, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )


def kill(proc: subprocess.Popen[str]) -> None:
    os.kill(proc.pid, signal.SIGKILL)
    assert proc.wait(timeout=60) == -signal.SIGKILL


# ------------------------------------------------------------------------------ kill -9 while saving


def save_forever(directory: str, mode: str) -> None:
    """Child: save the mode's state for consecutive steps until killed, printing each returned save
    (incremental: chains of at most 3 checkpoints, so kills land in deltas, whole ones and retention)."""
    manager = CheckpointManager(directory, keep_last=2, incremental=3 if mode.endswith("incremental") else None)
    step = (manager.latest_step() or 0) + 1
    while True:
        manager.save(step, STATES[mode](step))
        print(step, flush=True)
        step += 1


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(STATES))
def test_sigkill_at_any_moment_leaves_the_last_commit_loadable(tmp_path: Path, mode: str) -> None:
    chance = random.Random(1234)
    killed_mid_write = 0
    deltas = 0
    state = STATES[mode]
    for trial in range(10):
        proc = child(mode, str(tmp_path))
        for _ in range(chance.randint(1, 3)):
            assert proc.stdout is not None and proc.stdout.readline()
        time.sleep(chance.uniform(0.0, 0.3))
        kill(proc)

        manager = CheckpointManager(tmp_path)
        steps = manager.all_steps()
        names = set(os.listdir(tmp_path))
        leftovers = {n for n in names if _TEMP.fullmatch(n)}  # ckptzip.storage.atomic_file's temporaries
        assert names - {LOCK_NAME} == {f"step_{s:08d}.ckz" for s in steps} | leftovers  # a killed writer's lock file stays
        killed_mid_write += bool(leftovers)
        for step in steps:  # every listed checkpoint is whole; restore() never needs to skip one
            assert_same(manager.restore(step), state(step))
            with ckptzip.open(tmp_path / f"step_{step:08d}.ckz") as reader:
                deltas += bool(reader.bases)
        if steps:
            assert_same(manager.restore(), state(steps[-1]))
        if trial >= 2 and killed_mid_write and (deltas or mode == "save-forever"):
            break
    assert killed_mid_write, "no kill landed inside a write; the test did not test anything"
    assert deltas or mode == "save-forever", "no delta checkpoint was committed; the test did not test chains"

    with CheckpointManager(tmp_path) as manager:
        step = (manager.latest_step() or 0) + 1
        manager.save(step, state(step))
    assert os.listdir(tmp_path) and all(n.startswith("step_") for n in os.listdir(tmp_path))  # leftovers gone
    assert manager.latest_step() == step


# ------------------------------------------------------------------------- exact resume after a kill


def train(directory: str, total: int, save_at: int, stall_at: int, out: str) -> None:
    """Child: train a tiny model to ``total`` steps, resuming from ``directory`` if it holds a checkpoint.

    Randomness comes from all four global generators (data, noise, augmentation, dropout). At step
    ``save_at`` the full state is checkpointed; at ``stall_at`` the child prints and blocks so it can
    be killed there. The final losses and state are written to ``out``.
    """
    torch.set_num_threads(1)
    torch.manual_seed(0)
    random.seed(1)
    np.random.seed(2)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    manager = CheckpointManager(directory)
    losses: list[float] = []
    start = 0
    if manager.latest_step() is not None:
        state = manager.restore()
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        restore_rng_state(state["rng"])
        losses, start = state["losses"], state["step"] + 1
    for step in range(start, total):
        x = torch.randn(8, 16)
        if random.random() < 0.5:
            x = -x
        target = x.sum(dim=1, keepdim=True) + torch.from_numpy(np.random.randn(8, 1).astype(np.float32))
        loss = nn.functional.mse_loss(model(x), target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        if step == save_at:
            state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "rng": capture_rng_state()}
            manager.save(step, {**state, "losses": losses, "step": step})
        if step == stall_at:
            manager.wait()
            print("stalled", flush=True)
            sys.stdin.readline()
    manager.close()
    ckptzip.save({"losses": losses, "model": model.state_dict(), "optimizer": optimizer.state_dict()}, out)


@pytest.mark.slow
def test_resume_after_kill_is_bit_identical_to_an_uninterrupted_run(tmp_path: Path) -> None:
    total, save_at, stall_at = 30, 11, 17
    interrupted = child("train", str(tmp_path / "run"), str(total), str(save_at), str(stall_at), "-")
    assert interrupted.stdout is not None and interrupted.stdout.readline() == "stalled\n"
    kill(interrupted)  # six steps after the checkpoint
    assert CheckpointManager(tmp_path / "run").all_steps() == [save_at]

    runs = {
        "resumed": child("train", str(tmp_path / "run"), str(total), "-1", "-1", str(tmp_path / "resumed.ckz")),
        "straight": child("train", str(tmp_path / "fresh"), str(total), "-1", "-1", str(tmp_path / "straight.ckz")),
    }
    for proc in runs.values():
        assert proc.wait(timeout=300) == 0
    resumed, straight = (ckptzip.load(tmp_path / f"{name}.ckz") for name in runs)
    assert len(straight["losses"]) == total
    assert_same(resumed, straight)


if __name__ == "__main__":
    mode, *rest = sys.argv[1:]
    if mode in STATES:
        save_forever(rest[0], mode)
    else:
        train(rest[0], int(rest[1]), int(rest[2]), int(rest[3]), rest[4])
