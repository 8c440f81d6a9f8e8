"""Parts of a tensor checksummed with their words numbered from the tensor's start add up to the
tensor's own wsum64, modulo 2**64 (``first_words``): a load of a tensor in parts checks it
without a second pass over its bytes. Compiled, NumPy and (on a GPU) Triton kernels alike."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from ckptzip.checksum import MASK64, wsum64_array
from ckptzip.kernels import COMPILED, CPU_PIECE_BYTES, planes, segments
from ckptzip.kernels.planes import merge_planes, plane_layout, split_planes
from ckptzip.kernels.segments import segment_sums

# backends: the compiled kernels (where built), NumPy, Triton on a GPU
BACKENDS = [pytest.param("compiled", marks=pytest.mark.skipif(COMPILED is None, reason="not built here")),
            "numpy", pytest.param("cuda", marks=pytest.mark.gpu)]


def _device(backend: str) -> torch.device:
    if backend == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    return torch.device("cuda" if backend == "cuda" else "cpu")


def _cuts(nbytes: int) -> list[int]:
    """Part boundaries at whole words: small parts, one over a compiled row, an odd tail."""
    inner = [8, 4096, 4096 + 8 * 977, nbytes // 2 // 8 * 8]
    return sorted({0, *[c for c in inner if 0 < c < nbytes], nbytes})


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("itemsize", [2, 4, 8])
def test_merged_parts_add_up_to_the_tensor(backend: str, itemsize: int) -> None:
    device = _device(backend)
    rng = np.random.default_rng(itemsize)
    whole = torch.from_numpy(rng.integers(0, 256, (CPU_PIECE_BYTES + 4104) // itemsize * itemsize, dtype=np.uint8))
    expected = wsum64_array(whole.numpy())
    cuts = _cuts(whole.numel())
    datas = [whole[a:b].to(device) for a, b in itertools.pairwise(cuts)]
    starts, strides, total = plane_layout([d.numel() for d in datas], itemsize)
    buffer = torch.empty(total, dtype=torch.uint8, device=device)
    hist = torch.zeros(len(datas), 8 * 256, dtype=torch.int32, device=device)
    split_planes(datas, itemsize, buffer, starts, strides, hist, np.arange(len(datas)))
    offsets = starts[:, None] + strides[:, None] * np.arange(itemsize)[None, :]
    out = torch.zeros(whole.numel(), dtype=torch.uint8, device=device)
    outs = [out[a:b] for a, b in itertools.pairwise(cuts)]
    words = np.array(cuts[:-1], dtype=np.int64) // 8
    if backend == "numpy":
        sums = planes._merge_numpy(outs, itemsize, [buffer], np.zeros_like(offsets), offsets, words)
    else:
        sums = merge_planes(outs, itemsize, [buffer], np.zeros_like(offsets), offsets, words)
    assert torch.equal(out.cpu(), whole)
    assert sum(int(s) for s in sums.tolist()) & MASK64 == expected
    plain = merge_planes(outs, itemsize, [buffer], np.zeros_like(offsets), offsets)  # each from its own start
    assert [int(s) & MASK64 for s in plain.tolist()] == [wsum64_array(o.cpu().numpy()) for o in outs]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("gather", [False, True])
def test_segments_numbered_from_their_tensor_add_up_to_it(backend: str, gather: bool) -> None:
    device = _device(backend)
    rng = np.random.default_rng(3)
    whole = torch.from_numpy(rng.integers(0, 256, 2 * CPU_PIECE_BYTES + 13, dtype=np.uint8))
    cuts = _cuts(whole.numel())
    lengths = np.diff(cuts).astype(np.int64)
    source = torch.zeros(whole.numel() + 5, dtype=torch.uint8)
    source[5:] = whole  # the segments at unaligned addresses
    source = source.to(device)
    offsets = np.array(cuts[:-1], dtype=np.int64) + 5
    words = np.array(cuts[:-1], dtype=np.int64) // 8
    out = torch.zeros(whole.numel(), dtype=torch.uint8, device=device)
    gathered = dict(outs=[out], out_index=np.zeros(lengths.size, np.int64),
                    out_offsets=np.array(cuts[:-1], dtype=np.int64)) if gather else {}
    zeros = np.zeros(lengths.size, np.int64)
    if backend == "numpy":
        sums = segments._segment_sums_numpy([source], zeros, offsets, lengths, gathered.get("outs", ()),
                                            gathered.get("out_index"), gathered.get("out_offsets"), words)
    else:
        sums = segment_sums([source], zeros, offsets, lengths, first_words=words, **gathered)
    assert sum(int(s) for s in sums.tolist()) & MASK64 == wsum64_array(whole.numpy())
    if gather:
        assert torch.equal(out.cpu(), whole)
