"""ckptzip.memory.pages: host outputs faulted in ahead of the writes, contents untouched."""

from __future__ import annotations

import io
import sys

import pytest
import torch

import ckptzip
from ckptzip.memory import pages


def test_populate_leaves_contents_and_views_as_they_were() -> None:
    data = torch.randint(0, 256, (3 << 20,), dtype=torch.uint8)
    fresh = torch.empty(5 << 20, dtype=torch.uint8)  # never written: its pages are faulted in
    before = data.clone()
    pages.populate([data, data[4097:], fresh, torch.empty(10, dtype=torch.uint8)])
    assert torch.equal(data, before)
    fresh.fill_(7)
    assert int(fresh.sum()) == 7 * (5 << 20)


def test_populate_skips_small_and_non_host_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[int, int, int]] = []
    monkeypatch.setattr(pages, "_madvise", lambda: lambda *args: calls.append(args) or 0)
    big = torch.empty(2 << 20, dtype=torch.uint8)
    pages.populate([torch.empty(pages.MIN_BYTES - 1, dtype=torch.uint8), big, torch.empty(0, dtype=torch.uint8)])
    assert len(calls) == 1
    start, length, advice = calls[0]
    assert advice == pages.MADV_POPULATE_WRITE and start % pages._PAGE == 0 and length % pages._PAGE == 0
    assert big.data_ptr() <= start and start + length <= big.data_ptr() + big.numel()


def test_populate_does_nothing_where_the_platform_has_no_such_advice(monkeypatch: pytest.MonkeyPatch) -> None:
    pages._madvise.cache_clear()
    monkeypatch.setattr(sys, "platform", "darwin")
    try:
        assert pages._madvise() is None
        pages.populate([torch.empty(4 << 20, dtype=torch.uint8)])
    finally:
        pages._madvise.cache_clear()


def test_a_cpu_load_fills_populated_outputs_bit_exactly() -> None:
    g = torch.Generator().manual_seed(5)
    state = {"w": torch.randn(1 << 20, generator=g), "g": torch.randn(3 << 18, generator=g).bfloat16()}
    buf = io.BytesIO()
    ckptzip.save(state, buf)
    back = ckptzip.load(buf.getvalue())
    assert all(torch.equal(back[k].view(torch.uint8), v.view(torch.uint8)) for k, v in state.items())
