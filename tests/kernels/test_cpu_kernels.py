"""The compiled CPU kernels (src/ckptzip/kernels/_cpu.c) against the NumPy reference, bit for bit:
byte-plane split (planes, sampled counts, checksums) and merge, and checksummed segment gathers,
for item sizes 2, 4 and 8, odd lengths, unaligned addresses, rows split between threads; the
NumPy fallback where no compiled build exists (or ``CKPTZIP_NUMPY_KERNELS=1``); and the CPU load
around them (read-only sources, many small tensors, batches split by bytes)."""

from __future__ import annotations

import io
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import ckptzip
from ckptzip.checksum import wsum64_array
from ckptzip.codecs import codec_threads
from ckptzip.engine import plan as engine_plan
from ckptzip.errors import CorruptCheckpointError
from ckptzip.kernels import COMPILED, CPU_PIECE_BYTES
from ckptzip.kernels import planes, segments
from ckptzip.kernels.planes import merge_planes, plane_layout, split_planes
from ckptzip.kernels.segments import segment_sums

needs_compiled = pytest.mark.skipif(COMPILED is None, reason="compiled kernels not built here (pip install -e . builds "
                                    "them) or CKPTZIP_NUMPY_KERNELS=1")
MASK = (1 << 64) - 1
# element counts: empty, one, odd, around a NumPy block, and several compiled rows (threads split them)
COUNTS = (0, 1, 7, 4095, 4097, 65_537, 3 * CPU_PIECE_BYTES // 2 + 3)


def _bytes(rng: np.random.Generator, n: int, skew: int) -> torch.Tensor:
    """``n`` random bytes that start ``skew`` bytes into a fresh buffer (an unaligned address)."""
    return torch.from_numpy(rng.integers(0, 256, n + skew, dtype=np.uint8))[skew:]


def _sums(values: torch.Tensor) -> list[int]:
    return [int(v) & MASK for v in values]


@needs_compiled
@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("itemsize", [2, 4, 8])
def test_compiled_split_and_merge_match_numpy(itemsize: int, threads: int) -> None:
    rng = np.random.default_rng(itemsize * 10 + threads)
    datas = [_bytes(rng, n * itemsize, skew) for skew, n in enumerate(COUNTS)]
    starts, strides, total = plane_layout([d.numel() for d in datas], itemsize)
    rows = np.arange(len(datas))[::-1].copy()  # histogram rows in another order than the tensors
    results = []
    for kernel in (planes._split_numpy, split_planes):
        buffer = torch.from_numpy(rng.integers(0, 256, total + 3, dtype=np.uint8))[3:]  # unaligned, not zeroed
        hist = torch.zeros(len(datas), 8 * 256, dtype=torch.int32)
        with codec_threads(threads):
            sums = kernel(datas, itemsize, buffer, starts, strides, hist, rows)
        results.append((buffer, hist, _sums(sums)))
    (ref_planes, ref_hist, ref_sums), (got_planes, got_hist, got_sums) = results
    for t, n in enumerate(COUNTS):  # plane bytes (the gaps between planes are not written)
        for j in range(itemsize):
            at = int(starts[t] + j * strides[t])
            assert torch.equal(got_planes[at : at + n], ref_planes[at : at + n])
    assert torch.equal(got_hist, ref_hist)
    assert got_sums == ref_sums == [wsum64_array(d.numpy()) for d in datas]

    # merge: planes scattered over two buffers, at odd offsets, into aligned outputs (whose stores
    # stream past the cache) and unaligned ones
    second = torch.from_numpy(rng.integers(0, 256, total + 11, dtype=np.uint8))
    second[5 : 5 + total] = got_planes
    offsets = starts[:, None] + strides[:, None] * np.arange(itemsize)[None, :]
    base = np.arange(offsets.size).reshape(offsets.shape) % 2
    offsets = np.where(base == 1, offsets + 5, offsets)
    merged = []
    for kernel in (planes._merge_numpy, merge_planes):
        outs = [torch.zeros(d.numel() + t % 2, dtype=torch.uint8)[t % 2 :] for t, d in enumerate(datas)]
        with codec_threads(threads):
            sums = kernel(outs, itemsize, [got_planes, second], base, offsets)
        merged.append((outs, _sums(sums)))
    (ref_outs, ref_merged), (got_outs, got_merged) = merged
    assert all(torch.equal(a, b) for a, b in zip(got_outs, datas))
    assert all(torch.equal(a, b) for a, b in zip(ref_outs, datas))
    assert got_merged == ref_merged == got_sums


@needs_compiled
@pytest.mark.parametrize("threads", [1, 4])
@pytest.mark.parametrize("gather", [False, True])
def test_compiled_segment_sums_match_numpy(gather: bool, threads: int) -> None:
    rng = np.random.default_rng(7 + threads)
    bases = [_bytes(rng, n, skew) for skew, n in ((1, 5_000_003), (0, 4097), (6, 1))]
    which = np.array([0, 0, 1, 0, 2, 1, 0], dtype=np.int64)
    offsets = np.array([0, 3, 1, 17, 0, 4096, 999_999], dtype=np.int64)
    lengths = np.array([5_000_003, 4_000_001, 4096, 0, 1, 1, 2 * CPU_PIECE_BYTES + 9], dtype=np.int64)
    out_offsets = np.cumsum(lengths) - lengths + 3
    results = []
    for kernel in (segments._segment_sums_numpy, None):
        outs = [torch.zeros(int(lengths.sum()) + 3, dtype=torch.uint8)] if gather else []
        args = (outs, np.zeros(lengths.size, np.int64), out_offsets) if gather else ((), None, None)
        with codec_threads(threads):
            if kernel is None:
                sums = segment_sums(bases, which, offsets, lengths, outs=args[0], out_index=args[1], out_offsets=args[2])
            else:
                sums = kernel(bases, which, offsets, lengths, *args)
        results.append((outs, _sums(sums)))
    (ref_outs, ref), (got_outs, got) = results
    expected = [bases[b].numpy()[o : o + n] for b, o, n in zip(which, offsets, lengths)]
    assert got == ref == [wsum64_array(e) for e in expected]
    if gather:
        assert torch.equal(got_outs[0], ref_outs[0])
        assert np.array_equal(got_outs[0].numpy()[3:], np.concatenate(expected))


@needs_compiled
def test_compiled_kernels_refuse_segments_and_planes_past_their_buffers() -> None:
    buf = torch.zeros(100, dtype=torch.uint8)
    with pytest.raises(CorruptCheckpointError, match="reaches past"):
        segment_sums([buf], np.zeros(1, np.int64), np.array([90]), np.array([11]))
    with pytest.raises(CorruptCheckpointError, match="reaches past"):
        segment_sums([buf], np.zeros(1, np.int64), np.array([0]), np.array([10]), outs=[torch.zeros(10, dtype=torch.uint8)],
                     out_index=np.zeros(1, np.int64), out_offsets=np.array([1]))
    with pytest.raises(CorruptCheckpointError, match="reaches past"):
        merge_planes([torch.zeros(200, dtype=torch.uint8)], 2, [buf], np.zeros((1, 2), np.int64), np.array([[0, 1]]))


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {"w": torch.randn(300_001, generator=g), "h": torch.randn(70_001, generator=g).half(),
            "d": torch.randn(9_999, generator=g, dtype=torch.float64), "i": torch.arange(5_001),
            "b": torch.randint(0, 255, (4_097,), generator=g, dtype=torch.uint8)}


@needs_compiled
def test_numpy_fallback_writes_and_reads_the_same_files(monkeypatch: pytest.MonkeyPatch) -> None:
    state = _state()
    compiled = io.BytesIO()
    ckptzip.save(state, compiled)
    monkeypatch.setattr(planes, "COMPILED", None)
    monkeypatch.setattr(segments, "COMPILED", None)
    fallback = io.BytesIO()
    ckptzip.save(state, fallback)
    assert fallback.getvalue() == compiled.getvalue()
    loaded = ckptzip.load(compiled.getvalue())
    assert all(torch.equal(loaded[k].view(torch.uint8), v.view(torch.uint8)) for k, v in state.items())


def test_environment_variable_forces_the_numpy_kernels() -> None:
    code = (
        "import io, torch, ckptzip, ckptzip.kernels as k; assert k.COMPILED is None; "
        "t = {'w': torch.randn(100_001)}; b = io.BytesIO(); ckptzip.save(t, b); "
        "assert torch.equal(ckptzip.load(b.getvalue())['w'], t['w'])"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "CKPTZIP_NUMPY_KERNELS": "1"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


def test_many_small_odd_and_empty_tensors_load_bit_exactly_from_read_only_bytes() -> None:
    g = torch.Generator().manual_seed(5)
    state = {f"t{i}": torch.randn(i % 37, generator=g).to([torch.float32, torch.float16, torch.float64][i % 3])
             for i in range(600)}
    state["wide"] = torch.randn(2 * CPU_PIECE_BYTES + 5, generator=g)
    blob = io.BytesIO()
    ckptzip.save(state, blob)
    data = blob.getvalue()
    before = bytes(data)
    loaded = ckptzip.load(memoryview(data))  # read-only memory: decoded where it lies, never written
    assert data == before
    assert all(torch.equal(loaded[k].view(torch.uint8), v.view(torch.uint8)) for k, v in state.items())


@pytest.mark.parametrize("workers", [1, 2, 16])
def test_cpu_batches_split_a_load_evenly_between_workers(workers: int) -> None:
    for total in (0, 1 << 19, 20_200_000, 201_326_592, 5 << 30):
        size = engine_plan.cpu_batch_bytes(total, workers)
        assert engine_plan.MIN_CPU_BATCH_BYTES <= size <= engine_plan.LOAD_BATCH_BYTES["cpu"]
        assert size == engine_plan.MIN_CPU_BATCH_BYTES or -(-total // size) % workers == 0  # equal shares


@pytest.mark.parametrize("missing", [("ckptzip.kernels._cpu",), ("ckptzip.kernels._cpu", "ckptzip.codecs._gdeflate")])
def test_a_failed_c_build_is_said_once_when_the_numpy_kernels_stand_in(missing: tuple[str, ...]) -> None:
    """Issue #44: pip hides a failed optional build, and ckptzip ran several times slower
    without a word."""
    code = (
        "import importlib.abc, sys, warnings\n"
        "class Missing(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        f"        if name in {missing!r}: raise ImportError(name)\n"
        "sys.meta_path.insert(0, Missing())\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    import io, torch, ckptzip\n"
        "    b = io.BytesIO(); ckptzip.save({'w': torch.randn(1000)}, b); ckptzip.load(b.getvalue())\n"
        "    ckptzip.save({'w': torch.randn(1000)}, io.BytesIO())\n"
        "import ckptzip.kernels as k; assert k.COMPILED is None\n"
        "said = [str(w.message) for w in caught if w.category is k.NoCompiledKernelsWarning]\n"
        "assert len(said) == 1, said\n"
        "print(said[0])\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    env.pop("CKPTZIP_NUMPY_KERNELS", None)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("ckptzip's compiled CPU kernels are not built here (its C extensions failed to "
                                  "build when it was installed, most likely for want of a C compiler): CPU saves and "
                                  "loads run NumPy kernels, several times slower")
    assert ("files a GPU wrote with codec='auto' (gdeflate) cannot be decoded on the CPU" in done.stdout) == (
        len(missing) == 2)
    assert "`pip install .` in a clone builds them" in done.stdout


def test_the_environment_variable_chooses_the_numpy_kernels_without_a_warning() -> None:
    code = "import warnings; warnings.simplefilter('error'); import ckptzip.kernels as k; assert k.COMPILED is None"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "CKPTZIP_NUMPY_KERNELS": "1"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=300)
