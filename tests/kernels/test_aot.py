"""The GPU kernels shipped compiled (kernels/_aot.py, kernels/_build.py): the manifest is current
with the Triton sources and covers every variant the engine launches on every architecture it
names; the launch parameters are packed as the compiled entries declare them; on a GPU, the
shipped code computes what Triton's just-in-time code computes, bit for bit, and a fresh process
saves and restores without importing Triton or writing to its cache."""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch
import zstandard

from ckptzip.kernels import _aot, _build, ckzhuff, planes, segments

HAS_TRITON = importlib.util.find_spec("triton") is not None


def _shipped() -> dict:
    return json.loads((_aot.FOLDER / "manifest.json").read_text(encoding="utf-8"))


def test_the_shipped_kernels_are_built_from_the_current_sources() -> None:
    assert _shipped()["sources"] == _aot.sources_digest(), (
        "a Triton source of the kernels (_aot.SOURCES) changed since the shipped kernels were built: run `make kernels`")


def test_every_variant_the_engine_launches_is_shipped_for_every_architecture() -> None:
    shipped = _shipped()
    expected = {_aot.variant_key(kernel, constants) for _, kernel, _, constants, _ in _build.variants()}
    assert set(shipped["kernels"]) == expected
    for key, by_arch in shipped["kernels"].items():
        assert sorted(by_arch) == sorted(shipped["archs"]), key
        for entry in by_arch.values():
            image = zstandard.ZstdDecompressor().decompress((_aot.FOLDER / entry["file"]).read_bytes())
            assert image[:4] == b"\x7fELF", entry["file"]
            assert entry["params"] and set(entry["params"]) <= {"u64", "u32"}
            assert entry["warps"] >= 1 and entry["shared"] >= 0


def test_the_engine_launches_with_the_constants_the_variants_were_built_with() -> None:
    assert {c["E"] for _, k, _, c, _ in _build.variants() if k == "split_kernel"} == {planes.ELEMENTS_PER_BLOCK}
    assert {c["BLOCK"] for _, k, _, c, _ in _build.variants() if k == "gather_bytes_kernel"} == {segments.GATHER_BLOCK}
    assert _aot.variant_key("merge_kernel", {"K": 2, "E": 4096, "ITERS": 16}) == "merge_kernel[E=4096,ITERS=16,K=2]"


@pytest.mark.parametrize(("capability", "arch"), [
    ((8, 0), "sm80"), ((8, 6), "sm80"), ((8, 9), "sm80"), ((9, 0), "sm90"), ((10, 0), "sm100"),
    ((10, 3), "sm103"), ((12, 0), "sm120"), ((12, 1), "sm121"), ((7, 5), None), ((9, 1), None), ((11, 0), None),
])
def test_shipped_code_is_chosen_only_for_the_gpus_it_runs_on(capability: tuple[int, int], arch: str | None) -> None:
    assert _aot.arch_for(capability, _shipped()["archs"]) == arch


def test_parameters_are_packed_in_their_declared_widths_with_null_scratch_pointers() -> None:
    tensor = torch.arange(4, dtype=torch.int64)
    values = _aot.pack(["u64", "u32", "u64", "u64"], [tensor, 7])
    assert [type(v) for v in values] == [ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint64, ctypes.c_uint64]
    assert [v.value for v in values] == [tensor.data_ptr(), 7, 0, 0]
    with pytest.raises(ValueError, match="3 arguments for a kernel of 2 parameters"):
        _aot.pack(["u64", "u64"], [1, 2, 3])


def test_turned_off_or_stale_the_shipped_kernels_are_not_used(monkeypatch: pytest.MonkeyPatch) -> None:
    _aot.manifest.cache_clear()
    try:
        monkeypatch.setenv(_aot.ENV, "0")
        assert _aot.manifest() is None
        monkeypatch.delenv(_aot.ENV)
        _aot.manifest.cache_clear()
        assert _aot.manifest() is not None
        monkeypatch.setattr(_aot, "sources_digest", lambda: "another")
        _aot.manifest.cache_clear()
        assert _aot.manifest() is None
    finally:
        monkeypatch.undo()
        _aot.manifest.cache_clear()
        _aot._arch.cache_clear()
    assert not _aot.launch("merge_kernel", 1, torch.device("cpu"), [], {})  # nothing shipped runs on a CPU


def test_without_a_driver_library_the_launch_falls_back_to_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    # a GPU the manifest covers, in a process where libcuda.so.1 does not open
    monkeypatch.setattr(_aot, "covers", lambda device: True)
    monkeypatch.setattr(_aot, "_arch", lambda index: "sm90")
    monkeypatch.setattr(_aot, "_LAUNCHER", _aot._Launcher())
    monkeypatch.setattr(torch.cuda, "device", lambda index: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda index: types.SimpleNamespace(cuda_stream=0))

    def no_driver(name: str) -> object:
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(ctypes, "CDLL", no_driver)
    constants = {"BLOCK": segments.GATHER_BLOCK}
    for _ in range(2):  # the second time without trying again
        assert not _aot.launch("gather_bytes_kernel", 1, torch.device("cuda", 0), [0, 0, 1], constants)
    assert _aot._LAUNCHER._no_driver


@pytest.mark.skipif(not HAS_TRITON, reason="needs Triton's compiler")
def test_the_build_reproduces_a_shipped_entry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    module, kernel, types, constants, warps = next(v for v in _build.variants() if v[1] == "gather_bytes_kernel")
    image, entry = _build.compile_one(module, kernel, types, constants, 90, warps)
    shipped = _shipped()["kernels"][_aot.variant_key(kernel, constants)]["sm90"]
    assert image[:4] == b"\x7fELF"
    assert {k: entry[k] for k in ("entry", "params", "warps", "shared")} == {
        k: shipped[k] for k in ("entry", "params", "warps", "shared")}


def _gpu() -> torch.device:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    device = torch.device("cuda", torch.cuda.current_device())
    if not _aot.covers(device):
        pytest.skip("no shipped code for this GPU")
    return device


def _every_kernel(device: torch.device) -> list[torch.Tensor]:
    """Outputs of every shipped variant on odd-sized random data: planes, histograms, sums."""
    g = torch.Generator(device=device).manual_seed(3)
    results: list[torch.Tensor] = []
    for itemsize in (2, 4, 8):
        datas = [torch.randint(0, 256, (n * itemsize,), generator=g, device=device, dtype=torch.uint8)
                 for n in (1, 4097, 70_001, 300_000)]
        starts, strides, size = planes.plane_layout([d.numel() for d in datas], itemsize)
        buffer = torch.zeros(size, dtype=torch.uint8, device=device)
        hist = torch.zeros((len(datas), 8, 256), dtype=torch.int32, device=device)
        results += [planes.split_planes(datas, itemsize, buffer, starts, strides, hist, np.arange(len(datas))),
                    buffer, hist]
        outs = [torch.empty_like(d) for d in datas]
        offsets = starts[:, None] + strides[:, None] * np.arange(itemsize)[None, :]
        results.append(planes.merge_planes(outs, itemsize, [buffer], np.zeros_like(offsets), offsets))
        results += outs
    base = torch.randint(0, 256, (1 << 20,), generator=g, device=device, dtype=torch.uint8)
    offsets = np.array([0, 16, 5, 4096, 100_003], dtype=np.int64)
    lengths = np.array([4096, 65_536, 77, 160_000, 3], dtype=np.int64)
    index = np.zeros(5, dtype=np.int64)
    out = torch.zeros(int(lengths.sum()) + 64, dtype=torch.uint8, device=device)
    results.append(segments.segment_sums([base], index, offsets, lengths))
    results.append(segments.segment_sums([base], index, offsets, lengths, outs=[out], out_index=index,
                                         out_offsets=np.cumsum(lengths) - lengths))
    results += [out, segments.gather_bytes([base], np.zeros(3000, dtype=np.int64), np.arange(3000) * 7)]
    exponents = (torch.randn(300_001, generator=g, device=device) * 0.02).view(torch.int32) >> 23
    chunks = [exponents.to(torch.uint8), base[:5000], torch.zeros(700, dtype=torch.uint8, device=device)]
    coded = ckzhuff.CkzHuffCudaCodec().encode(chunks)
    results += [*coded, *ckzhuff.CkzHuffCudaCodec().decode(coded, [c.numel() for c in chunks])]
    return results


@pytest.mark.gpu
def test_the_shipped_code_computes_what_tritons_does(monkeypatch: pytest.MonkeyPatch) -> None:
    device = _gpu()
    launched: list[str] = []
    shipped_launch = _aot.launch

    def counting(kernel: str, *args: object) -> bool:
        ran = shipped_launch(kernel, *args)  # type: ignore[arg-type]
        launched.append(kernel) if ran else None
        return ran

    monkeypatch.setattr(_aot, "launch", counting)
    shipped = _every_kernel(device)
    assert set(launched) == {kernel for _, kernel, _, _, _ in _build.variants()}
    monkeypatch.setattr(_aot, "launch", lambda *args: False)
    jit = _every_kernel(device)
    for a, b in zip(shipped, jit, strict=True):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


_FRESH = r"""
import io, sys, torch, ckptzip
g = torch.Generator(device="cuda").manual_seed(0)
state = {"w": torch.randn(1 << 20, generator=g, device="cuda"), "h": torch.randn(3000, device="cuda").half(),
         "d": torch.randn(1 << 16, device="cuda", dtype=torch.float64), "step": torch.tensor(3)}
buffer = io.BytesIO()
ckptzip.save(state, buffer)
back = ckptzip.load(buffer.getvalue(), map_location="cuda")
assert all(torch.equal(state[k].cpu().reshape(-1).view(torch.uint8), back[k].cpu().reshape(-1).view(torch.uint8)) for k in state)
print("triton imported" if "triton" in sys.modules else "no triton")
"""


@pytest.mark.gpu
def test_a_fresh_process_saves_and_restores_without_triton(tmp_path: Path) -> None:
    _gpu()
    env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path / "triton"), CKPTZIP_CACHE_DIR=str(tmp_path / "ckptzip"))
    done = subprocess.run([sys.executable, "-c", _FRESH], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "no triton"
    assert not (tmp_path / "triton").exists() or not any((tmp_path / "triton").iterdir())
