"""ckptzip.memory.pages: host outputs faulted in ahead of the writes (in huge pages where the kernel
gives them on request), contents untouched."""

from __future__ import annotations

import io
import sys
from pathlib import Path

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
    monkeypatch.setattr(pages, "libc_madvise", lambda: lambda *args: calls.append(args) or 0)
    big = torch.empty(2 << 20, dtype=torch.uint8)
    pages.populate([torch.empty(pages.MIN_BYTES - 1, dtype=torch.uint8), big, torch.empty(0, dtype=torch.uint8)])
    assert len(calls) == 1
    start, length, advice = calls[0]
    assert advice == pages.MADV_POPULATE_WRITE and start % pages._PAGE == 0 and length % pages._PAGE == 0
    assert big.data_ptr() <= start and start + length <= big.data_ptr() + big.numel()


def test_populate_does_nothing_where_the_platform_has_no_such_advice(monkeypatch: pytest.MonkeyPatch) -> None:
    pages.libc_madvise.cache_clear()
    monkeypatch.setattr(sys, "platform", "darwin")
    try:
        assert pages.libc_madvise() is None
        pages.populate([torch.empty(4 << 20, dtype=torch.uint8)])
    finally:
        pages.libc_madvise.cache_clear()


def test_a_cpu_load_fills_populated_outputs_bit_exactly() -> None:
    g = torch.Generator().manual_seed(5)
    state = {"w": torch.randn(1 << 20, generator=g), "g": torch.randn(3 << 18, generator=g).bfloat16()}
    buf = io.BytesIO()
    ckptzip.save(state, buf)
    back = ckptzip.load(buf.getvalue())
    assert all(torch.equal(back[k].view(torch.uint8), v.view(torch.uint8)) for k, v in state.items())


def _recording(monkeypatch: pytest.MonkeyPatch, mode: str = "always [madvise] never") -> list[tuple[int, int, int]]:
    """Record the madvise calls, with transparent huge pages in ``mode``."""
    calls: list[tuple[int, int, int]] = []
    monkeypatch.setattr(pages, "libc_madvise", lambda: lambda *args: calls.append(args) or 0)
    monkeypatch.setattr(pages, "_huge_pages_on_request", lambda: "[madvise]" in mode)
    return calls


def test_huge_pages_are_asked_for_over_each_large_host_tensors_whole_pages(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _recording(monkeypatch)
    big = torch.empty(3 << 20, dtype=torch.uint8)
    pages.prefer_huge_pages([big, torch.empty(pages.MIN_BYTES - 1, dtype=torch.uint8)])
    assert len(calls) == 1
    start, length, advice = calls[0]
    assert advice == pages.MADV_HUGEPAGE and start % pages._PAGE == 0 and length % pages._PAGE == 0
    # every page the tensor touches, so advised neighbours stay one mapping
    assert start <= big.data_ptr() < start + pages._PAGE
    assert big.data_ptr() + big.numel() <= start + length < big.data_ptr() + big.numel() + pages._PAGE


@pytest.mark.parametrize("mode", ["[always] madvise never", "always madvise [never]"])
def test_no_huge_page_advice_unless_the_kernel_gives_them_on_request(monkeypatch: pytest.MonkeyPatch,
                                                                     mode: str) -> None:
    calls = _recording(monkeypatch, mode)
    pages.prefer_huge_pages([torch.empty(4 << 20, dtype=torch.uint8)])
    assert calls == []


def test_the_kernels_mode_is_read_from_sysfs(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    mode = tmp_path / "enabled"
    monkeypatch.setattr(pages, "THP_MODE", str(mode))
    for text, expected in (("always [madvise] never\n", True), ("[always] madvise never\n", False), (None, False)):
        if text is not None:
            mode.write_text(text)
        else:
            mode.unlink()
        pages._huge_pages_on_request.cache_clear()
        try:
            assert pages._huge_pages_on_request() is expected
        finally:
            pages._huge_pages_on_request.cache_clear()


def test_no_huge_page_advice_near_the_processs_mapping_limit(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    calls = _recording(monkeypatch)
    maps, limit = tmp_path / "maps", tmp_path / "max_map_count"
    maps.write_bytes(b"mapping\n" * 100)
    monkeypatch.setattr(pages, "MAPS", str(maps))
    monkeypatch.setattr(pages, "MAX_MAP_COUNT", str(limit))
    tensors = [torch.empty(2 << 20, dtype=torch.uint8) for _ in range(3)]
    limit.write_text("205\n")  # 100 mappings and 2 per tensor would pass half of it
    pages.prefer_huge_pages(tensors)
    assert calls == []
    limit.write_text("212\n")
    pages.prefer_huge_pages(tensors)
    assert len(calls) == 3
    limit.unlink()  # unknown: no advice
    pages.prefer_huge_pages(tensors)
    assert len(calls) == 3


def test_fresh_buffers_of_their_own_mapping_are_advised_not_faulted_in(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _recording(monkeypatch)
    monkeypatch.setattr(pages, "_room_for_mappings", lambda extra: True)
    small = pages.fresh(pages.OWN_MAPPING_BYTES - 1)
    assert calls == [] and small.numel() == pages.OWN_MAPPING_BYTES - 1 and small.dtype == torch.uint8
    big = pages.fresh(pages.OWN_MAPPING_BYTES)  # faulted in by its writes: a decoder may stop early
    assert [advice for _, _, advice in calls] == [pages.MADV_HUGEPAGE]
    assert big.numel() == pages.OWN_MAPPING_BYTES and not big.is_cuda


def test_huge_page_advice_leaves_contents_as_they_were() -> None:
    data = torch.randint(0, 256, (5 << 20,), dtype=torch.uint8)
    before = data.clone()
    pages.prefer_huge_pages([data, data[4097:]])
    pages.populate([data])
    assert torch.equal(data, before)
    fresh = pages.fresh(pages.OWN_MAPPING_BYTES)
    fresh.fill_(3)
    assert int(fresh[:: 1 << 16].sum()) == 3 * (pages.OWN_MAPPING_BYTES >> 16)
