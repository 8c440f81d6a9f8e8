"""Byte planes and the checksums of the format, against plain-Python references."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import xxhash
from helpers import random_tensor

from ckptzip import CorruptCheckpointError, UnsupportedFormatError, checksum
from ckptzip.checksum import format_wsum64, wsum64, wsum64_tensor, xxh3_hex
from ckptzip.transforms import BytePlanes, get_transform

LENGTHS = [0, 1, 2, 3, 7, 8, 9, 100, 1023, 4097]


def _bytes(n: int, seed: int = 0) -> torch.Tensor:
    return torch.from_numpy(np.frombuffer(np.random.default_rng(seed).bytes(n), dtype=np.uint8).copy())


@pytest.mark.parametrize("itemsize", [2, 4, 8])
@pytest.mark.parametrize("elements", LENGTHS)
def test_byteplanes_inverse_undoes_forward(itemsize: int, elements: int) -> None:
    data = _bytes(elements * itemsize, seed=elements)
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
    base = _bytes(4 * 1000, seed=3)
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
    with pytest.raises(UnsupportedFormatError, match=r"unknown transform 'delta'; this ckptzip knows \['byteplanes'\]"):
        get_transform({"id": "delta"})
    with pytest.raises(CorruptCheckpointError, match="transform 'byteplanes' has bad options"):
        get_transform({"id": "byteplanes", "itemsize": 8, "order": "big"})
    with pytest.raises(CorruptCheckpointError, match="transform 'byteplanes' has bad options"):
        get_transform({"id": "byteplanes"})
    for bad in ("byteplanes", None, {"itemsize": 2}, {"id": 5}):
        with pytest.raises(CorruptCheckpointError, match="has no string 'id'"):
            get_transform(bad)


# --- wsum64 ---------------------------------------------------------------------------------


def wsum64_reference(data: bytes) -> int:
    """FORMAT.md: sum mod 2**64 of w_i * (2i + 1) over little-endian u64 words, tail zero-padded
    (plain integers here, independent of the NumPy reference in helpers)."""
    padded = data + b"\0" * (-len(data) % 8)
    total = 0
    for i in range(len(padded) // 8):
        total += int.from_bytes(padded[8 * i : 8 * i + 8], "little") * (2 * i + 1)
    return total % 2**64


@pytest.mark.parametrize("n", [*range(25), 1000, 1001, 4093, 65_536 + 5])
def test_wsum64_matches_the_reference(n: int) -> None:
    data = _bytes(n, seed=n)
    assert wsum64(data) == wsum64_reference(data.numpy().tobytes())


def test_wsum64_wraps_modulo_2_64() -> None:
    data = torch.full((8 * 300,), 0xFF, dtype=torch.uint8)  # every word is 2**64 - 1
    assert wsum64(data) == wsum64_reference(data.numpy().tobytes()) == 2**64 - 300**2  # unsigned, wrapped
    tail = torch.cat([data, torch.full((3,), 0xFF, dtype=torch.uint8)])
    assert wsum64(tail) == wsum64_reference(tail.numpy().tobytes())


def test_wsum64_across_block_boundaries(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(checksum, "_BLOCK_WORDS", 3)
    monkeypatch.setattr(checksum, "_BLOCK_WEIGHTS", checksum.np.arange(1, 6, 2, dtype=checksum.np.uint64))
    monkeypatch.setattr(checksum, "_TORCH_BLOCK_WORDS", 3)
    for n in (23, 24, 25, 80, 8 * 7 + 1):
        data = _bytes(n, seed=n)
        assert wsum64(data) == wsum64_reference(data.numpy().tobytes())


@pytest.mark.parametrize("offset", range(8))
def test_wsum64_of_unaligned_views(offset: int) -> None:
    base = _bytes(200, seed=1)
    view = base[offset : offset + 150]
    assert wsum64(view) == wsum64_reference(view.numpy().tobytes())


def test_wsum64_detects_swaps_and_zero_words() -> None:
    data = _bytes(64, seed=2)
    swapped = torch.cat([data[8:16], data[:8], data[16:]])
    assert wsum64(swapped) != wsum64(data)  # position-weighted, unlike a plain sum
    padded = torch.cat([data, torch.zeros(8, dtype=torch.uint8)])
    assert wsum64(padded) == wsum64(data)  # trailing zero words add nothing; nbytes is checked separately


def test_wsum64_tensor_is_0d_int64() -> None:
    out = wsum64_tensor(_bytes(77))
    assert out.dtype == torch.int64 and out.dim() == 0


def test_format_wsum64() -> None:
    assert format_wsum64(0) == "wsum64:0000000000000000"
    assert format_wsum64(2**64 - 1) == "wsum64:ffffffffffffffff"
    assert format_wsum64(-1) == "wsum64:ffffffffffffffff"


@pytest.mark.parametrize("n", [0, 1, 17, 4096])
def test_xxh3_hex_matches_xxhash(n: int) -> None:
    data = _bytes(n, seed=n)
    expected = f"{xxhash.xxh3_64_intdigest(data.numpy().tobytes()):016x}"
    assert xxh3_hex(data) == xxh3_hex(data.numpy().tobytes()) == xxh3_hex(data.numpy().data) == expected
    assert len(expected) == 16


@pytest.mark.gpu
@pytest.mark.parametrize("n", [0, 5, 8 * 1000 + 3, (1 << 20) + 7])
def test_wsum64_on_gpu_equals_cpu(n: int) -> None:
    data = random_tensor(torch.uint8, (n,), seed=n)
    assert wsum64(data.cuda()) == wsum64(data)
    offset = data.cuda()[3:]  # unaligned device view
    assert wsum64(offset) == wsum64(data[3:])


@pytest.mark.gpu
@pytest.mark.parametrize("itemsize", [2, 4, 8])
def test_byteplanes_on_gpu_equal_cpu(itemsize: int) -> None:
    data = random_tensor(torch.uint8, (itemsize * 5000,), seed=itemsize)
    cpu = BytePlanes(itemsize).forward(data)
    gpu = BytePlanes(itemsize).forward(data.cuda())
    assert all(torch.equal(g.cpu(), c) for g, c in zip(gpu, cpu))
    assert torch.equal(BytePlanes(itemsize).inverse(gpu, data.numel()).cpu(), data)
