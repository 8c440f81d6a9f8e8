"""Byte planes (transforms.BytePlanes), against plain-Python references."""

from __future__ import annotations

import pytest
import torch
from helpers import random_tensor

from ckptzip import CorruptCheckpointError, UnsupportedFormatError
from ckptzip.transforms import BytePlanes, get_transform

LENGTHS = [0, 1, 2, 3, 7, 8, 9, 100, 1023, 4097]


@pytest.mark.parametrize("itemsize", [2, 4, 8])
@pytest.mark.parametrize("elements", LENGTHS)
def test_byteplanes_inverse_undoes_forward(itemsize: int, elements: int) -> None:
    data = random_tensor(torch.uint8, (elements * itemsize,), seed=elements)
    transform = BytePlanes(itemsize)
    streams = transform.forward(data)
    assert transform.stream_sizes(data.numel()) == [elements] * itemsize
    assert [s.numel() for s in streams] == [elements] * itemsize
    assert all(s.dtype == torch.uint8 and s.dim() == 1 for s in streams)
    for j, stream in enumerate(streams):  # stream j holds byte j of every element
        assert stream.tolist() == data.tolist()[j::itemsize]
    back = transform.inverse(streams, data.numel())
    assert back.is_contiguous() and torch.equal(back, data)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64], ids=str)
def test_the_last_plane_of_a_float_holds_sign_and_exponent(dtype: torch.dtype) -> None:
    values = torch.tensor([1.0, -1.0, 2.0, -0.0], dtype=dtype)
    planes = BytePlanes(dtype.itemsize).forward(values.view(torch.uint8))
    top = planes[-1].tolist()
    assert top[0] & 0x80 == 0 and top[1] & 0x80 and top[3] == 0x80  # sign bits
    assert top[0] != top[2]  # 1.0 and 2.0 differ in the exponent


def test_byteplanes_forward_of_a_view_is_correct() -> None:
    base = random_tensor(torch.uint8, (4 * 1000,), seed=3)
    view = base[40:4040]  # offset into a larger buffer, as the pipeline's chunks are
    assert torch.equal(BytePlanes(4).inverse(BytePlanes(4).forward(view), 4000), view)


@pytest.mark.parametrize("itemsize", [0, 1, 3, 16, "4", None])
def test_byteplanes_rejects_other_itemsizes(itemsize: object) -> None:
    with pytest.raises(ValueError, match=r"byteplanes itemsize must be one of \(2, 4, 8\)"):
        BytePlanes(itemsize)  # type: ignore[arg-type]


def test_stream_sizes_need_whole_elements() -> None:
    with pytest.raises(CorruptCheckpointError, match="byteplanes: 10 bytes is not a multiple of itemsize 4"):
        BytePlanes(4).stream_sizes(10)


def test_get_transform_builds_and_validates() -> None:
    transform = get_transform({"id": "byteplanes", "itemsize": 8})
    assert isinstance(transform, BytePlanes) and transform.get_config() == {"id": "byteplanes", "itemsize": 8}
    with pytest.raises(UnsupportedFormatError, match=r"unknown transform 'delta'; this ckptzip knows \['byteplanes', 'sparse'\]"):
        get_transform({"id": "delta"})
    with pytest.raises(CorruptCheckpointError, match="transform 'byteplanes' has bad options"):
        get_transform({"id": "byteplanes", "itemsize": 8, "order": "big"})
    with pytest.raises(CorruptCheckpointError, match="transform 'byteplanes' has bad options"):
        get_transform({"id": "byteplanes"})
    for bad in ("byteplanes", None, {"itemsize": 2}, {"id": 5}):
        with pytest.raises(CorruptCheckpointError, match="has no string 'id'"):
            get_transform(bad)


@pytest.mark.gpu
@pytest.mark.parametrize("itemsize", [2, 4, 8])
def test_byteplanes_on_gpu_equal_cpu(itemsize: int) -> None:
    data = random_tensor(torch.uint8, (itemsize * 5000,), seed=itemsize)
    cpu = BytePlanes(itemsize).forward(data)
    gpu = BytePlanes(itemsize).forward(data.cuda())
    assert all(torch.equal(g.cpu(), c) for g, c in zip(gpu, cpu))
    assert torch.equal(BytePlanes(itemsize).inverse(gpu, data.numel()).cpu(), data)
