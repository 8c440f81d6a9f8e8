"""Sample estimates (engine.estimate): middle samples, byte counts per plane on both backends, and
the plane entropies read ahead of a GPU's batches."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ckptzip.engine import estimate
from ckptzip.engine.estimate import middle
from ckptzip.kernels.planes import ELEMENTS_PER_BLOCK, SAMPLE_EVERY


@pytest.mark.parametrize(("nbytes", "size", "itemsize"), [(10_000_000, 1 << 18, 4), (1000, 1 << 18, 8),
                                                          (1 << 20, 1 << 18, 2), (3 * 257, 512, 2)])
def test_a_middle_sample_is_whole_elements_from_an_aligned_start(nbytes: int, size: int, itemsize: int) -> None:
    sample = middle(nbytes, size, itemsize)
    assert sample.start % 256 == 0 and 0 <= sample.start <= sample.stop <= nbytes
    assert (sample.stop - sample.start) == min(nbytes, size) // itemsize * itemsize
    assert sample.start <= nbytes - sample.stop + 256  # centred, up to the alignment


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


def _split_sample_entropies(data: np.ndarray, itemsize: int, blocks: list[int]) -> np.ndarray:
    """The plane entropies of whole blocks ``blocks`` of ``data`` (uint8), counted in NumPy."""
    block = ELEMENTS_PER_BLOCK * itemsize
    rows = np.concatenate([data[b * block : (b + 1) * block] for b in blocks]).reshape(-1, itemsize)
    counts = np.stack([np.bincount(rows[:, j], minlength=256) for j in range(itemsize)])[None]
    return estimate.entropy_of_count_array(counts)[0]


def test_plane_entropies_ahead_count_the_blocks_the_gpu_split_samples() -> None:
    g = np.random.default_rng(1)
    small = (g.standard_normal(ELEMENTS_PER_BLOCK * 40 + 100) * 0.02).astype(np.float32)  # blocks 0, 16, 32
    large = (g.standard_normal(ELEMENTS_PER_BLOCK * SAMPLE_EVERY * 40) * 0.02).astype(np.float16)
    datas = [torch.from_numpy(a).view(torch.uint8) for a in (small, large)]
    datas.append(torch.arange(100, dtype=torch.uint8))  # 1-byte elements: no planes
    datas.append(torch.from_numpy(small[:100]).view(torch.uint8))  # no whole block: nothing counted
    entropies = estimate.sampled_plane_entropies(datas, np.array([4, 2, 1, 4]))
    assert entropies.shape == (4, 8) and entropies.dtype == np.float32
    np.testing.assert_allclose(entropies[0, :4], _split_sample_entropies(small.view(np.uint8), 4, [0, 16, 32]),
                               rtol=1e-6)
    # 640 blocks, 40 of them sampled by the split: every third of those, SAMPLE_RUNS at most
    spread = list(range(0, 640, 3 * SAMPLE_EVERY))
    assert len(spread) <= estimate.SAMPLE_RUNS
    np.testing.assert_allclose(entropies[1, :2], _split_sample_entropies(large.view(np.uint8), 2, spread), rtol=1e-6)
    assert not entropies[0, 4:].any() and not entropies[1, 2:].any()
    assert not entropies[2].any() and not entropies[3].any()
