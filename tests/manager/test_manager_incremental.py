"""CheckpointManager(incremental=K): XOR deltas against the previous save, chains of at most K
checkpoints, retention that keeps bases, damaged and missing bases, restarts, fsspec stores."""

from __future__ import annotations

import os
import uuid
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import assert_same

import ckptzip
from ckptzip.errors import CheckpointNotFoundError, MissingBaseError
from ckptzip.manager import MAX_INCREMENTAL, CheckpointManager, CheckpointSkippedWarning


def run_state(step: int) -> dict[str, Any]:
    """A training-like state at ``step``: weights that drift slowly (deltas pay), their bf16 copy
    (a cast), and moments that are new noise every step (deltas do not pay)."""
    w0 = torch.randn(256, 256, generator=torch.Generator().manual_seed(0))
    w = w0 * (1 + 1e-4 * step)
    noise = torch.randn(256, 256, generator=torch.Generator().manual_seed(1000 + step))
    return {"model": {"w": w.bfloat16()}, "master": {"w": w}, "exp_avg": noise, "step": step}


def small_state(step: int) -> dict[str, Any]:
    """A small state whose weights drift slowly, so every save after a whole one stores a delta."""
    w = torch.randn(64, 64, generator=torch.Generator().manual_seed(0)) * (1 + 1e-4 * step)
    return {"w": w, "step": step}


def entry_reprs(path: Path) -> list[str]:
    with ckptzip.open(path) as reader:
        return [repr(e) for e in reader.entries()]


def name(step: int) -> str:
    return f"step_{step:08d}.ckz"


def bases_of(directory: Path) -> dict[int, list[int | None]]:
    out = {}
    for n in sorted(os.listdir(directory)):
        if n.startswith("step_"):
            with ckptzip.open(directory / n) as reader:
                out[int(n[5:13])] = [b.step for b in reader.bases]
    return out


def save_steps(manager: CheckpointManager, steps: range) -> None:
    for step in steps:
        manager.save(step, run_state(step))
    manager.wait()


@pytest.mark.parametrize("async_save", [True, False])
def test_chains_hold_at_most_k_checkpoints_and_every_step_restores(tmp_path: Path, async_save: bool) -> None:
    with CheckpointManager(tmp_path, keep_last=None, incremental=3, async_save=async_save) as manager:
        save_steps(manager, range(1, 8))
        assert bases_of(tmp_path) == {1: [], 2: [1], 3: [2], 4: [], 5: [4], 6: [5], 7: []}
        for step in range(1, 8):
            assert_same(manager.restore(step), run_state(step))
        assert_same(manager.restore(), run_state(7))
    with ckptzip.open(tmp_path / name(2)) as reader:
        kinds = {e.name: e.source_kind for e in reader.entries()}
        base = reader.bases[0]
    assert kinds == {"model.w": "cast", "master.w": "xor", "exp_avg": None}
    with ckptzip.open(tmp_path / name(1)) as reader:
        assert (base.step, base.name, base.content_hash) == (1, name(1), reader.content_hash)


def test_deltas_make_checkpoints_smaller(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path / "full", keep_last=None) as full, \
            CheckpointManager(tmp_path / "incr", keep_last=None, incremental=5) as incr:
        save_steps(full, range(1, 4))
        save_steps(incr, range(1, 4))
    assert (tmp_path / "incr" / name(3)).stat().st_size < 0.9 * (tmp_path / "full" / name(3)).stat().st_size


def rl_state(step: int) -> dict[str, Any]:
    """bf16 weights of RL fine-tuning: about 1 % of the elements change by one bit a step."""
    weights = {}
    for i, shape in enumerate([(1024, 512), (512, 512), (4096,)]):
        w = torch.randn(shape, generator=torch.Generator().manual_seed(i)).bfloat16()
        bits = w.view(-1).view(torch.int16)
        for s in range(1, step + 1):
            moved = torch.rand(bits.numel(), generator=torch.Generator().manual_seed(100 * i + s)) < 0.01
            bits[moved] ^= 1
        weights[f"layer{i}.weight"] = w
    return {"model": weights, "step": step}


def test_steps_of_barely_moved_bf16_weights_are_stored_sparse_and_50x_smaller(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path, keep_last=None, incremental=5, async_save=False) as manager:
        for step in range(3):
            manager.save(step, rl_state(step))
        raw = sum(t.nbytes for t in rl_state(2)["model"].values())
        assert (tmp_path / name(2)).stat().st_size * 50 < raw
        with ckptzip.open(tmp_path / name(2)) as reader:
            assert reader._reader.index.version == (2, 2)
            assert {e.transforms[0]["id"] for e in reader.entries() if e.source_kind == "xor"} == {"sparse"}
        for step in range(3):
            assert_same(manager.restore(step), rl_state(step))


def test_retention_keeps_every_base_a_retained_step_needs(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path, keep_last=2, incremental=3) as manager:
        save_steps(manager, range(1, 4))
        assert manager.all_steps() == [1, 2, 3]  # 3 needs 2 needs 1
        save_steps(manager, range(4, 5))
        assert manager.all_steps() == [1, 2, 3, 4]  # 4 is whole; the retained 3 still needs 2 and 1
        assert bases_of(tmp_path) == {1: [], 2: [1], 3: [2], 4: []}


def test_retention_deletes_a_chain_once_no_retained_step_needs_it(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path, keep_last=2, incremental=3) as manager:
        save_steps(manager, range(1, 4))
        assert manager.all_steps() == [1, 2, 3]
        save_steps(manager, range(4, 6))
        assert manager.all_steps() == [4, 5]
        for step in (4, 5):
            assert_same(manager.restore(step), run_state(step))


def test_a_missing_base_is_named_and_restore_falls_back_to_an_intact_chain(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path, keep_last=None, incremental=5) as manager:
        save_steps(manager, range(1, 4))
    os.remove(tmp_path / name(2))
    manager = CheckpointManager(tmp_path)
    with pytest.raises(MissingBaseError, match=r"step 3 .* stored as XOR deltas against step 2, 'step_00000002.ckz', "
                                               r"content hash [0-9a-f]{16}, which is missing"):
        manager.restore(3)
    with pytest.warns(CheckpointSkippedWarning, match="step 3"):
        assert_same(manager.restore(), run_state(1))


def test_a_damaged_base_is_named_and_restore_falls_back(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path, keep_last=None, incremental=2) as manager:
        save_steps(manager, range(1, 5))  # chains [1, 2], [3, 4]
    data = bytearray((tmp_path / name(3)).read_bytes())
    data[100] ^= 0xFF
    (tmp_path / name(3)).write_bytes(bytes(data))
    manager = CheckpointManager(tmp_path)
    with pytest.raises(MissingBaseError, match=r"against step 3, .* which is damaged: .*tensor"):
        manager.restore(4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert_same(manager.restore(), run_state(2))
    assert [str(w.message).split(":")[0] for w in caught] == [
        f"skipping damaged checkpoint of step {s} in {tmp_path}" for s in (4, 3)]


def test_a_replaced_base_is_refused_by_its_content_hash(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path, keep_last=None, incremental=3) as manager:
        save_steps(manager, range(1, 3))
    ckptzip.save(run_state(7), tmp_path / name(1))  # another state under the base's name
    with pytest.raises(MissingBaseError, match=r"step_00000001.ckz holds other tensors now .* the base was replaced"):
        CheckpointManager(tmp_path).restore(2)


def test_a_delta_file_loaded_on_its_own_says_which_base_it_needs(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path, keep_last=None, incremental=3) as manager:
        save_steps(manager, range(1, 3))
    with pytest.raises(MissingBaseError, match=r"'master.w' is stored as an XOR delta against the base checkpoint "
                                               r"step 1, 'step_00000001.ckz'"):
        ckptzip.load(tmp_path / name(2))
    with ckptzip.open(tmp_path / name(2)) as reader:  # what does not need the base still reads
        assert_same(reader["exp_avg"], run_state(2)["exp_avg"])


def test_a_restarted_manager_starts_a_new_chain_and_keeps_the_old_bases(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path, keep_last=None, incremental=5) as manager:
        save_steps(manager, range(1, 4))
    with CheckpointManager(tmp_path, keep_last=2, incremental=5) as manager:
        save_steps(manager, range(4, 5))
        assert manager.all_steps() == [1, 2, 3, 4]  # 3 is retained and needs 2 and 1 (read from the files)
        save_steps(manager, range(5, 6))
        assert manager.all_steps() == [4, 5]
        assert bases_of(tmp_path) == {4: [], 5: [4]}
        assert_same(manager.restore(4), run_state(4))
        assert_same(manager.restore(5), run_state(5))


def test_incremental_checkpoints_on_an_fsspec_store() -> None:
    url = f"memory://runs/{uuid.uuid4().hex}"
    with CheckpointManager(url, keep_last=2, incremental=3) as manager:
        save_steps(manager, range(1, 6))
        assert manager.all_steps() == [4, 5]
        assert_same(manager.restore(5), run_state(5))
        assert_same(manager.restore(), run_state(5))
    with CheckpointManager(url, keep_last=2, incremental=3) as manager:
        save_steps(manager, range(6, 8))  # 6 is whole (a new chain), 7 a delta; 4 and 5 go
        assert manager.all_steps() == [6, 7]
        assert_same(manager.restore(7), run_state(7))


@pytest.mark.parametrize("bad", [0, -1, 2.0, "3", True, MAX_INCREMENTAL + 1, 10**9])
def test_incremental_must_be_a_positive_int(tmp_path: Path, bad: Any) -> None:
    with pytest.raises(ValueError, match=rf"incremental must be None \(every checkpoint whole\) or an int in "
                                         rf"\[1, {MAX_INCREMENTAL}\] \(restoring a step reads up to that many files\), "
                                         rf"got {bad!r}"):
        CheckpointManager(tmp_path, incremental=bad)


def test_a_chain_as_long_as_incremental_allows_restores(tmp_path: Path) -> None:
    """A chain of the most checkpoints incremental= allows (1000; the issue's 360 saves already hit
    Python's recursion limit, reported as a damaged base) restores, newest and middle steps."""
    steps = MAX_INCREMENTAL
    with CheckpointManager(tmp_path, keep_last=None, incremental=MAX_INCREMENTAL, async_save=False) as manager:
        for step in range(steps):
            manager.save(step, small_state(step))
        assert bases_of(tmp_path)[steps - 1] == [steps - 2]  # one chain
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no step is skipped as damaged
        reader = CheckpointManager(tmp_path)
        assert_same(reader.restore(), small_state(steps - 1))
        assert_same(reader.restore(steps // 2), small_state(steps // 2))


def test_a_chain_is_rebuilt_with_one_file_open_at_a_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with CheckpointManager(tmp_path, keep_last=None, incremental=20, async_save=False) as manager:
        for step in range(12):
            manager.save(step, small_state(step))
    reader = CheckpointManager(tmp_path)
    storage_open = reader._storage.open
    open_now, most = [0], [0]

    class Counted:
        def __init__(self, name: str) -> None:
            self.f = storage_open(name)

        def __enter__(self) -> Any:
            open_now[0] += 1
            most[0] = max(most[0], open_now[0])
            return self.f.__enter__()

        def __exit__(self, *exc: object) -> None:
            open_now[0] -= 1
            self.f.__exit__(*exc)

    monkeypatch.setattr(reader._storage, "open", Counted)
    assert_same(reader.restore(11), small_state(11))
    assert most[0] == 2  # the step being restored and one base


def test_restore_while_the_writer_retires_a_chain_warns_about_nothing(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The writer commits a whole step 3, then retires 2 and its base 1 (newest first) between
    restore() opening step 2 and its base: nothing intact is skipped as damaged."""
    with CheckpointManager(tmp_path, keep_last=None, incremental=5, async_save=False) as manager:
        for step in (1, 2):
            manager.save(step, small_state(step))
    assert bases_of(tmp_path) == {1: [], 2: [1]}
    reader = CheckpointManager(tmp_path)
    storage_open = reader._storage.open

    def open_and_race(name: str) -> Any:
        if name == "step_00000001.ckz" and not (tmp_path / "step_00000003.ckz").exists():
            ckptzip.save(small_state(3), tmp_path / "step_00000003.ckz")
            os.remove(tmp_path / "step_00000002.ckz")
            os.remove(tmp_path / "step_00000001.ckz")
        return storage_open(name)

    monkeypatch.setattr(reader._storage, "open", open_and_race)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert_same(reader.restore(), small_state(3))


def test_restore_of_no_intact_chain_raises(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path, keep_last=None, incremental=3) as manager:
        save_steps(manager, range(1, 3))
    os.remove(tmp_path / name(1))
    with pytest.warns(CheckpointSkippedWarning), pytest.raises(CheckpointNotFoundError, match="no valid checkpoint"):
        CheckpointManager(tmp_path).restore()


def test_inspect_shows_casts_duplicates_deltas_and_the_base(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from ckptzip.cli import main

    with CheckpointManager(tmp_path, keep_last=None, incremental=3) as manager:
        manager.save(1, run_state(1))
        manager.save(2, {**run_state(2), "copy": run_state(2)["exp_avg"].clone()})
    assert main(["inspect", str(tmp_path / name(2))]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line for line in out.splitlines() if line.startswith(("model.w", "master.w", "copy"))}
    assert "cast of master.w" in rows["model.w"] and " - " in rows["model.w"]
    assert "xor+planes[" in rows["master.w"]
    assert "copy of exp_avg" in rows["copy"]
    assert "stored as casts of fp32 tensors: 1 tensors, 128.0 KiB (128.0 KiB not stored)" in out
    assert "duplicates stored once: 1 tensors, 256.0 KiB (256.0 KiB not stored)" in out
    assert "stored as XOR deltas: 1 tensors, 256.0 KiB" in out
    assert "needs base checkpoint step 1, 'step_00000001.ckz', content hash " in out


def test_host_snapshots_of_host_tensors_store_deltas_too(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path, keep_last=None, incremental=3, snapshot="host") as manager:
        save_steps(manager, range(1, 4))
        assert bases_of(tmp_path) == {1: [], 2: [1], 3: [2]}
        assert_same(manager.restore(3), run_state(3))


@pytest.mark.gpu
def test_host_snapshots_of_cuda_tensors_store_casts_duplicates_and_deltas(tmp_path: Path) -> None:
    def cuda_state(step: int) -> dict[str, Any]:
        state = run_state(step)
        state = {k: {n: t.cuda() for n, t in v.items()} if isinstance(v, dict) else v for k, v in state.items()}
        state["exp_avg"] = state["exp_avg"].cuda()
        state["copy"] = state["exp_avg"].clone()
        return state

    with CheckpointManager(tmp_path, keep_last=None, incremental=3, snapshot="host") as manager:
        for step in range(1, 5):
            state = cuda_state(step)
            manager.save(step, state)
            state["master"]["w"].add_(1.0)  # the caller may change the state at once
            manager.wait()
            assert manager.last_snapshot == "host"
        assert bases_of(tmp_path) == {1: [], 2: [1], 3: [2], 4: []}
        for step in range(1, 5):
            assert_same(manager.restore(step), cuda_state(step))
    with ckptzip.open(tmp_path / name(2)) as reader:
        kinds = {e.name: e.source_kind for e in reader.entries()}
    assert kinds == {"model.w": "cast", "master.w": "xor", "exp_avg": None, "copy": "copy"}
    whole = tmp_path / "whole.ckz"
    ckptzip.save(cuda_state(1), whole)
    # a host snapshot's file is save()'s: the same table (compared first, to name what differs), the same
    # bytes (its raw share, the last tensors by bytes, falls on the cast and the copy here: references, whose
    # host copies are not coded; a raw share of tensors stored as themselves is coded with the host's codecs)
    assert entry_reprs(tmp_path / name(1)) == entry_reprs(whole)
    assert (tmp_path / name(1)).read_bytes() == whole.read_bytes()
