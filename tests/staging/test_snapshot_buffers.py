"""The pooled snapshot buffers (staging/buffers.py)."""

from __future__ import annotations

import logging

import pytest
import torch

from ckptzip.staging import SnapshotBuffers, buffers


def test_where_host_memory_cannot_be_registered_snapshot_buffers_are_pageable(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    def refused(nbytes: int, shared: bool = False) -> buffers.Slab:
        raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed with CUDA error 801")

    monkeypatch.setattr(buffers, "Slab", refused)
    with caplog.at_level(logging.WARNING, logger="ckptzip"):
        buffer = SnapshotBuffers().acquire((torch.device("cpu"), True), 1 << 20)
    assert buffer.numel() == 1 << 20 and buffer.device.type == "cpu"
    assert "snapshot buffers in pageable host memory (copies to them are slower): cudaHostRegister of 1048576 bytes" \
        in caplog.text
