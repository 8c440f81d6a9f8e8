"""The pooled snapshot buffers (staging/buffers.py)."""

from __future__ import annotations

import logging

import pytest
import torch

from ckptzip.staging import SnapshotBuffers, buffers


def test_where_host_memory_cannot_be_registered_snapshot_buffers_are_pageable(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    def refused(nbytes: int, shared: bool = False, **pieces: object) -> buffers.Slab:
        raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed with CUDA error 801")

    monkeypatch.setattr(buffers, "Slab", refused)
    with caplog.at_level(logging.WARNING, logger="ckptzip"):
        buffer = SnapshotBuffers().acquire((torch.device("cpu"), True), 1 << 20)
    assert buffer.numel() == 1 << 20 and buffer.device.type == "cpu"
    assert "snapshot buffers in pageable host memory (copies to them are slower): cudaHostRegister of 1048576 bytes" \
        in caplog.text


def test_a_pinned_buffers_registrations_are_whole_pieces_of_the_copies_as_they_are_when_it_is_made(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from ckptzip.memory import pinned
    from ckptzip.staging import copies

    registered: list[int] = []

    class Runtime:  # CUDA's runtime as far as a slab uses it: every registration succeeds
        def cudaHostRegister(self, address: int, nbytes: int, flags: int) -> int:
            registered.append(nbytes)
            return 0

        def cudaHostUnregister(self, address: int) -> int:
            return 0

    monkeypatch.setattr(pinned, "_cudart", Runtime)
    monkeypatch.setattr(pinned, "REGISTER_BYTES", 200 << 10)
    monkeypatch.setattr(copies, "TRICKLE_PIECE_BYTES", 48 << 10)
    SnapshotBuffers().acquire((torch.device("cpu"), True), 500 << 10)
    assert registered == [240 << 10, 240 << 10, 20 << 10]  # 200 KiB rounded up to 5 copies' pieces


@pytest.mark.gpu
def test_copies_to_a_pinned_buffer_registered_in_pieces_are_bit_exact_across_its_pieces(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from ckptzip.memory import pinned
    from ckptzip.staging import copies

    monkeypatch.setattr(pinned, "REGISTER_BYTES", 256 << 10)  # many pieces, and tensors across them
    monkeypatch.setattr(copies, "TRICKLE_PIECE_BYTES", 64 << 10)
    device = torch.device("cuda", 0)
    generator = torch.Generator(device=device).manual_seed(7)
    sources = [torch.randint(0, 256, (n,), dtype=torch.uint8, device=device, generator=generator).view(dtype)
               for n, dtype in ((300_004, torch.float32), (70_002, torch.bfloat16), (1_000_000, torch.uint8), (12, torch.int32))]
    pool = SnapshotBuffers()
    copied, held = pool.views(sources, dict.fromkeys(range(len(sources)), buffers.HOST_PINNED))
    (slab,) = pool._slabs.values()
    assert slab.piece_bytes == 256 << 10 and slab.nbytes > 4 * slab.piece_bytes
    for finish in pool.copy(sources, copied, "read-copy"):
        finish()[1].synchronize()
    for source, copy in zip(sources, copied):
        assert torch.equal(copy.view(torch.uint8), source.cpu().view(torch.uint8))
    pool.give_back(held)
