"""The engine: batches of tensors ⇄ stored chunks on both backends, bit for bit.

CPU cases run everywhere; the same cases run on a GPU (marker ``gpu``) through the Triton kernels
and nvCOMP; kernels are also checked against their NumPy versions, and, where Triton is installed,
through Triton's interpreter on the CPU.
"""

from __future__ import annotations

import io
import itertools
import logging
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers import assert_same, code_large_tensors_in_ranges, random_tensor, rewrite_index, small_chunks

import ckptzip
from ckptzip.checksum import wsum64_array
from ckptzip.codecs import get_codec, has_codec
from ckptzip.codecs.cpu import ZstdCodec
from ckptzip.codecs.nvcomp import NvcompLz4Codec, NvcompZstdCodec
from ckptzip.memory import gpu as gpu_memory
from ckptzip.engine import plan as engine_plan
from ckptzip.engine import reader as engine_reader
from ckptzip.engine import pipeline as engine_pipeline
from ckptzip.engine.decode import Runs, decode_batch
from ckptzip.engine.choice import trial
from ckptzip.engine.encode import encode_batch, start_batch
from ckptzip.engine.streams import PLANE, Batch, Streams
from ckptzip.engine.policy import Policy
from ckptzip.errors import UsageError
from ckptzip.kernels import distinct
from ckptzip.kernels import planes as planes_module
from ckptzip.kernels.planes import merge_planes, plane_layout, split_planes
from ckptzip.kernels.segments import gather_bytes, segment_sums

MASK = (1 << 64) - 1


def _state(device: str = "cpu") -> dict:
    g = torch.Generator().manual_seed(0)
    state = {
        "w": torch.randn(3000, generator=g) * 0.02,
        "odd": torch.randn(7, 3, generator=g),  # below the small-tensor size: one stream
        "bf": torch.randn(3001, generator=g).bfloat16(),  # an element count off any block
        "d": torch.randn(1025, generator=g).double(),
        "i8": torch.arange(5000, dtype=torch.int8),
        "zeros": torch.zeros(4096),  # every plane codes to almost nothing
        "noise": random_tensor(torch.float32, (2048,), seed=3),  # NaN payloads, subnormals, -0.0
        "empty": torch.empty(0, 4),
        "scalar": torch.tensor(7, dtype=torch.int64),
        "nested": {"x": 3, "t": torch.ones(2, 3).t()},  # non-contiguous
    }
    state = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in state.items()}
    state["tied"] = state["w"]
    return state


def _devices() -> list:
    return ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("codec", ["auto", "fast", "portable", "zstd", "raw", "deflate", "huff", "ckz-huff"])
def test_save_and_load_round_trip_bit_exactly(device: str, codec: str) -> None:
    state = _state(device)
    buf = io.BytesIO()
    ckptzip.save(state, buf, codec=codec)
    got = ckptzip.load(io.BytesIO(buf.getvalue()), map_location=device)
    assert_same(got, state)
    assert got["tied"] is got["w"]


@pytest.mark.parametrize("device", _devices())
def test_many_batches_and_a_pinned_pool_of_two_buffers(device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine_plan, "SAVE_BATCH_BYTES", {"cuda": 1 << 14, "cpu": 1 << 14})
    monkeypatch.setattr(engine_plan, "LOAD_BATCH_BYTES", {"cuda": 1 << 13, "cpu": 1 << 13})
    from ckptzip.memory import pinned

    monkeypatch.setattr(pinned, "_POOL", pinned.PinnedPool(buffer_bytes=1 << 12, count=2) if device == "cuda" else None)
    state = _state(device)
    buf = io.BytesIO()
    ckptzip.save(state, buf)
    assert_same(ckptzip.load(io.BytesIO(buf.getvalue()), map_location=device), state)


@pytest.mark.parametrize("device", _devices())
def test_a_batch_decodes_to_what_was_encoded(device: str) -> None:
    state = _state(device)
    tensors = [state[k].contiguous() for k in ("w", "odd", "bf", "d", "i8", "zeros", "noise", "empty", "scalar")]
    backend = "cuda" if device == "cuda" and has_codec("ans", "cuda") else "cpu"
    if device == "cuda" and backend == "cpu":
        pytest.skip("nvCOMP is not installed")
    batch = encode_batch(tensors, Policy.parse("auto"), backend)
    assert batch.stored.numel() == int(batch.chunks.length.sum())
    data = io.BytesIO()
    ckptzip.save({str(i): t for i, t in enumerate(tensors)}, data)
    with ckptzip.open(io.BytesIO(data.getvalue()), map_location=device) as reader:
        for i, t in enumerate(tensors):
            assert_same(reader[str(i)], t)


def test_a_started_batch_finishes_as_an_encoded_one_and_codes_by_the_entropies_given_ahead() -> None:
    g = torch.Generator().manual_seed(3)
    tensors = [(torch.randn(8192, generator=g) * 0.02).bfloat16(), torch.randn(4096, generator=g)]
    policy = Policy.parse("auto")
    want = encode_batch(tensors, policy, "cpu")
    started = start_batch(tensors, policy, "cpu").finish()
    assert torch.equal(started.stored, want.stored)
    assert [(r.transforms, r.streams) for r in started.recipes] == [(r.transforms, r.streams) for r in want.recipes]
    assert [s.codec["id"] for s in want.recipes[0].streams] == ["raw", "zstd"]  # the sign/exponent plane coded
    # every plane said to be near-random (and too small for a trial to say otherwise): stored raw
    raw = start_batch(tensors, policy, "cpu", entropies=np.full((2, 8), 8.0, dtype=np.float32)).finish()
    assert [[s.codec["id"] for s in r.streams] for r in raw.recipes] == [["raw"] * 2, ["raw"] * 4]
    assert raw.stored.numel() == sum(t.nbytes for t in tensors)
    data = io.BytesIO()
    ckptzip.save({"a": tensors[0], "b": tensors[1]}, data)
    assert_same(ckptzip.load(data.getvalue()), {"a": tensors[0], "b": tensors[1]})


def test_the_cpu_backend_codes_a_near_random_plane_that_still_shrinks() -> None:
    # Mantissa bytes drawn from 64 values: ~6 bits of entropy per byte would be coded anyway;
    # values repeating in long runs have ~8 bits of order-0 entropy yet zstd shrinks them.
    g = np.random.default_rng(0)
    runs = np.repeat(g.integers(0, 1 << 31, 4096, dtype=np.int64), 64).astype(np.int32)
    t = torch.from_numpy(runs).view(torch.float32)
    ct = ckptzip.compress(t, codec="auto")
    assert ct.entry.codecs.count("zstd") == 4
    assert ct.ratio > 4


def test_splitting_on_the_cpu_matches_numpy_reference() -> None:
    rng = np.random.default_rng(1)
    for k in (2, 4, 8):
        datas = [torch.from_numpy(rng.integers(0, 256, n * k, dtype=np.uint8)) for n in (1, 7, 4096, 4097)]
        starts, strides, total = plane_layout([d.numel() for d in datas], k)
        planes = torch.zeros(total, dtype=torch.uint8)
        hist = torch.zeros(len(datas), 8 * 256, dtype=torch.int32)
        sums = split_planes(datas, k, planes, starts, strides, hist, np.arange(len(datas)))
        assert [int(s) & MASK for s in sums] == [wsum64_array(d.numpy()) for d in datas]
        outs = [torch.empty_like(d) for d in datas]
        offsets = starts[:, None] + strides[:, None] * np.arange(k)[None, :]
        merged = merge_planes(outs, k, [planes], np.zeros_like(offsets), offsets)
        assert all(torch.equal(a, b) for a, b in zip(outs, datas))
        assert [int(s) & MASK for s in merged] == [int(s) & MASK for s in sums]


def test_segment_sums_gather_and_checksum_each_segment() -> None:
    buf = torch.from_numpy(np.random.default_rng(2).integers(0, 256, 100_000, dtype=np.uint8))
    offsets, lengths = np.array([0, 5, 9000, 50_001]), np.array([5, 8999, 20_000, 17])
    out = torch.zeros(int(lengths.sum()), dtype=torch.uint8)
    sums = segment_sums([buf], np.zeros(4, np.int64), offsets, lengths, outs=[out],
                        out_index=np.zeros(4, np.int64), out_offsets=np.cumsum(lengths) - lengths)
    pieces = [buf.numpy()[o : o + n] for o, n in zip(offsets, lengths)]
    assert [int(s) & MASK for s in sums] == [wsum64_array(p) for p in pieces]
    assert np.array_equal(out.numpy(), np.concatenate(pieces))


@pytest.mark.gpu
@pytest.mark.parametrize("codec", ["auto", "portable"])
def test_a_save_queued_behind_busy_gpu_work_writes_the_digests_of_its_bytes(codec: str) -> None:
    # The GPU sleeps on the caller's stream first, so every kernel of the save runs late: any
    # read of the encoded batch that is not ordered after its encoding (another thread, another
    # stream) sees memory not yet written, and the file's digests or bytes come out wrong.
    state = _state("cuda")
    for _ in range(3):
        torch.cuda._sleep(200_000_000)
        buf = io.BytesIO()
        ckptzip.save(state, buf, codec=codec)
        assert_same(ckptzip.load(io.BytesIO(buf.getvalue()), map_location="cuda"), state)


@pytest.mark.gpu
@pytest.mark.parametrize("codec", ["auto", "portable"])
def test_a_save_writes_the_same_bytes_whatever_device_memory_held_before(codec: str) -> None:
    # Blocks that PyTorch's caching allocator hands out again are filled with a pattern first: no
    # byte of them may reach the file (stale device memory in a checkpoint, and files that differ
    # with the process's history), and decoding into such blocks restores the same tensors.
    state = _state("cuda")
    first = io.BytesIO()
    ckptzip.save(state, first, codec=codec)
    for nbytes in (1 << 12, 1 << 16, 1 << 20, 1 << 24):
        junk = [torch.full((nbytes,), 0xA5, dtype=torch.uint8, device="cuda") for _ in range(8)]
        del junk
    again = io.BytesIO()
    ckptzip.save(state, again, codec=codec)
    assert again.getvalue() == first.getvalue()
    for nbytes in (1 << 12, 1 << 16, 1 << 20, 1 << 24):  # and decoding into recycled blocks
        junk = [torch.full((nbytes,), 0x5A, dtype=torch.uint8, device="cuda") for _ in range(8)]
        del junk
    assert_same(ckptzip.load(io.BytesIO(first.getvalue()), map_location="cuda"), state)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_gather_bytes_reads_each_address_of_several_tensors(device: str) -> None:
    rng = np.random.default_rng(4)
    bases = [torch.from_numpy(rng.integers(0, 256, n, dtype=np.uint8)).to(device) for n in (1, 3000, 70_001)]
    which = np.array([0, 1, 2, 2, 1, 2, 0], dtype=np.int64)
    offsets = np.array([0, 2999, 70_000, 0, 17, 65_536, 0], dtype=np.int64)
    got = gather_bytes(bases, which, offsets)
    assert got.device.type == device and got.dtype == torch.uint8
    assert got.cpu().tolist() == [int(bases[b][o]) for b, o in zip(which.tolist(), offsets.tolist())]


@pytest.mark.parametrize("values", [[], [5], [3, 1, 3, 0, 1, 1, 7], list(range(9, -1, -1)) * 3])
def test_distinct_gives_what_numpy_unique_gives(values: list[int]) -> None:
    array = np.array(values, dtype=np.int64)
    got_values, got_first = distinct(array)
    want_values, want_first = np.unique(array, return_index=True)
    assert got_values.tolist() == want_values.tolist() and got_first.tolist() == want_first.tolist()


@pytest.mark.gpu
def test_gpu_kernels_equal_the_cpu_kernels() -> None:
    rng = np.random.default_rng(3)
    for k in (2, 4, 8):
        datas = [torch.from_numpy(rng.integers(0, 256, n * k, dtype=np.uint8)) for n in (1, 7, 4096, 4097, 100_003)]
        starts, strides, total = plane_layout([d.numel() for d in datas], k)
        cpu_planes, gpu_planes = torch.zeros(total, dtype=torch.uint8), torch.zeros(total, dtype=torch.uint8, device="cuda")
        hist = torch.zeros(len(datas), 8 * 256, dtype=torch.int32)
        rows = np.arange(len(datas))
        cpu = split_planes(datas, k, cpu_planes, starts, strides, hist, rows)
        gpu = split_planes([d.cuda() for d in datas], k, gpu_planes, starts, strides, hist.cuda(), rows)
        assert torch.equal(cpu, gpu.cpu())
        for t, d in enumerate(datas):
            n = d.numel() // k
            for j in range(k):
                a = int(starts[t] + j * strides[t])
                assert torch.equal(cpu_planes[a : a + n], gpu_planes[a : a + n].cpu())


@pytest.mark.parametrize("device", _devices())
def test_a_damaged_chunk_is_named_before_any_decoder_runs(device: str) -> None:
    state = {"w": (torch.randn(4096) * 0.02).to(device)}
    buf = io.BytesIO()
    ckptzip.save(state, buf)
    data = bytearray(buf.getvalue())
    with ckptzip.open(io.BytesIO(bytes(data))) as reader:
        chunk = reader.entries()[0].streams[3].chunks[0]
    data[chunk.offset + 1] ^= 0x10
    with pytest.raises(ckptzip.CorruptCheckpointError, match=r"tensor 'w' stream 3 chunk 0 .* is damaged: wsum64"):
        ckptzip.load(io.BytesIO(bytes(data)), map_location=device)


def test_decode_batch_returns_checksums_for_the_caller() -> None:
    tensors = [torch.randn(5000), torch.arange(100)]
    buf = io.BytesIO()
    ckptzip.save({"a": tensors[0], "b": tensors[1]}, buf)
    from ckptzip.format import ContainerReader

    reader = ContainerReader(io.BytesIO(buf.getvalue()))
    runs = Runs.of(reader.tensors)
    assert len(runs.file) == 1
    region = torch.from_numpy(reader.ranges.view(int(runs.file[0]), runs.total).copy())
    outs, sums = decode_batch(reader.tensors, region, runs, "cpu", digests=True)
    assert [f"wsum64:{int(s) & MASK:016x}" for s in sums] == [e.checksum for e in reader.tensors]
    assert torch.equal(outs[0].view(torch.float32), tensors[0])


def test_a_decode_budget_refuses_a_small_file_declaring_much(tmp_path) -> None:  # noqa: ANN001
    path = tmp_path / "zeros.ckz"
    ckptzip.save({"z": torch.zeros(1 << 20)}, path)  # 4 MiB of zeros in a few KiB
    assert path.stat().st_size < 64 << 10
    with pytest.raises(ckptzip.DecodeBudgetError, match=r"declares 4194304 bytes of tensors, more than max_bytes=1000000"):
        ckptzip.load(path, max_bytes=1_000_000)
    with pytest.raises(MemoryError):
        ckptzip.open(path.read_bytes(), max_bytes=1_000_000)
    assert_same(ckptzip.load(path, max_bytes=1 << 22), {"z": torch.zeros(1 << 20)})


@pytest.mark.parametrize("device", _devices())
def test_a_tensor_larger_than_a_slice_decodes_in_parts_into_its_output(device: str, monkeypatch: pytest.MonkeyPatch
                                                                        ) -> None:
    monkeypatch.setattr(engine_reader, "CPU_SLICE_BYTES", 16 << 10)
    monkeypatch.setattr(engine_plan, "LOAD_BATCH_BYTES", {"cuda": 16 << 10, "cpu": 8 << 20})  # GPU slices: a batch
    monkeypatch.setattr(gpu_memory, "_MIN_BATCH", 1 << 10)
    parts = []
    slices = engine_reader.stored_ranges
    monkeypatch.setattr(engine_reader, "stored_ranges", lambda e, limit: parts.append(slices(e, limit)) or parts[-1])
    g = torch.Generator().manual_seed(4)
    state = {"big": (torch.randn(50_000, generator=g) * 0.02).to(device), "small": torch.arange(10).to(device)}
    buf = io.BytesIO()
    ckptzip.save(state, buf, codec=small_chunks())
    assert_same(ckptzip.load(buf.getvalue(), map_location=device), state)
    assert any(p is not None and len(p) > 5 for p in parts)
    data = bytearray(buf.getvalue())
    with ckptzip.open(bytes(data)) as reader:
        chunk = reader.entries()[0].streams[0].chunks[-1]
    data[chunk.offset] ^= 1
    with pytest.raises(ckptzip.CorruptCheckpointError, match=r"tensor 'big' stream 0 chunk \d+ .* is damaged"):
        ckptzip.load(bytes(data), map_location=device)
    # the tensor is checked through its parts' checksums, which add up to its own: a wrong one is caught
    with ckptzip.open(buf.getvalue()) as reader:
        checksum = reader.entries()[0].checksum

    def other_checksum(index: dict) -> None:
        index["tensors"][0]["checksum"] = checksum[:-1] + ("0" if checksum[-1] != "0" else "1")

    with pytest.raises(ckptzip.CorruptCheckpointError, match=r"tensor 'big': decoded bytes have checksum "
                       + re.escape(checksum)):
        ckptzip.load(rewrite_index(buf.getvalue(), other_checksum), map_location=device)


def test_a_gpu_only_codec_without_a_gpu_says_what_is_missing() -> None:
    if has_codec("ans", "cuda"):
        pytest.skip("this machine runs ans on its GPU")
    with pytest.raises(ckptzip.CodecUnavailableError, match=r"codec 'ans' cannot run on the GPU here: "):
        ckptzip.save({"w": torch.randn(5000)}, io.BytesIO(), codec="ans")


@pytest.mark.gpu
def test_a_reserved_slab_gives_pinned_buffers_that_copy_asynchronously_and_are_reused() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from ckptzip.memory.pinned import PinnedPool
    pool = PinnedPool(buffer_bytes=1 << 20, count=1 << 30)
    pool.reserve(5 << 20)
    buffers = [pool.acquire() for _ in range(5)]
    assert all(b.is_pinned() for b in buffers)
    source = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, device="cuda")
    buffers[0].copy_(source, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(buffers[0], source.cpu())
    for b in buffers:
        pool.release(b)
    pool.reserve(5 << 20)  # all free again: nothing new
    assert {pool.acquire().data_ptr() for _ in range(5)} == {b.data_ptr() for b in buffers}


@pytest.mark.gpu
def test_a_pool_reserves_in_slabs_and_trims_only_whole_free_slabs() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from ckptzip.memory import pinned
    pool = pinned.PinnedPool(buffer_bytes=1 << 20, count=1 << 30, slab_bytes=2 << 20)
    pool.reserve(5 << 20)  # slabs of 2, 2 and 1 buffers
    assert pool.reserved == 5 << 20
    held = pool.acquire()  # a buffer of the first slab
    pool.trim(0)
    assert pool.reserved == 2 << 20  # the first slab stays while its buffer is in use
    pool.release(held)
    pool.trim(1 << 20)
    assert pool.reserved == 2 << 20  # dropping it would leave less than asked to keep
    pool.trim(0)
    assert pool.reserved == 0
    pool.reserve(1 << 20)
    assert pool.acquire().is_pinned()


@pytest.mark.gpu
def test_a_load_to_the_cpu_of_tensors_decoded_on_the_gpu_comes_down_through_a_pool_of_three_buffers(
        monkeypatch: pytest.MonkeyPatch) -> None:
    if not torch.cuda.is_available() or not has_codec("gdeflate", "cuda"):
        pytest.skip("needs a CUDA device and nvCOMP")
    from ckptzip.memory import pinned
    pool = pinned.PinnedPool(buffer_bytes=1 << 20, count=3)
    monkeypatch.setattr(pinned, "_POOL", pool)
    g = torch.Generator(device="cuda").manual_seed(7)
    state = {"w": torch.randn(1_400_000, generator=g, device="cuda"),  # 5.3 MiB: six pieces, the last partial
             "m": torch.randn(262_144, generator=g, device="cuda") * 1e-3,  # one whole piece
             "b": torch.randn(1000, generator=g, device="cuda").bfloat16(),  # small: Tensor.to
             "step": torch.tensor(9, device="cuda")}
    buf = io.BytesIO()
    ckptzip.save(state, buf)  # gdeflate planes: decoded on the GPU, for the CPU too
    got = ckptzip.load(buf.getvalue(), map_location="cpu")
    assert {t.device.type for t in got.values()} == {"cpu"}
    assert_same(got, {k: v.cpu() for k, v in state.items()})
    assert pool.reserved == 3 << 20  # every piece through the pool's three buffers, all given back
    assert len([pool.acquire() for _ in range(3)]) == 3


@pytest.mark.gpu
def test_a_bounded_pool_grows_by_slabs_as_large_as_it_holds_up_to_its_count() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from ckptzip.memory import pinned
    pool = pinned.PinnedPool(buffer_bytes=1 << 20, count=11, slab_bytes=4 << 20)
    held = [pool.acquire() for _ in range(11)]
    assert [s.nbytes >> 20 for s in pool._slabs] == [1, 1, 2, 4, 3]  # doubling, a slab at most 4, 11 in all
    assert all(b.is_pinned() for b in held) and len({b.data_ptr() for b in held}) == 11
    source = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, device="cuda")
    held[-1].copy_(source, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(held[-1], source.cpu())
    pool.release(held.pop())
    assert pool.acquire().data_ptr() not in {b.data_ptr() for b in held}  # reused, not a twelfth
    assert pool.reserved == 11 << 20


def test_a_pool_pins_buffers_one_by_one_where_host_memory_cannot_be_registered(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from ckptzip.memory import pinned

    def refused(nbytes: int, shared: bool = False, **pieces: object) -> pinned.Slab:
        raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed with CUDA error 801")

    pins: list[bool] = []
    real_empty = torch.empty

    def empty(*args: Any, pin_memory: bool = False, **kwargs: Any) -> torch.Tensor:
        pins.append(pin_memory)  # this machine may have no GPU to pin with: a plain buffer stands in
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(pinned, "Slab", refused)
    monkeypatch.setattr(pinned.torch, "empty", empty)
    pool = pinned.PinnedPool(buffer_bytes=1 << 12, count=4)
    held = [pool.acquire() for _ in range(4)]
    assert pins == [True] * 4 and pool._slabs == [] and pool.reserved == 4 << 12
    assert len({b.data_ptr() for b in held}) == 4 and all(b.numel() == 1 << 12 for b in held)


def test_the_numpy_split_and_merge_agree_across_their_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(planes_module, "COMPILED", None)  # the NumPy kernels, also where compiled ones exist
    monkeypatch.setattr(planes_module, "_CPU_BLOCK", 1000)
    test_splitting_on_the_cpu_matches_numpy_reference()


def _exponents(t: torch.Tensor) -> np.ndarray:
    return np.ascontiguousarray(t.numpy().view(np.uint8).reshape(-1, 4)[:, 3])


def _counting_zstd(monkeypatch: pytest.MonkeyPatch) -> dict[tuple[int, bool], int]:
    """Bytes each zstd configuration codes through encode_segments, by (level, long_matches_only)."""
    coded: dict[tuple[int, bool], int] = {}
    encode_segments = ZstdCodec.encode_segments

    def counting(self: ZstdCodec, base: torch.Tensor, offsets: np.ndarray, lengths: np.ndarray) -> object:
        key = (self.level, self.long_matches_only)
        coded[key] = coded.get(key, 0) + int(lengths.sum())
        return encode_segments(self, base, offsets, lengths)

    monkeypatch.setattr(ZstdCodec, "encode_segments", counting)
    return coded


def test_the_cpu_planner_keeps_the_candidate_that_codes_a_sample_smallest(monkeypatch: pytest.MonkeyPatch) -> None:
    # Exponent planes of: a moment-like tensor (row scale x column scale, squared: short repeats
    # that level 1 matches and level 3 matches better), weights (no repeats worth a match), and a
    # plane of pure noise that no candidate shrinks.
    gen = torch.Generator().manual_seed(2)
    moment = (torch.rand(64, 1, generator=gen) * 1e-3) ** 2 * (torch.rand(1, 1024, generator=gen) * 1e-2) ** 2 + 1e-12
    weight = torch.randn(65536, generator=gen) * 0.02
    noise = np.random.default_rng(2).integers(0, 256, 65536, dtype=np.uint8)
    base = torch.from_numpy(np.concatenate([_exponents(moment), _exponents(weight), noise]))
    offsets = np.array([0, 65536, 131072], dtype=np.int64)
    sizes = np.full(3, 65536, dtype=np.int64)
    candidates = [{"id": "zstd", "level": 1, "long_matches_only": True}, {"id": "zstd", "level": 1},
                  {"id": "zstd", "level": 3}]
    coded = _counting_zstd(monkeypatch)
    streams = Streams(np.arange(3), np.zeros(3, np.int64), offsets, sizes, np.full(3, PLANE, np.int8), np.zeros(3))
    batch = Batch([base], streams, [None] * 3, torch.zeros(3, dtype=torch.int64))
    picks, whole = trial(np.arange(3), batch, candidates, 1 << 15, Policy.parse("auto"), "cpu")
    assert picks == [candidates[2], candidates[0], {"id": "raw"}]
    assert whole == {}  # samples of part of a stream are not what the stream stores
    # level 3 (the slowest) coded only the sample where level 1 beat the long-matches-only coding
    assert coded == {(1, True): 3 << 15, (1, False): 3 << 15, (3, False): 1 << 15}
    for preset in ("auto", "portable"):
        assert Policy.parse(preset).plane_candidates("cpu") == candidates
    assert Policy.parse("fast").plane_candidates("cpu") == candidates[:1]


def test_a_policy_stores_each_codec_in_chunks_of_its_own_size_unless_it_sets_one() -> None:
    codecs = [get_codec("zstd", "cpu"), NvcompZstdCodec(), get_codec("raw", "cuda")]
    assert [Policy.parse("auto").chunk_bytes_for(c) for c in codecs] == [1 << 20, 256 << 10, 16 << 20]
    small = Policy("auto", chunk_bytes=1000)
    assert [small.chunk_bytes_for(c) for c in codecs] == [1000, 1024, 1024]  # GPU: multiples of 256
    assert Policy("lz4", chunk_bytes=1 << 28).chunk_bytes_for(NvcompLz4Codec()) == 1 << 24  # at most what it takes
    configs = [{"id": "zstd", "level": 1}, {"id": "raw"}, {"id": "zstd", "level": 3}]
    assert Policy.parse("auto").chunk_sizes(configs, "cpu").tolist() == [1 << 20, 16 << 20, 1 << 20]
    assert small.chunk_sizes(configs, "cpu").tolist() == [1000] * 3
    for bad in (0, (1 << 28) + 1, 1.5, True):
        with pytest.raises(UsageError, match=rf"^chunk_bytes={bad!r}: stored chunks hold 1 to 268435456 bytes$"):
            Policy("auto", chunk_bytes=bad)  # type: ignore[arg-type]


def _huff_state(device: str) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(4)
    state = {"w": torch.randn(256, 1024, generator=gen) * 0.02,
             "g": (torch.randn(512, 512, generator=gen) * 1e-3).bfloat16(),
             "zero low bytes": (torch.randn(64, 1024, generator=gen) * 0.02).bfloat16().float(),
             "i8": torch.randint(-3, 4, (70_000,), generator=gen, dtype=torch.int8),
             "tiny": torch.randn(100, generator=gen)}
    return {k: v.to(device) for k, v in state.items()}


def test_the_huff_preset_codes_every_structured_stream_with_ckz_huff() -> None:
    """Sign/exponent planes and whole byte tensors ckz-huff, mantissas and tiny tensors raw, the
    zero low bytes of bf16-valued fp32 as constant chunks; no trials."""
    state = _huff_state("cpu")
    data = io.BytesIO()
    ckptzip.save(state, data, codec="huff")
    with ckptzip.open(io.BytesIO(data.getvalue())) as reader:
        entries = {e.name: e for e in reader.entries()}
        assert_same(reader.load(), state)
    huff, raw = {"id": "ckz-huff"}, {"id": "raw"}
    # no trial rescues a mantissa plane (torch's lowest mantissa bytes would shrink a little): the
    # GPU tries none, and a huff batch is the same file on either backend
    assert [s.codec for s in entries["w"].streams] == [raw, raw, raw, huff]
    assert [s.codec for s in entries["g"].streams] == [raw, huff]
    assert [s.codec for s in entries["zero low bytes"].streams] == [huff, huff, raw, huff]
    assert all(length == 5 for _, length, _, _ in entries["zero low bytes"].streams[0].chunks)  # constants
    assert [s.codec for s in entries["i8"].streams] == [huff]
    assert [s.codec for s in entries["tiny"].streams] == [raw]


def _saved_on_the_cpu(index: Any) -> None:
    """An index edited as if its tensors had been saved from the CPU (``device``, which load's
    default ``map_location`` follows, is the only thing a file records of where its tensors were)."""
    for tensor in index["tensors"]:
        assert tensor["device"] == "cuda:0", tensor["device"]
        tensor["device"] = "cpu"


@pytest.mark.gpu
def test_the_huff_preset_writes_the_same_file_on_a_gpu_as_on_the_cpu() -> None:
    """One batch on either backend: the same plane choices, chunks, order and bytes; the files
    differ only in each tensor's recorded device."""
    if not has_codec("ckz-huff", "cuda"):
        pytest.skip("ckz-huff's kernels do not run here")
    files = []
    for device in ("cuda", "cpu"):
        data = io.BytesIO()
        ckptzip.save(_huff_state(device), data, codec="huff")
        files.append(data.getvalue())
    assert rewrite_index(files[0], _saved_on_the_cpu) == files[1]
    assert_same(ckptzip.load(io.BytesIO(files[0]), map_location="cuda"), _huff_state("cuda"))


@pytest.mark.parametrize("preset", ["auto", "portable", "fast"])
def test_cpu_exponent_planes_take_the_zstd_that_codes_their_sample_smallest(preset: str) -> None:
    gen = torch.Generator().manual_seed(2)
    weight = torch.randn(64, 1024, generator=gen) * 0.02
    # like Adam's exp_avg_sq of a linear layer: row scale x column scale, squared, so exponent
    # bytes repeat in short runs that zstd level 3 matches
    moment = (torch.rand(64, 1, generator=gen) * 1e-3) ** 2 * (torch.rand(1, 1024, generator=gen) * 1e-2) ** 2 + 1e-12
    data = io.BytesIO()
    ckptzip.save({"w": weight, "v": moment}, data, codec=preset)
    with ckptzip.open(io.BytesIO(data.getvalue())) as reader:
        entries = {e.name: e for e in reader.entries()}
        assert_same(reader["v"], moment)
    literals = {"id": "zstd", "level": 1, "long_matches_only": True}
    assert entries["w"].streams[3].codec == literals
    assert entries["v"].streams[3].codec == (literals if preset == "fast" else {"id": "zstd", "level": 3})


def test_a_plane_a_trial_coded_whole_is_stored_as_the_trial_coded_it(monkeypatch: pytest.MonkeyPatch) -> None:
    # 16384 fp32 values: byte planes of 16 KiB, within the structured trial's sample, so the trial
    # codes each structured plane whole and the final coding is skipped.
    t = torch.randn(16384, generator=torch.Generator().manual_seed(5)) * 0.02
    coded = _counting_zstd(monkeypatch)
    blob = io.BytesIO()
    ckptzip.save({"w": t}, blob, codec="auto")
    # the trial's codings of the exponent plane (level 3 not tried: level 1 did not beat the
    # long-matches-only coding), and no final coding
    assert coded == {(1, True): 16384, (1, False): 16384}
    data = blob.getvalue()
    with ckptzip.open(io.BytesIO(data)) as reader:
        assert_same(reader["w"], t)
        stream = reader.entries()[0].streams[3]  # the sign/exponent plane
    plane = _exponents(t)
    frame = ZstdCodec.from_config(stream.codec).encode([torch.from_numpy(plane)])[0].numpy().tobytes()
    (chunk,) = stream.chunks
    assert data[chunk.offset : chunk.offset + chunk.length] == frame
    damaged = bytearray(data)
    damaged[chunk.offset + chunk.length // 2] ^= 1
    with pytest.raises(ckptzip.CorruptCheckpointError, match=r"tensor 'w' stream 3 chunk 0 .* is damaged"):
        ckptzip.load(bytes(damaged))


def test_a_range_that_runs_out_of_memory_is_coded_in_quarters_and_the_file_is_the_same(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    # ranges of 64 KiB a plane (engine/parts.py, run on the CPU); plane 1's fail with an allocation error
    from ckptzip.engine import parts as engine_parts

    state = {"w": torch.randn(1 << 16, generator=torch.Generator().manual_seed(9)) * 0.02}
    code_large_tensors_in_ranges(monkeypatch)
    expected = io.BytesIO()
    ckptzip.save(state, expected)
    cpu = torch.device("cpu")
    monkeypatch.setattr(engine_plan.GpuLimits, "of", classmethod(
        lambda cls, *a, **k: cls({cpu: 1 << 16}, {cpu: 0}, {cpu: 96 << 16})))
    real = engine_parts.encode_part
    tried: list[tuple[int, int]] = []

    def scarce(ranged: engine_parts.Ranged, part: engine_parts.Range, last: bool) -> object:
        tried.append((part.stream, part.end - part.first))
        if part.stream == 1 and part.end - part.first > engine_parts.RANGE_ALIGN:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 KiB\nmore")
        return real(ranged, part, last)

    monkeypatch.setattr(engine_pipeline, "encode_part", scarce)
    buf = io.BytesIO()
    with caplog.at_level(logging.INFO, logger="ckptzip"):
        ckptzip.save(state, buf)
    assert tried == [(0, 1 << 16), (1, 1 << 16), (1, 1 << 14), (1, 1 << 14), (1, 1 << 14), (1, 1 << 14),
                     (2, 1 << 16), (3, 1 << 16)]
    [failure] = [r.getMessage() for r in caplog.records if "ran out of memory" in r.getMessage()]
    assert "a range of 0 MiB of a 0 MiB tensor ran out of memory on cpu (CUDA out of memory. Tried to allocate " \
           "64.00 KiB); coding it in quarters" in failure
    assert_same(ckptzip.load(buf.getvalue()), state)
    with ckptzip.open(buf.getvalue()) as reader, ckptzip.open(expected.getvalue()) as before:
        [entry], [whole] = list(reader.entries()), list(before.entries())
    assert [s.nbytes for s in entry.streams] == [s.nbytes for s in whole.streams] == [1 << 16] * 4
    assert [c.raw_length for c in entry.streams[1].chunks] == [1 << 14] * 4
    assert entry.checksum == whole.checksum


def test_a_tensor_coded_in_ranges_loads_bit_exactly_with_each_stream_back_to_back(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # a GPU codes a tensor over its budget in element ranges (engine/parts.py); the same code runs here on the CPU
    g = torch.Generator().manual_seed(8)
    state = {"w": torch.randn(3 << 14, generator=g) * 0.02, "i": torch.randint(0, 9, (5 << 14,), generator=g,
             dtype=torch.uint8), "small": torch.arange(10)}
    code_large_tensors_in_ranges(monkeypatch)
    buf = io.BytesIO()
    ckptzip.save(state, buf)
    assert_same(ckptzip.load(buf.getvalue()), state)
    with ckptzip.open(buf.getvalue()) as reader:
        entries = {e.name: e for e in reader.entries()}
    w = entries["w"]
    assert w.transforms == [{"id": "byteplanes", "itemsize": 4}] and len(w.streams) == 4
    for stream in w.streams:  # 48 KiB a plane: three ranges; five of the uint8 bytes below
        assert sum(c.raw_length for c in stream.chunks) == stream.nbytes == 3 << 14
        assert len(stream.chunks) == 3
    data = entries["i"]
    assert data.transforms == [] and [c.raw_length for c in data.streams[0].chunks] == [1 << 14] * 5
    offsets = [(c.offset, c.length) for c in data.streams[0].chunks]
    assert all(a + n == b for (a, n), (b, _) in itertools.pairwise(offsets))  # back to back across ranges
    damaged = bytearray(buf.getvalue())
    damaged[data.streams[0].chunks[-1].offset] ^= 1
    with pytest.raises(ckptzip.CorruptCheckpointError, match=r"tensor 'i' stream 0 chunk 4 .* is damaged"):
        ckptzip.load(bytes(damaged))


def test_streams_whose_codecs_decode_alike_decode_in_one_group() -> None:
    from ckptzip.engine.chunks import Listed
    from ckptzip.engine.decode import _Batch, _decoders
    from ckptzip.format import StreamEntry, TensorEntry

    def batch(configs: list[dict[str, object]]) -> _Batch:
        entry = TensorEntry("t", "uint8", (5,), 5, "", [], [StreamEntry(c, 1) for c in configs])
        coded = np.array([c["id"] != "raw" for c in configs])
        return _Batch(Listed.of([entry]), np.zeros(0, np.int64), configs, coded, torch.empty(0, dtype=torch.uint8),
                      "cpu")

    configs: list[dict[str, object]] = [{"id": "zstd", "level": 3}, {"id": "raw"}, {"id": "zstd", "level": 19},
                                        {"id": "zstd", "level": 1, "long_matches_only": True}, {"id": "lz4"}]
    groups = _decoders(batch(configs))
    assert [g for g, _ in groups] == [0, -1, 0, 0, 1]
    assert groups[0][1] is groups[2][1] is groups[3][1]  # one codec decodes the three zstd streams
    assert groups[0][1].get_config()["id"] == "zstd" and groups[4][1].get_config() == {"id": "lz4"}
    with pytest.raises(ckptzip.UnsupportedFormatError, match=r"^tensor 't' stream 1: unknown codec id 'nosuch'"):
        _decoders(batch([configs[0], {"id": "nosuch"}]))


def test_a_cpu_save_and_load_never_import_numpy_ma(tmp_path: Path) -> None:
    """``np.unique`` imports ``numpy.ma`` on its first call (12-20 ms of a process's first load on a
    2-core machine); the engine finds distinct values with :func:`~ckptzip.kernels.distinct`."""
    code = (
        "import sys, torch, ckptzip\n"
        "state = {'w': torch.randn(1 << 16), 'g': torch.randn(1 << 14).bfloat16(), 'step': torch.tensor(3)}\n"
        f"ckptzip.save(state, {str(tmp_path / 'a.ckz')!r})\n"
        f"out = ckptzip.load({str(tmp_path / 'a.ckz')!r})\n"
        "assert all(torch.equal(out[k], state[k]) for k in state)\n"
        "print('numpy.ma' in sys.modules)\n"
    )
    src = str(Path(__file__).resolve().parents[2] / "src")
    env = {**os.environ, "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"
