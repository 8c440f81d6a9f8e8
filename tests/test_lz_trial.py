"""Large float tensors whose values repeat whole are stored unsplit with an LZ codec, when a
sample says LZ beats their byte planes, up to a share of each batch (engine.encode._lz_wins).

The trial runs for ``portable`` on a GPU; the CPU tests give the CPU backend the same LZ codec
(``lz_on_the_cpu``) to exercise the backend-independent machinery where CI runs."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from helpers import assert_same, load_bytes, save_bytes

import ckptzip
from ckptzip.codecs import has_codec
from ckptzip.engine import encode, estimate, policy
from ckptzip.engine.encode import _lz_wins, tensor_bytes
from ckptzip.engine.estimate import middle
from ckptzip.engine.policy import LZ_TRIAL_MIN_BYTES, Policy

PLANES = [{"id": "byteplanes", "itemsize": 4}]
ROWS = LZ_TRIAL_MIN_BYTES // 4 // 1024


def _gradient(rows: int = ROWS, seed: int = 0) -> torch.Tensor:
    """What bf16 autocast and gradient clipping leave in an fp32 gradient: bf16 values times one
    fp32 scale, so a few thousand distinct values repeat whole."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 1024, generator=gen).bfloat16().float() * 0.37


def _weight(rows: int = ROWS, seed: int = 1) -> torch.Tensor:
    return torch.randn(rows, 1024, generator=torch.Generator().manual_seed(seed)) * 0.02


def _moment(rows: int, seed: int = 2) -> torch.Tensor:
    """Like Adam's exp_avg_sq of a linear layer: a row scale times a column scale, squared, so
    exponent bytes repeat in short runs that zstd level 3 matches."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.rand(rows, 1, generator=gen) * 1e-3) ** 2 * (torch.rand(1, 1024, generator=gen) * 1e-2) ** 2 + 1e-12


def _entries(data: bytes) -> dict:
    with ckptzip.open(io.BytesIO(data)) as reader:
        return {e.name: e for e in reader.entries()}


@pytest.fixture
def lz_on_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(policy._LZ_CODECS, ("portable", "cpu"), {"id": "zstd", "level": 3})
    monkeypatch.setattr(encode, "LZ_MAX_SHARE", 1.0)


@pytest.mark.usefixtures("lz_on_the_cpu")
def test_values_that_repeat_whole_are_stored_whole_with_lz() -> None:
    state = {"grad": _gradient(), "weight": _weight()}
    data = save_bytes(state, codec="portable")
    entries = _entries(data)
    assert entries["grad"].transforms == [] and entries["grad"].codecs == ["zstd"]
    assert entries["weight"].transforms == PLANES
    as_planes = _entries(save_bytes({"grad": state["grad"]}, codec="fast"))["grad"]
    assert as_planes.transforms == PLANES
    assert entries["grad"].compressed_nbytes < 0.95 * as_planes.compressed_nbytes
    assert_same(load_bytes(data), state)


@pytest.mark.usefixtures("lz_on_the_cpu")
def test_other_presets_and_smaller_tensors_are_not_tried() -> None:
    for preset in ("auto", "fast"):
        assert _entries(save_bytes({"g": _gradient()}, codec=preset))["g"].transforms == PLANES
    assert _entries(save_bytes({"g": _gradient(rows=ROWS // 2)}, codec="portable"))["g"].transforms == PLANES


def test_without_an_lz_codec_the_cpu_keeps_planes() -> None:
    assert Policy.parse("portable").lz_codec("cpu") is None and Policy.parse("auto").lz_codec("cuda") is None
    assert _entries(save_bytes({"g": _gradient()}, codec="portable"))["g"].transforms == PLANES


@pytest.mark.usefixtures("lz_on_the_cpu")
def test_a_tensor_whose_sample_does_not_repeat_keeps_its_planes() -> None:
    grad = _weight()
    # repeats only outside the middle sample: the trial judges by the sample
    grad[: ROWS // 4] = _gradient(rows=ROWS // 4)
    assert _entries(save_bytes({"g": grad}, codec="portable"))["g"].transforms == PLANES


@pytest.mark.usefixtures("lz_on_the_cpu")
def test_lz_takes_at_most_its_share_of_a_batch_largest_savings_first(monkeypatch: pytest.MonkeyPatch) -> None:
    coarse = (torch.randint(-64, 64, (ROWS, 1024), generator=torch.Generator().manual_seed(3)) * 0.01).float()
    tensors = [_weight(), _gradient(), coarse, _gradient(seed=4)]  # coarse: 128 values, the largest saving
    datas = [tensor_bytes(t) for t in tensors]
    tried = np.ones(4, dtype=bool)
    itemsize = np.full(4, 4)

    def wins(share: float) -> list[bool]:
        monkeypatch.setattr(encode, "LZ_MAX_SHARE", share)
        return _lz_wins(datas, tried, itemsize, Policy.parse("portable"), "cpu").tolist()

    assert wins(1.0) == [False, True, True, True]
    half = wins(0.5)  # room for two: the coarse tensor and one gradient (their savings differ little)
    assert half[0] is False and half[2] is True and sum(half) == 2
    assert wins(0.25) == [False, False, True, False]
    assert wins(0.2) == [False, False, False, False]


@pytest.mark.parametrize(("nbytes", "size", "itemsize"), [(10_000_000, 1 << 18, 4), (1000, 1 << 18, 8),
                                                          (1 << 20, 1 << 18, 2), (3 * 257, 512, 2)])
def test_a_middle_sample_is_whole_elements_from_an_aligned_start(nbytes: int, size: int, itemsize: int) -> None:
    sample = middle(nbytes, size, itemsize)
    assert sample.start % 256 == 0 and 0 <= sample.start <= sample.stop <= nbytes
    assert (sample.stop - sample.start) == min(nbytes, size) // itemsize * itemsize
    assert sample.start <= nbytes - sample.stop + 256  # centred, up to the alignment


LITERALS = {"id": "zstd", "level": 1, "long_matches_only": True}


@pytest.mark.parametrize("preset", ["auto", "portable", "fast"])
def test_cpu_exponent_planes_take_the_zstd_that_codes_their_sample_smallest(preset: str) -> None:
    entries = _entries(save_bytes({"w": _weight(rows=64), "v": _moment(rows=64)}, codec=preset))
    assert entries["w"].streams[3].codec == LITERALS
    assert entries["v"].streams[3].codec == (LITERALS if preset == "fast" else {"id": "zstd", "level": 3})


def _samples(device: str) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen).to(device) for n in (4096, 8, 1 << 16, 400)]


@pytest.mark.parametrize("itemsize", [2, 4, 8])
def test_plane_counts_on_a_gpu_equal_numpys(itemsize: int) -> None:
    samples = _samples("cpu")
    want = estimate.plane_counts(samples, itemsize)
    assert want.shape == (4, itemsize, 256) and want.sum() == sum(s.numel() for s in samples)
    got = torch.cat([estimate._device_counts(samples[:2], itemsize), estimate._device_counts(samples[2:], itemsize)])
    np.testing.assert_array_equal(got.numpy().reshape(want.shape), want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_plane_counts_of_many_samples_on_a_gpu_count_in_bounded_groups(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(estimate, "GPU_COUNT_BYTES", 5000)  # two groups: [4096, 8, 65536] and [400]
    want = estimate.plane_counts(_samples("cpu"), 4)
    np.testing.assert_array_equal(estimate.plane_counts(_samples("cuda"), 4), want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or not has_codec("zstd", "cuda"), reason="needs CUDA and nvCOMP")
def test_on_a_gpu_portable_tries_lz_and_auto_keeps_its_planes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(encode, "LZ_MAX_SHARE", 1.0)
    state = {"grad": _gradient().cuda(), "weight": _weight().cuda()}
    portable, auto = _entries(save_bytes(state, codec="portable")), _entries(save_bytes(state, codec="auto"))
    assert portable["grad"].transforms == [] and portable["grad"].codecs == ["zstd"]
    assert portable["weight"].transforms == PLANES and auto["grad"].transforms == PLANES
    data = save_bytes(state, codec="portable")
    assert_same(load_bytes(data), state)
    assert_same(load_bytes(data, map_location="cpu"), {k: v.cpu() for k, v in state.items()})
