"""The checkpoint cost model and ``ckptzip cost``, driven through a real argparse parser."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptzip
from ckptzip import cost
from ckptzip.errors import CkptzipError

GIB = 2**30
SEED_BYTES = 70e9 * 12  # bf16 weights + bf16 gradients + two fp32 AdamW moments


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ckptzip")
    cost.configure(parser.add_subparsers(dest="command", required=True).add_parser("cost"))
    return parser


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    status = cost.run(_parser().parse_args(["cost", *argv]))
    out, err = capsys.readouterr()
    return status, out, err


def _json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    status, out, err = _run(capsys, *argv, "--json")
    assert (status, err) == (0, "")
    report: dict[str, Any] = json.loads(out)
    return report


def _bench(tmp_path: Path, doc: object) -> str:
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(doc), encoding="utf-8")
    return str(path)


def test_defaults_reproduce_the_seed_numbers(capsys: pytest.CaptureFixture[str]) -> None:
    report = _json(capsys)
    assert report["bytes_per_param"] == 12
    assert round(report["checkpoint_gib"], 1) == 782.3
    assert round(report["write_seconds"], 1) == 156.5
    assert round(report["stall_seconds"], 1) == 156.5
    assert report["saves_per_month"] == 1440
    assert report["compress_seconds"] == report["snapshot_seconds"] == 0
    assert round(report["idle_hours_per_month"], 1) == 62.6
    assert round(report["idle_cost_per_month"]) == 2203
    assert report["backlog"] is False
    assert "compressed" not in report and "saved_per_month" not in report
    assert "storage_cost_per_month" not in report


def test_seed_flags_spelled_out_give_the_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    explicit = _json(capsys, "--params", "70e9", "--gpus", "8", "--gpu-hour-price", "4.40",
                     "--write-bandwidth", "5", "--interval-minutes", "30", "--days", "30")
    assert explicit == _json(capsys)


def test_table_shows_the_seed_numbers(capsys: pytest.CaptureFixture[str]) -> None:
    assert _run(capsys) == (0, """\
70B params x 12 B/param (bf16 weights, bf16 gradients, AdamW fp32 states)
8 GPUs at $4.40/GPU-hour; a save every 30 min, 30 training days/month; synchronous writes at 5 GiB/s

                                uncompressed
checkpoint size                    782.3 GiB
storage write per save               156.5 s
GPU stall per save                   156.5 s
saves per month                        1,440
idle hours per month                  62.6 h
idle cost per month (8 GPUs)          $2,203
""", "")


def test_documented_examples_match_the_output(capsys: pytest.CaptureFixture[str]) -> None:
    doc = (Path(__file__).parents[1] / "docs" / "COST.md").read_text(encoding="utf-8")
    examples = re.findall(r"```console\n\$ ckptzip cost ([^\n]*)\n(.*?)```", doc, flags=re.DOTALL)
    examples = [(argv, shown) for argv, shown in examples if not shown.startswith("$")]
    assert len(examples) == 2
    for argv, shown in examples:
        assert _run(capsys, *argv.split()) == (0, shown, "")


@pytest.mark.parametrize(("flags", "bytes_per_param"), [
    ((), 12),
    (("--master-weights",), 16),
    (("--no-gradients",), 10),
    (("--weights-dtype", "fp32"), 16),
    (("--weights-dtype", "fp16", "--master-weights", "--optimizer", "sgd"), 12),
    (("--optimizer", "none", "--no-gradients"), 2),
])
def test_layout_flags_set_bytes_per_param(capsys: pytest.CaptureFixture[str], flags: tuple[str, ...],
                                          bytes_per_param: int) -> None:
    report = _json(capsys, *flags)
    assert report["bytes_per_param"] == bytes_per_param
    assert report["checkpoint_gib"] == 70e9 * bytes_per_param / GIB


def test_params_accept_suffixes(capsys: pytest.CaptureFixture[str]) -> None:
    assert _json(capsys, "--params", "70B")["inputs"]["params"] == 70e9
    assert _json(capsys, "--params", "1.5T")["inputs"]["params"] == 1.5e12
    assert _json(capsys, "--params", "350m")["inputs"]["params"] == 350e6


def test_ratio_adds_the_compressed_scenario(capsys: pytest.CaptureFixture[str]) -> None:
    report = _json(capsys, "--ratio", "2")
    raw_gib = SEED_BYTES / GIB
    compressed = report["compressed"]
    assert report["ratio"] == 2 and report["ratio_source"] == "--ratio"
    assert compressed["checkpoint_gib"] == raw_gib / 2
    assert compressed["compress_seconds"] == raw_gib / (200 * 8)
    assert compressed["write_seconds"] == raw_gib / 2 / 5
    assert compressed["stall_seconds"] == pytest.approx(raw_gib / (200 * 8) + raw_gib / 2 / 5, rel=1e-12)
    assert compressed["idle_hours_per_month"] == pytest.approx(1440 * compressed["stall_seconds"] / 3600)
    assert compressed["idle_cost_per_month"] == pytest.approx(compressed["idle_hours_per_month"] * 8 * 4.40)
    assert report["saved_per_month"] == pytest.approx(
        report["idle_cost_per_month"] - compressed["idle_cost_per_month"])
    assert round(report["saved_per_month"]) == 1095
    # the uncompressed numbers stay the seed's
    assert round(report["idle_cost_per_month"]) == 2203


def test_compress_throughput_is_charged_to_the_stall(capsys: pytest.CaptureFixture[str]) -> None:
    fast = _json(capsys, "--ratio", "1.25")["compressed"]
    slow = _json(capsys, "--ratio", "1.25", "--compress-throughput", "1")["compressed"]
    assert slow["compress_seconds"] == SEED_BYTES / GIB / 8
    assert slow["stall_seconds"] - fast["stall_seconds"] == pytest.approx(
        slow["compress_seconds"] - fast["compress_seconds"])


def test_ratio_below_one_costs_money(capsys: pytest.CaptureFixture[str]) -> None:
    report = _json(capsys, "--ratio", "0.9")
    assert report["compressed"]["checkpoint_gib"] > report["checkpoint_gib"]
    assert report["saved_per_month"] < 0


def test_async_stalls_only_for_the_host_copy(capsys: pytest.CaptureFixture[str]) -> None:
    raw_gib = SEED_BYTES / GIB
    report = _json(capsys, "--async", "--ratio", "1.25")
    assert report["snapshot_seconds"] == report["stall_seconds"] == raw_gib / (50 * 8)
    assert report["write_seconds"] == raw_gib / 5
    assert report["backlog"] is False and report["saves_per_month"] == 1440
    compressed = report["compressed"]
    assert compressed["stall_seconds"] == pytest.approx(raw_gib / (200 * 8) + raw_gib / 1.25 / (50 * 8))
    # at 1.25x, compressing before the host copy costs more GPU time than the smaller copy saves
    assert report["saved_per_month"] < 0


def test_async_snapshot_bandwidth_flag(capsys: pytest.CaptureFixture[str]) -> None:
    report = _json(capsys, "--async", "--snapshot-bandwidth", "5")
    assert report["stall_seconds"] == SEED_BYTES / GIB / (5 * 8)


def test_async_backlog_waits_for_the_previous_write(capsys: pytest.CaptureFixture[str]) -> None:
    raw_gib = SEED_BYTES / GIB
    report = _json(capsys, "--async", "--write-bandwidth", "0.25")
    copy_s, write_s = raw_gib / (50 * 8), raw_gib / 0.25
    busy_s = copy_s + write_s
    assert report["backlog"] is True
    assert report["saves_per_month"] == pytest.approx(30 * 86400 / busy_s)
    assert report["stall_seconds"] == pytest.approx(copy_s + busy_s - 1800)
    status, out, _ = _run(capsys, "--async", "--write-bandwidth", "0.25")
    assert status == 0
    assert ("warning (uncompressed): a save is busy longer than the 30-minute interval, "
            "so saves run back to back; save less often or write faster") in out


def test_sync_backlog_is_flagged_and_bounded(capsys: pytest.CaptureFixture[str]) -> None:
    report = _json(capsys, "--write-bandwidth", "0.25")
    write_s = SEED_BYTES / GIB / 0.25
    assert report["backlog"] is True
    assert report["stall_seconds"] == write_s
    assert report["idle_hours_per_month"] == pytest.approx(30 * 24)


def test_storage_cost(capsys: pytest.CaptureFixture[str]) -> None:
    report = _json(capsys, "--storage-price", "0.02", "--keep", "3", "--ratio", "1.25")
    raw_gib = SEED_BYTES / GIB
    assert report["storage_cost_per_month"] == pytest.approx(3 * raw_gib * 0.02)
    assert report["compressed"]["storage_cost_per_month"] == pytest.approx(3 * raw_gib / 1.25 * 0.02)
    idle_saved = report["idle_cost_per_month"] - report["compressed"]["idle_cost_per_month"]
    storage_saved = report["storage_cost_per_month"] - report["compressed"]["storage_cost_per_month"]
    assert report["saved_per_month"] == pytest.approx(idle_saved + storage_saved)
    status, out, _ = _run(capsys, "--storage-price", "0.02", "--keep", "3")
    assert status == 0 and "storage per month (3 kept)" in out and "$46.94" in out


def test_table_with_ratio_and_a_loss(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = _run(capsys, "--ratio", "2")
    assert status == 0 and "compressed 2x" in out and "saved per month: $1,095 (ratio from --ratio)" in out
    status, out, _ = _run(capsys, "--async", "--ratio", "1.25")
    assert status == 0 and "saved per month: -$1.38 (ratio from --ratio)" in out


@pytest.mark.parametrize(("argv", "message"), [
    (("--write-bandwidth", "-5"), "argument --write-bandwidth: expected a positive number, got '-5'"),
    (("--ratio", "0"), "argument --ratio: expected a positive number, got '0'"),
    (("--ratio", "nan"), "argument --ratio: expected a positive number, got 'nan'"),
    (("--params", "seventy"), "argument --params: expected a positive parameter count like 70e9 or 70B, "
                              "got 'seventy'"),
    (("--gpus", "0"), "argument --gpus: expected a positive integer, got '0'"),
    (("--keep", "1.5"), "argument --keep: expected a positive integer, got '1.5'"),
    (("--days", "40"), "argument --days: expected training days per month, in (0, 31], got '40'"),
    (("--gpu-hour-price", "-1"), "argument --gpu-hour-price: expected a number >= 0, got '-1'"),
    (("--optimizer", "lion"), "argument --optimizer: invalid choice: 'lion'"),
    (("--ratio", "2", "--from-bench", "b.json"), "argument --from-bench: not allowed with argument --ratio"),
])
def test_bad_flags_exit_2(capsys: pytest.CaptureFixture[str], argv: tuple[str, ...], message: str) -> None:
    with pytest.raises(SystemExit) as exc:
        _parser().parse_args(["cost", *argv])
    assert exc.value.code == 2
    assert f"ckptzip cost: error: {message}" in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "message"), [
    (("--method", "zstd"), "--method only applies with --from-bench BENCH_JSON"),
    (("--master-weights", "--weights-dtype", "fp32"),
     "master_weights adds an fp32 copy of bf16/fp16 weights, but weights_dtype is already fp32; "
     "drop master_weights or pick weights_dtype bf16 or fp16"),
])
def test_inconsistent_flags_exit_2(capsys: pytest.CaptureFixture[str], argv: tuple[str, ...],
                                   message: str) -> None:
    assert _run(capsys, *argv) == (2, "", f"ckptzip cost: error: {message}\n")


def test_inputs_validate_without_the_cli() -> None:
    with pytest.raises(cost.CostInputError, match=r"^write_bandwidth must be a positive number, got -1$"):
        cost.CostInputs(write_bandwidth=-1)
    with pytest.raises(cost.CostInputError, match=r"^gpus must be a positive integer, got 1.5$"):
        cost.CostInputs(gpus=1.5)  # type: ignore[arg-type]
    with pytest.raises(cost.CostInputError, match=r"^ratio must be a positive number, got inf$"):
        cost.CostInputs(ratio=float("inf"))
    with pytest.raises(cost.CostInputError, match=r"^optimizer must be one of \['adamw', 'none', 'sgd'\], "
                                                  r"got 'adam'$"):
        cost.CostInputs(optimizer="adam")
    assert issubclass(cost.CostInputError, CkptzipError) and issubclass(cost.CostInputError, ValueError)


def test_from_bench_reads_the_named_method(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = _bench(tmp_path, {"methods": [{"name": "zstd", "ratio": 1.1, "seconds": 3.0},
                                         {"name": "ckptzip-auto", "ratio": 1.25}]})
    report = _json(capsys, "--from-bench", path)
    assert report["ratio"] == 1.25 and report["ratio_source"] == f"{path} (ckptzip-auto)"
    assert report["compressed"]["checkpoint_gib"] == SEED_BYTES / GIB / 1.25
    report = _json(capsys, "--from-bench", path, "--method", "zstd")
    assert report["ratio"] == 1.1 and report["ratio_source"] == f"{path} (zstd)"


@pytest.mark.parametrize(("doc", "message"), [
    ({"results": []}, 'has no "methods" list; expected {"methods": [{"name": ..., "ratio": ...}, ...]}'),
    ([1, 2], "has no \"methods\" list"),
    ({"methods": [{"name": "zstd", "ratio": 1.1}, {"name": "lz4", "ratio": 1.0}]},
     "method 'ckptzip-auto' not found in {path!r}; it has 'zstd', 'lz4'; pick one with --method"),
    ({"methods": []}, "method 'ckptzip-auto' not found in {path!r}; it has no named methods"),
    ({"methods": [{"ratio": 1.1}, "zstd", {"name": "lz4", "ratio": 1.0}]},
     "method 'ckptzip-auto' not found in {path!r}; it has 'lz4'; pick one with --method"),
    ({"methods": [{"name": "ckptzip-auto", "ratio": "1.2"}]},
     "method 'ckptzip-auto' in {path!r} has ratio '1.2'; expected a positive number"),
    ({"methods": [{"name": "ckptzip-auto", "ratio": 0}]}, "has ratio 0; expected a positive number"),
    ({"methods": [{"name": "ckptzip-auto", "ratio": True}]}, "has ratio True; expected a positive number"),
    ({"methods": [{"name": "ckptzip-auto"}]}, "has ratio None; expected a positive number"),
])
def test_from_bench_rejects_bad_files(capsys: pytest.CaptureFixture[str], tmp_path: Path, doc: object,
                                      message: str) -> None:
    path = _bench(tmp_path, doc)
    status, out, err = _run(capsys, "--from-bench", path)
    assert (status, out) == (2, "")
    assert err.startswith("ckptzip cost: error: ") and message.replace("{path!r}", repr(path)) in err


def test_from_bench_rejects_unreadable_files(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    missing = str(tmp_path / "missing.json")
    assert _run(capsys, "--from-bench", missing) == (
        2, "", f"ckptzip cost: error: cannot read benchmark file {missing!r}: No such file or directory\n")
    broken = tmp_path / "broken.json"
    broken.write_text("{not json", encoding="utf-8")
    status, _, err = _run(capsys, "--from-bench", str(broken))
    assert status == 2
    assert err.startswith(f"ckptzip cost: error: benchmark file {str(broken)!r} is not valid UTF-8 JSON (")


def test_from_checkpoint_reads_a_saved_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "state.ckz"
    state = {"zeros": torch.zeros(1 << 16, dtype=torch.float32),
             "ramp": torch.arange(4096, dtype=torch.int32)}
    ckptzip.save(state, path)
    with ckptzip.open(path) as reader:
        raw, stored = reader.nbytes, reader.compressed_nbytes
    assert raw == (1 << 16) * 4 + 4096 * 4
    assert 0 < stored < path.stat().st_size
    report = _json(capsys, "--from-checkpoint", str(path))
    assert report["ratio"] == raw / stored
    assert report["ratio"] > 4
    assert report["ratio_source"] == str(path)
    assert report["compressed"]["checkpoint_gib"] == SEED_BYTES / GIB / report["ratio"]


def test_from_checkpoint_rejects_unusable_files(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    missing = tmp_path / "missing.ckz"
    assert _run(capsys, "--from-checkpoint", str(missing)) == (
        2, "", f"ckptzip cost: error: no checkpoint at {str(missing)!r}: the path is missing\n")
    assert _run(capsys, "--from-checkpoint", str(tmp_path)) == (
        2, "", f"ckptzip cost: error: no checkpoint file at {str(tmp_path)!r}: it is a directory, not a "
               "ckptzip file: give a .ckz file\n")
    not_ckz = tmp_path / "notes.ckz"
    not_ckz.write_bytes(b"hello\n")
    status, out, err = _run(capsys, "--from-checkpoint", str(not_ckz))
    assert (status, out) == (2, "")
    assert err.startswith("ckptzip cost: error: ") and "not a ckptzip file" in err
    empty = tmp_path / "empty.ckz"
    ckptzip.save({}, empty)
    assert _run(capsys, "--from-checkpoint", str(empty)) == (
        2, "", f"ckptzip cost: error: checkpoint {str(empty)!r} stores no tensor bytes, so it has no ratio; "
               "pass --ratio or a checkpoint with tensors\n")
