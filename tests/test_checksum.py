"""The checksums of the format (ckptzip.checksum): wsum64 against a plain-Python reference, XXH3-64
against xxhash."""

from __future__ import annotations

import pytest
import torch
import xxhash
from helpers import random_tensor

from ckptzip import checksum
from ckptzip.checksum import format_wsum64, wsum64, wsum64_tensor, xxh3_hex


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
    data = random_tensor(torch.uint8, (n,), seed=n)
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
        data = random_tensor(torch.uint8, (n,), seed=n)
        assert wsum64(data) == wsum64_reference(data.numpy().tobytes())


@pytest.mark.parametrize("offset", range(8))
def test_wsum64_of_unaligned_views(offset: int) -> None:
    base = random_tensor(torch.uint8, (200,), seed=1)
    view = base[offset : offset + 150]
    assert wsum64(view) == wsum64_reference(view.numpy().tobytes())


def test_wsum64_detects_swaps_and_zero_words() -> None:
    data = random_tensor(torch.uint8, (64,), seed=2)
    swapped = torch.cat([data[8:16], data[:8], data[16:]])
    assert wsum64(swapped) != wsum64(data)  # position-weighted, unlike a plain sum
    padded = torch.cat([data, torch.zeros(8, dtype=torch.uint8)])
    assert wsum64(padded) == wsum64(data)  # trailing zero words add nothing; nbytes is checked separately


def test_wsum64_tensor_is_0d_int64() -> None:
    out = wsum64_tensor(random_tensor(torch.uint8, (77,)))
    assert out.dtype == torch.int64 and out.dim() == 0


def test_format_wsum64() -> None:
    assert format_wsum64(0) == "wsum64:0000000000000000"
    assert format_wsum64(2**64 - 1) == "wsum64:ffffffffffffffff"
    assert format_wsum64(-1) == "wsum64:ffffffffffffffff"


@pytest.mark.parametrize("n", [0, 1, 17, 4096])
def test_xxh3_hex_matches_xxhash(n: int) -> None:
    data = random_tensor(torch.uint8, (n,), seed=n)
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
