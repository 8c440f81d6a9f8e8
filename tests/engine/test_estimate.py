"""Sample estimates (engine.estimate): middle samples, and byte counts per plane on both backends."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ckptzip.engine import estimate
from ckptzip.engine.estimate import middle


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
