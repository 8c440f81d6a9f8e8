"""Benchmark baselines round-trip real training state bit for bit; the comparison helper is strict."""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptzip_bench.baselines import (
    BASELINES,
    CpuZstd,
    Dcp,
    NvcompAns,
    Safetensors,
    TorchSave,
    get_baseline,
)
from ckptzip_bench.measure import assert_state_equal, flat_tensors, iter_tensors, run_baseline, tensor_nbytes
from ckptzip.errors import CheckpointWriteError, CodecUnavailableError, CorruptCheckpointError
from ckptzip.demo.training import train


@pytest.fixture(scope="module")
def state() -> dict[str, Any]:
    return train("tiny-moe", 2, bf16_weights=True).state()


@pytest.mark.parametrize("cls", BASELINES, ids=lambda cls: cls.name)
def test_available_baselines_round_trip_bit_exactly(cls: type, state: dict[str, Any], tmp_path: Path) -> None:
    baseline = cls()
    ok, why = baseline.available()
    if not ok:
        pytest.skip(why)
    run = run_baseline(baseline, state, tmp_path / "ckpt")
    assert run.mismatch is None
    assert run.raw_bytes == tensor_nbytes(state)
    assert run.bytes_written == sum(p.stat().st_size for p in (tmp_path / "ckpt").iterdir())
    assert run.save_seconds > 0 and run.load_seconds > 0


@pytest.mark.parametrize("name", ["zstd-cpu", "dcp+zstd"])
def test_zstd_baselines_write_fewer_bytes_than_the_tensors(
    name: str, state: dict[str, Any], tmp_path: Path
) -> None:
    baseline = get_baseline(name)
    ok, why = baseline.available()
    if not ok:
        pytest.skip(why)
    assert run_baseline(baseline, state, tmp_path).ratio > 1.05


def test_torch_save_keeps_the_exact_structure(state: dict[str, Any], tmp_path: Path) -> None:
    TorchSave().save(state, tmp_path)
    loaded, _ = TorchSave().load(tmp_path)
    assert 0 in loaded["optimizer"]["state"]
    assert isinstance(loaded["model"], OrderedDict)
    assert loaded["optimizer"]["param_groups"][0]["betas"] == (0.9, 0.95)


def test_dcp_promises_string_keys_and_safetensors_flat_tensors(state: dict[str, Any]) -> None:
    dcp_view = Dcp().expected(state)
    assert "0" in dcp_view["optimizer"]["state"] and 0 not in dcp_view["optimizer"]["state"]
    flat = Safetensors().expected(state)
    assert set(flat) == {path for path, _ in iter_tensors(state)}
    assert "optimizer.state.0.exp_avg" in flat and "step" not in flat


def test_save_refuses_a_non_empty_directory(state: dict[str, Any], tmp_path: Path) -> None:
    (tmp_path / "other.txt").write_text("x")
    with pytest.raises(CheckpointWriteError, match=r"needs an empty directory .* is not empty"):
        CpuZstd().save(state, tmp_path)


def test_truncated_blob_file_is_reported(state: dict[str, Any], tmp_path: Path) -> None:
    CpuZstd().save(state, tmp_path)
    blobs = tmp_path / "blobs.bin"
    blobs.write_bytes(blobs.read_bytes()[:-10])
    with pytest.raises(CorruptCheckpointError, match=r"blobs\.bin' has \d+ bytes, index\.pt expects \d+"):
        CpuZstd().load(tmp_path)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without a GPU")
def test_gpu_baseline_without_gpu_says_why(state: dict[str, Any], tmp_path: Path) -> None:
    ok, why = NvcompAns().available()
    assert not ok and "no CUDA device is visible" in why
    with pytest.raises(
        CodecUnavailableError, match=r"baseline 'nvcomp-ans' cannot run here: .*no CUDA device"
    ):
        NvcompAns().save(state, tmp_path)


def test_unknown_baseline_name_lists_known_ones() -> None:
    with pytest.raises(
        ValueError, match=r"unknown baseline 'gzip'; expected one of torch\.save, safetensors"
    ):
        get_baseline("gzip")


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["nvcomp-zstd", "nvcomp-ans", "nvcomp-ans-typed"])
def test_nvcomp_baselines_on_gpu(name: str, tmp_path: Path) -> None:
    baseline = get_baseline(name)
    ok, why = baseline.available()
    if not ok:
        pytest.skip(why)
    gpu_state = train("tiny", 2, device="cuda").state()
    run = run_baseline(baseline, gpu_state, tmp_path, device="cuda")
    assert run.mismatch is None
    speed = baseline.throughput(gpu_state)
    assert speed.mismatch is None
    assert speed.raw_bytes == tensor_nbytes(gpu_state)
    assert speed.ratio > 1.0 and speed.encode_gbps > 0 and speed.decode_gbps > 0


# ------------------------------------------------------------------------ assert_state_equal


def test_equal_states_pass_including_nan_and_mapping_subclasses() -> None:
    a = {"w": torch.tensor([1.0, float("nan")]), "step": 3, "lr": float("nan"), "g": [(1, "x")]}
    b = {"w": a["w"].clone(), "step": 3, "lr": float("nan"), "g": [(1, "x")]}
    assert_state_equal(a, b)
    assert_state_equal(OrderedDict(a), b)


@pytest.mark.parametrize(
    ("actual", "message"),
    [
        ({"w": torch.tensor([-0.0, 1.0])}, r"w: tensor bytes differ"),  # torch.equal calls -0.0 == 0.0
        (
            {"w": torch.tensor([0.0, 1.0], dtype=torch.float64)},
            r"w: expected torch.float32 \(2,\), found torch.float64",
        ),
        (
            {"w": torch.tensor([[0.0, 1.0]])},
            r"w: expected torch.float32 \(2,\), found torch.float32 \(1, 2\)",
        ),
        ({"w": [0.0, 1.0]}, r"w: expected a tensor, found list"),
        ({"v": torch.tensor([0.0, 1.0])}, r"<root>: keys differ; missing \['w'\], unexpected \['v'\]"),
    ],
)
def test_tensor_differences_are_named(actual: dict[str, Any], message: str) -> None:
    with pytest.raises(AssertionError, match=message):
        assert_state_equal({"w": torch.tensor([0.0, 1.0])}, actual)


@pytest.mark.parametrize(
    ("expected", "actual", "message"),
    [
        ({"s": {0: 1}}, {"s": {"0": 1}}, r"s: keys differ; missing \[0\], unexpected \['0'\]"),
        ({"b": (0.9, 0.95)}, {"b": [0.9, 0.95]}, r"b: expected tuple of length 2, found list of length 2"),
        ({"n": 1}, {"n": 1.0}, r"n: expected 1, found 1.0"),
        ({"n": [1, 2]}, {"n": [1, 3]}, r"n.1: expected 2, found 3"),
    ],
)
def test_structure_differences_are_named(expected: Any, actual: Any, message: str) -> None:
    with pytest.raises(AssertionError, match=message):
        assert_state_equal(expected, actual)


def test_flat_tensors_rejects_colliding_paths() -> None:
    with pytest.raises(ValueError, match=r"two tensors of the state flatten to the same path 'a\.b'"):
        flat_tensors({"a.b": torch.zeros(1), "a": {"b": torch.zeros(1)}})
