"""``dcp.async_save`` with ckptzip's writer as DCP's stager: what is staged is what was there when
``async_save`` returned, GPU tensors are coded on the GPU, and the files load as a synchronous
save's do."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import assert_same
from torch.distributed.checkpoint.staging import AsyncStager

import ckptzip
from ckptzip.dcp import CompressedStorageReader, CompressedStorageWriter


def _state(device: str) -> dict[str, object]:
    g = torch.Generator(device=device).manual_seed(5)
    w = torch.randn(512, 512, generator=g, device=device)
    return {
        "model": {"w": w, "b": torch.randn(512, generator=g, device=device).bfloat16(), "tied": w},
        "optim": {"step": torch.tensor(3.0), "exp_avg": torch.randn(512, 512, generator=g, device=device)},
        "extra": {"lr": 0.001, "name": "run-1"},
    }


def _target(state: dict[str, object]) -> dict[str, object]:
    def zeros(v: object) -> object:
        if isinstance(v, dict):
            return {k: zeros(x) for k, x in v.items()}
        return torch.zeros_like(v) if isinstance(v, torch.Tensor) else v
    return zeros(state)  # type: ignore[return-value]


def _snapshot(state: dict[str, object]) -> dict[str, object]:
    def copy(v: object) -> object:
        if isinstance(v, dict):
            return {k: copy(x) for k, x in v.items()}
        return v.clone() if isinstance(v, torch.Tensor) else v
    return copy(state)  # type: ignore[return-value]


def _mutate(state: dict[str, object]) -> None:
    for part in ("model", "optim"):
        for t in state[part].values():  # type: ignore[attr-defined]
            t.add_(1)


def _devices() -> list[object]:
    return ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA device")])]


def test_the_writer_is_dcps_stager() -> None:
    assert isinstance(CompressedStorageWriter("unused"), AsyncStager)


@pytest.mark.parametrize("device", _devices())
def test_async_save_stages_what_was_there_when_it_returned(device: str, tmp_path: Path) -> None:
    state = _state(device)
    before = _snapshot(state)
    future = dcp.async_save(state, storage_writer=CompressedStorageWriter(tmp_path / "a"), no_dist=True)
    _mutate(state)  # training goes on at once
    future.result()
    target = _target(before)
    dcp.load(target, storage_reader=CompressedStorageReader(tmp_path / "a"), no_dist=True)
    assert_same(target, before)
    # the same as a synchronous save of the same values
    dcp.save(before, storage_writer=CompressedStorageWriter(tmp_path / "s"), no_dist=True)
    again = _target(before)
    dcp.load(again, storage_reader=CompressedStorageReader(tmp_path / "s"), no_dist=True)
    assert_same(again, target)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_tensors_are_staged_coded_on_the_gpu(tmp_path: Path) -> None:
    state = _state("cuda")
    dcp.async_save(state, storage_writer=CompressedStorageWriter(tmp_path / "a"), no_dist=True).result()
    with ckptzip.open((tmp_path / "a" / "__0.ckzd").read_bytes()) as staged:
        codecs = {s.codec["id"] for e in staged.entries() for s in e.streams}
        assert "gdeflate" in codecs  # coded by nvCOMP, not by the host
        assert {e.name for e in staged.entries()} >= {"model.w", "optim.exp_avg"}
    assert (tmp_path / "a" / "__0_host.ckzd").exists()  # the host tensors, coded at write time
