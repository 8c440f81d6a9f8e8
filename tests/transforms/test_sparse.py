"""The sparse transform (transforms.Sparse): bitmap and non-zero values, against NumPy references."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import random_tensor, sparse_residue

from ckptzip import CorruptCheckpointError
from ckptzip.transforms import Sparse, get_transform
from ckptzip.transforms import sparse as sparse_module
from ckptzip.transforms.sparse import pack_bits

DTYPES = [torch.uint8, torch.bfloat16, torch.float16, torch.float32, torch.float64]


def _nonzero(data: torch.Tensor, itemsize: int) -> np.ndarray:
    return (data.numpy().reshape(-1, itemsize) != 0).any(axis=1)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("elements", [0, 1, 7, 8, 9, 1001, 4099])
@pytest.mark.parametrize("density", [0.0, 0.001, 0.03, 0.5, 1.0])
def test_sparse_inverse_undoes_forward(dtype: torch.dtype, elements: int, density: float) -> None:
    data = sparse_residue(dtype, (elements,), density, seed=elements).view(torch.uint8)
    k = dtype.itemsize
    mask = _nonzero(data, k)
    transform = Sparse(k, int(mask.sum()))
    streams = transform.forward(data)
    assert [s.numel() for s in streams] == transform.stream_sizes(data.numel())
    assert streams[0].numpy().tobytes() == np.packbits(mask, bitorder="little").tobytes()
    values = data.numpy().reshape(-1, k)[mask]
    for j, plane in enumerate(streams[1:]):
        assert plane.numpy().tobytes() == values[:, j].tobytes()
    assert torch.equal(transform.inverse(streams, data.numel()), data)


def test_negative_zero_and_nan_bit_patterns_count_as_non_zero() -> None:
    data = torch.tensor([0.0, -0.0, float("nan"), 0.0], dtype=torch.bfloat16).view(torch.uint8)
    streams = Sparse(2, 2).forward(data)
    assert streams[0].tolist() == [0b0110]
    assert torch.equal(Sparse(2, 2).inverse(streams, data.numel()), data)


def test_a_view_at_an_odd_offset_is_coded_alike() -> None:
    base = sparse_residue(torch.float32, (1001,), 0.1, seed=4).view(torch.uint8)
    view = torch.cat([torch.zeros(1, dtype=torch.uint8), base])[1:]
    count = int(_nonzero(base, 4).sum())
    assert all(torch.equal(a, b) for a, b in zip(Sparse(4, count).forward(view), Sparse(4, count).forward(base)))


@pytest.mark.parametrize("itemsize", [0, 3, 16, "4", None, True])
def test_sparse_rejects_other_itemsizes(itemsize: object) -> None:
    with pytest.raises(ValueError, match=r"sparse itemsize must be one of \(1, 2, 4, 8\)"):
        Sparse(itemsize, 0)  # type: ignore[arg-type]


def test_get_transform_validates_sparse_options() -> None:
    transform = get_transform({"id": "sparse", "itemsize": 2, "count": 5})
    assert isinstance(transform, Sparse) and transform.get_config() == {"id": "sparse", "itemsize": 2, "count": 5}
    assert transform.stream_sizes(18) == [2, 5, 5]
    for bad in ({"itemsize": 2}, {"itemsize": 3, "count": 1}, {"itemsize": 2, "count": -1},
                {"itemsize": 2, "count": 1.0}, {"itemsize": 2, "count": True}, {"itemsize": 2, "count": 1, "x": 0}):
        with pytest.raises(CorruptCheckpointError, match="transform 'sparse' has bad options"):
            get_transform({"id": "sparse", **bad})
    with pytest.raises(CorruptCheckpointError, match="sparse: count 10 exceeds the 9 elements"):
        Sparse(2, 10).stream_sizes(18)
    with pytest.raises(CorruptCheckpointError, match="sparse: 9 bytes is not a multiple of itemsize 2"):
        Sparse(2, 1).stream_sizes(9)


def _streams(elements: int = 100) -> tuple[Sparse, list[torch.Tensor], torch.Tensor]:
    data = sparse_residue(torch.bfloat16, (elements,), 0.2, seed=1).view(torch.uint8)
    transform = Sparse(2, int(_nonzero(data, 2).sum()))
    return transform, transform.forward(data), data


def test_a_bitmap_that_marks_another_count_is_refused() -> None:
    transform, streams, data = _streams()
    first_zero = int(np.flatnonzero(~_nonzero(data, 2))[0])
    streams[0][first_zero // 8] |= 1 << (first_zero % 8)
    with pytest.raises(CorruptCheckpointError, match=rf"bitmap marks {transform.count + 1} non-zero elements, "
                                                     rf"the index {transform.count}"):
        transform.inverse(streams, data.numel())


def test_a_bitmap_with_bits_past_its_elements_is_refused() -> None:
    transform, streams, data = _streams(elements=100)  # 4 bits of the last byte are past the end
    streams[0][-1] |= 0x80
    with pytest.raises(CorruptCheckpointError, match="bitmap has bits set past its 100 elements"):
        transform.inverse(streams, data.numel())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_sparse_on_gpu_equals_cpu(dtype: torch.dtype) -> None:
    data = sparse_residue(dtype, (50001,), 0.03, seed=2).view(torch.uint8)
    transform = Sparse(dtype.itemsize, int(_nonzero(data, dtype.itemsize).sum()))
    cpu = transform.forward(data)
    gpu = transform.forward(data.cuda())
    assert all(torch.equal(g.cpu(), c) for g, c in zip(gpu, cpu))
    assert torch.equal(transform.inverse(gpu, data.numel()).cpu(), data)


def test_random_bits_are_all_non_zero_elements() -> None:
    data = random_tensor(torch.int64, (64,), seed=9).view(torch.uint8)
    transform = Sparse(8, int(_nonzero(data, 8).sum()))
    assert torch.equal(transform.inverse(transform.forward(data), data.numel()), data)


@pytest.mark.parametrize("offset", [0, 3], ids=["aligned", "unaligned-view"])
@pytest.mark.parametrize("tail", [0, 5])
def test_pack_bits_gathers_every_byte_pattern_as_numpy_does(offset: int, tail: int) -> None:
    patterns = np.unpackbits(np.arange(256, dtype=np.uint8), bitorder="little").astype(bool)  # every 8-bit pattern
    mask = torch.from_numpy(np.r_[np.zeros(offset, bool), patterns, np.ones(tail, bool)])[offset:]
    assert pack_bits(mask).numpy().tobytes() == np.packbits(mask.numpy(), bitorder="little").tobytes()


@pytest.mark.parametrize("group_bytes", [64 << 20, 3000], ids=["one-group", "many-groups"])
def test_forward_many_gives_each_tensor_the_streams_forward_gives_it(monkeypatch: pytest.MonkeyPatch,
                                                                     group_bytes: int) -> None:
    monkeypatch.setattr(sparse_module, "GROUP_BYTES", group_bytes)
    monkeypatch.setattr(sparse_module, "GROUPED_DEVICES", frozenset({"cpu", "cuda"}))
    datas, transforms = [], []
    for n, (dtype, elements, density) in enumerate([(torch.bfloat16, 1024, 0.02), (torch.float32, 999, 0.1),
                                                     (torch.bfloat16, 4096, 0.0), (torch.float32, 2048, 0.5),
                                                     (torch.uint8, 800, 0.3), (torch.bfloat16, 16, 1.0),
                                                     (torch.float64, 512, 0.01), (torch.bfloat16, 0, 0.0)]):
        data = sparse_residue(dtype, (elements,), density, seed=n).view(torch.uint8)
        if n == 3:  # a view that does not start on an element of its storage's word
            data = torch.cat([torch.zeros(2, dtype=torch.uint8), data])[2:]
        datas.append(data)
        transforms.append(Sparse(dtype.itemsize, int(_nonzero(data, dtype.itemsize).sum())))
    together = sparse_module.forward_many(transforms, datas)
    for t, d, streams in zip(transforms, datas, together, strict=True):
        alone = t.forward(d)
        assert [s.numpy().tobytes() for s in streams] == [s.numpy().tobytes() for s in alone]
