"""`ckptzip bench training-loop` on the CPU with its tiny model: every method's rows, lost time
against the steps without checkpoints, restores in a fresh process compared by digest, and a
method that fails reported as a result, not fatal."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptzip_bench import training_loop


def _run(tmp_path: Path, methods: str, *extra: str) -> list[dict[str, object]]:
    parser = argparse.ArgumentParser()
    training_loop.configure(parser)
    out = tmp_path / "loop.json"
    args = parser.parse_args(["--config", "tiny", "--methods", methods, "--every", "2", "--checkpoints", "2",
                              "--base-steps", "3", "--warm-steps", "1", "--dir", str(tmp_path),
                              "--json", str(out), *extra])
    training_loop.RESULTS.clear()
    assert training_loop.run(args) == 0
    return json.loads(out.read_text())


@pytest.mark.slow
def test_each_method_is_timed_in_the_loop_and_restores_bit_exactly_in_a_fresh_process(tmp_path: Path) -> None:
    rows = _run(tmp_path, "torch.save,ckptzip.save,ckptzip-manager", "--verify")
    timed = {r["method"]: r for r in rows if "lost_per_checkpoint_s" in r}
    assert set(timed) == {"torch.save", "ckptzip.save", "ckptzip-manager"}
    for row in timed.values():
        assert row["every"] == 2 and row["checkpoints"] == 2
        assert isinstance(row["bytes_last"], int) and row["bytes_last"] > 0
        assert row["host_rss_gb"] > 0 and row["host_memory_gb"] > 0 and row["prepare_s"] >= 0
    verified = {r["method"]: r for r in rows if r.get("verify")}
    assert set(verified) == {"torch.save", "ckptzip.save", "ckptzip-manager"}
    assert all(r["bit_exact"] is True for r in verified.values()), verified
    assert verified["ckptzip-manager"]["bytes"] < verified["torch.save"]["bytes"]  # type: ignore[operator]
    assert not (tmp_path / "ckptzip-training-loop" / "ckptzip-manager").exists()  # every method cleans up


@pytest.mark.slow
def test_ckptzip_through_torch_checkpointing_and_dcps_checkpoint_process_restore_bit_exactly(tmp_path: Path) -> None:
    pytest.importorskip("torch_checkpointing")
    methods = ("ckptzip-torch_checkpointing", "ckptzip-dcp-async-process")
    rows = _run(tmp_path, ",".join(methods), "--verify")
    assert {r["method"] for r in rows if "lost_per_checkpoint_s" in r} == set(methods), rows
    verified = {r["method"]: r for r in rows if r.get("verify")}
    assert set(verified) == set(methods) and all(r["bit_exact"] is True for r in verified.values()), verified


def test_a_method_that_fails_is_a_result_with_where_it_failed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(step: int, state: dict[str, torch.Tensor], d: Path) -> None:
        raise OSError("disk gone")

    real = training_loop.make_method

    def make(name: str, directory: Path) -> training_loop.Method:
        method = real(name, directory)
        method.save = broken
        return method

    monkeypatch.setattr(training_loop, "make_method", make)
    rows = _run(tmp_path, "ckptzip.save")
    failed = [r for r in rows if r.get("method") == "ckptzip.save"]
    assert len(failed) == 1 and str(failed[0]["error"]).startswith("OSError: disk gone at test_bench_training_loop.py:")


def test_a_run_cut_short_keeps_the_rows_it_made_in_its_json(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def cut(step: int, state: dict[str, torch.Tensor], d: Path) -> None:
        raise KeyboardInterrupt  # as a time limit's signal ends the run

    real = training_loop.make_method

    def make(name: str, directory: Path) -> training_loop.Method:
        method = real(name, directory)
        if name == "ckptzip.save":
            method.save = cut
        return method

    monkeypatch.setattr(training_loop, "make_method", make)
    with pytest.raises(KeyboardInterrupt):
        _run(tmp_path, "none,ckptzip.save")
    rows = json.loads((tmp_path / "loop.json").read_text())
    assert "step_s" in rows[0] and [r.get("method") for r in rows[1:]] == ["none"]
    assert not (tmp_path / "loop.json.partial").exists()


def test_runs_interleave_methods_and_the_medians_say_each_run(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    rows = _run(tmp_path, "torch.save,ckptzip.save", "--runs", "2")
    timed = [(r["method"], r["run"]) for r in rows if "lost_per_checkpoint_s" in r]
    assert timed == [("torch.save", 1), ("ckptzip.save", 1), ("torch.save", 2), ("ckptzip.save", 2)]
    for r in rows:  # the first interval reported apart: the two parts make the whole, to rounding
        if "lost_per_checkpoint_s" in r:
            whole = 2 * r["lost_per_checkpoint_s"]  # type: ignore[operator]
            assert abs(whole - r["lost_first_s"] - 2 * r["lost_after_first_s"]) < 0.005, r  # type: ignore[operator]
    out = capsys.readouterr().out
    assert "| method | every | lost/ckpt s, median | less the control's | each run | out of memory / failed |" in out
    assert "| method | every | lost/ckpt s | after the 1st interval, /ckpt s | lost first s |" in out
    assert out.count("| 0 of 2 |") == 2


def test_the_control_checkpoints_nothing_and_the_medians_take_its_bias_off_the_others(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rows = _run(tmp_path, "none,ckptzip.save", "--runs", "2", "--verify")
    control = [r for r in rows if r.get("method") == "none"]
    assert [r["run"] for r in control] == [1, 2] and all(r["bytes_last"] == 0 for r in control)
    assert not any(r.get("verify") and r["method"] == "none" for r in rows)  # nothing to restore
    lines = {line.split(" | ")[0].strip("| "): line.split(" | ") for line in capsys.readouterr().out.splitlines()
             if line.startswith("| none | 2 | ") or line.startswith("| ckptzip.save | 2 | ")}
    assert lines["none"][3] == "–"
    ours, theirs = float(lines["ckptzip.save"][2]), float(lines["none"][2])
    assert float(lines["ckptzip.save"][3]) == pytest.approx(ours - theirs, abs=0.0015)


def _touch_shared(tensor: torch.Tensor, ready: Any, done: Any) -> None:
    tensor.add_(1)  # every page mapped and touched here too
    ready.set()
    done.wait(30)


def test_host_memory_counts_shared_memory_a_child_maps_once() -> None:
    import torch.multiprocessing as mp

    from ckptzip.memory.shared import shared_empty

    rss = training_loop.HostRss()
    shared = shared_empty(256 << 20).fill_(1)
    context = mp.get_context("spawn")
    ready, done = context.Event(), context.Event()
    child = context.Process(target=_touch_shared, args=(shared, ready, done))
    child.start()
    try:
        assert ready.wait(60)
        summed, once = rss.now()
    finally:
        done.set()
        child.join(30)
        rss.stop()
    # both processes map every page of the 256 MiB: the summed RSS holds it twice, the other once
    assert (250 << 20) < summed - once < (262 << 20), (summed, once)


def test_an_unknown_method_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    training_loop.configure(parser)
    assert training_loop.run(parser.parse_args(["--methods", "zip-everything", "--dir", str(tmp_path)])) == 2
    assert "unknown method(s) zip-everything" in capsys.readouterr().err
