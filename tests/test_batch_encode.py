"""The batched encoder that save() uses for GPU tensors, run here with CPU codecs: packing tensors
of one item size, per-tensor checksums from packed sums, tiny tensors coded on the host, and the
stager writing chunks in file order. On a GPU the same path runs with nvCOMP (gpu tests)."""

from __future__ import annotations

import io

import pytest
import torch

import ckptzip
from ckptzip import staging
from ckptzip.encode import encode_gpu_batch
from ckptzip.format import ContainerWriter
from ckptzip.tree import flatten
from helpers import assert_same


def _state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(300, 257, generator=g),
        "b16": torch.randn(5000, generator=g).bfloat16(),
        "grad": torch.randn(4096, generator=g).bfloat16().float(),
        "tiny": torch.randn(7, generator=g),
        "step": torch.tensor(3.0),
        "ids": torch.arange(10_000, dtype=torch.int64),
        "f64": torch.randn(2048, generator=g, dtype=torch.float64),
        "odd": torch.randn(1001, generator=g),
        "fp8": torch.randn(8192, generator=g).to(torch.float8_e4m3fn),
    }


def _write_batched(state: dict, codec: str, device: str = "cpu") -> bytes:
    flat = flatten(state)
    buf = io.BytesIO()
    writer = ContainerWriter(buf)
    pool = staging.PinnedPool(buffer_bytes=1 << 16, count=2) if device == "cuda" else None
    background = staging.BackgroundWriter(writer, pool)
    stager = staging.Stager(background, pool)
    items = [(t.name, t.tensor.to(device)) for t in flat.tensors]
    for encoded in encode_gpu_batch(items, codec, backend="cpu" if device == "cpu" else "cuda"):
        stager.add_tensor(encoded)
    stager.flush()
    background.close()
    writer.finish(flat.tree)
    return buf.getvalue()


@pytest.mark.parametrize("codec", ["auto", "portable", "zstd", "raw"])
def test_batched_encoding_round_trips_bit_exactly(codec: str) -> None:
    state = _state()
    blob = _write_batched(state, codec)
    assert_same(ckptzip.load(io.BytesIO(blob)), state)


def test_batched_encoding_matches_the_per_tensor_plan() -> None:
    state = _state()
    batched = ckptzip.open(io.BytesIO(_write_batched(state, "auto")))
    buf = io.BytesIO()
    ckptzip.save(state, buf)
    single = ckptzip.open(io.BytesIO(buf.getvalue()))
    for a, b in zip(batched.entries(), single.entries()):
        assert (a.name, a.checksum, a.transforms, a.codecs) == (b.name, b.checksum, b.transforms, b.codecs)
    assert dict(zip(batched.keys(), (e.codecs for e in batched.entries())))["grad"] == ["zstd", "zstd", "raw", "zstd"]


@pytest.mark.gpu
@pytest.mark.parametrize("codec", ["auto", "fast", "portable", "ans"])
def test_gpu_batches_through_a_small_pinned_pool_round_trip(codec: str) -> None:
    """Buffers of 64 KiB force many flushes in the middle of tensors (the lost-chunk race)."""
    state = _state()
    blob = _write_batched(state, codec, device="cuda")
    assert_same(ckptzip.load(io.BytesIO(blob), map_location="cuda"), state)
    assert_same(ckptzip.load(io.BytesIO(blob), map_location="cpu"), state)


@pytest.mark.gpu
def test_gpu_save_and_load_with_small_batches(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    from ckptzip import state_io

    monkeypatch.setattr(state_io, "BATCH_BYTES", 1 << 16)
    state = {k: v.cuda() for k, v in _state().items()}
    ckptzip.save(state, tmp_path / "s.ckz")
    assert_same(ckptzip.load(tmp_path / "s.ckz"), state)


@pytest.mark.parametrize("codec", ["auto", "portable"])
def test_batched_decoding_round_trips_bit_exactly(codec: str) -> None:
    from ckptzip.format import ContainerReader
    from ckptzip.state_io import _decode_gpu_batch

    state = _state()
    reader = ContainerReader(io.BytesIO(_write_batched(state, codec)))
    entries = [e for e in reader.tensors if e.nbytes]
    first = entries[0].streams[0].chunks[0].offset
    region = torch.empty(sum(e.compressed_nbytes for e in entries), dtype=torch.uint8)
    chunks = [(e, j, k, c) for e in entries for j, s in enumerate(e.streams) for k, c in enumerate(s.chunks)]
    reader.read_into(region, first, chunks)
    decoded = dict(zip((e.name for e in entries), _decode_gpu_batch(entries, region, backend="cpu")))
    for name, want in state.items():
        assert_same(decoded[name], want, name)


def test_batched_decoding_reports_a_wrong_checksum_with_the_tensor() -> None:
    from ckptzip.format import ContainerReader
    from ckptzip.state_io import _decode_gpu_batch

    reader = ContainerReader(io.BytesIO(_write_batched(_state(), "auto")))
    entries = [e for e in reader.tensors if e.name == "w"]
    entries[0].checksum = "wsum64:" + "0" * 16
    first = entries[0].streams[0].chunks[0].offset
    region = torch.empty(entries[0].compressed_nbytes, dtype=torch.uint8)
    reader.read_into(region, first, [(entries[0], j, k, c) for j, s in enumerate(entries[0].streams) for k, c in enumerate(s.chunks)])
    with pytest.raises(ckptzip.CorruptCheckpointError, match=r"^tensor 'w': decoded bytes have checksum wsum64:[0-9a-f]{16}, expected wsum64:0{16}"):
        _decode_gpu_batch(entries, region, backend="cpu")
