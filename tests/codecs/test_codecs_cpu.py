"""CPU codecs: round trips, interchange with the reference libraries, errors, the registry."""

from __future__ import annotations

import io
import zlib

import lz4.block
import numpy as np
import pytest
import torch
import zstandard
from helpers import CPU_CODECS

import ckptzip
from ckptzip import CodecUnavailableError, CorruptCheckpointError, UnsupportedFormatError
from ckptzip.codecs import Codec, codec_ids, get_codec, gpu_only_ids, has_codec, registry
from ckptzip.codecs import _threads
from ckptzip.codecs import cpu as cpu_module
from ckptzip.codecs.cpu import ZstdCodec
from ckptzip.engine import plan as engine_plan
from ckptzip.engine.threads import batch_share
from ckptzip.errors import CorruptChunkError
from ckptzip.testing.codecs import sample_chunks


def _u8(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


CHUNKS = sample_chunks()


@pytest.mark.parametrize("codec_id", ["zstd", "deflate", "lz4"])
@pytest.mark.parametrize("garbage", [b"\x00", b"\xff" * 64, bytes(range(256)) * 4])
def test_garbage_does_not_decode(codec_id: str, garbage: bytes) -> None:
    codec = get_codec(codec_id, "cpu")
    with pytest.raises(
        CorruptCheckpointError, match=f"^{codec_id} chunk 0 does not decode|^{codec_id} chunk 0 decoded to"
    ):
        codec.decode([_u8(garbage)], [1000])


def test_zstd_header_size_must_match() -> None:
    codec = get_codec("zstd", "cpu")
    frame = zstandard.ZstdCompressor(write_content_size=True).compress(b"x" * 500)
    with pytest.raises(
        CorruptCheckpointError, match="zstd chunk 0 does not decode: zstd frame header declares 500 bytes, expected 501"
    ):
        codec.decode([_u8(frame)], [501])


# --- bitstream interchange with the reference libraries -------------------------------------------


@pytest.mark.parametrize("name", list(CHUNKS))
def test_zstd_frames_are_plain_zstandard(name: str) -> None:
    chunk = CHUNKS[name]
    (encoded,) = get_codec({"id": "zstd", "level": 5}, "cpu").encode([chunk])
    raw = encoded.numpy().tobytes()
    assert zstandard.frame_content_size(raw) == chunk.numel()
    assert zstandard.ZstdDecompressor().decompress(raw) == chunk.numpy().tobytes()
    for foreign in (
        zstandard.ZstdCompressor(level=19).compress(chunk.numpy().tobytes()),
        zstandard.ZstdCompressor(write_content_size=False).compress(chunk.numpy().tobytes()),
    ):
        (decoded,) = get_codec("zstd", "cpu").decode([_u8(foreign)], [chunk.numel()])
        assert torch.equal(decoded, chunk)


def test_zstd_with_long_matches_only_writes_plain_frames_that_code_exponents_smaller() -> None:
    codec = get_codec({"id": "zstd", "level": 1, "long_matches_only": True}, "cpu")
    for chunk in CHUNKS.values():
        (encoded,) = codec.encode([chunk])
        assert zstandard.ZstdDecompressor().decompress(encoded.numpy().tobytes()) == chunk.numpy().tobytes()
    (zeros,) = codec.encode([CHUNKS["zeros"]])
    assert zeros.numel() < 100  # runs are still matches
    weights = torch.randn(1 << 18, generator=torch.Generator().manual_seed(2)) * 0.02
    exponents = weights.view(torch.uint8).reshape(-1, 4)[:, 3].contiguous()
    sizes = [c.encode([exponents])[0].numel() for c in (codec, get_codec({"id": "zstd", "level": 1}, "cpu"))]
    assert sizes[0] < 0.95 * sizes[1]


@pytest.mark.parametrize("name", list(CHUNKS))
def test_deflate_is_raw_zlib(name: str) -> None:
    chunk = CHUNKS[name]
    data = chunk.numpy().tobytes()
    (encoded,) = get_codec("deflate", "cpu").encode([chunk])
    assert zlib.decompress(encoded.numpy().tobytes(), wbits=-15) == data
    compressor = zlib.compressobj(9, zlib.DEFLATED, -15)
    foreign = compressor.compress(data) + compressor.flush()
    (decoded,) = get_codec("deflate", "cpu").decode([_u8(foreign)], [chunk.numel()])
    assert torch.equal(decoded, chunk)


def test_deflate_with_a_zlib_header_is_corrupt() -> None:
    wrapped = zlib.compress(b"a" * 100)
    with pytest.raises(CorruptCheckpointError, match="deflate chunk 0 does not decode"):
        get_codec("deflate", "cpu").decode([_u8(wrapped)], [100])


def test_deflate_longer_than_declared_is_corrupt() -> None:
    compressor = zlib.compressobj(6, zlib.DEFLATED, -15)
    stream = compressor.compress(b"b" * 2000) + compressor.flush()
    with pytest.raises(CorruptCheckpointError, match="more data than its declared size, or is cut short"):
        get_codec("deflate", "cpu").decode([_u8(stream)], [1000])
    with pytest.raises(CorruptCheckpointError, match="deflate chunk 0"):
        get_codec("deflate", "cpu").decode([_u8(stream[: len(stream) // 2])], [2000])


@pytest.mark.parametrize("name", list(CHUNKS))
def test_lz4_is_a_bare_lz4_block(name: str) -> None:
    chunk = CHUNKS[name]
    data = chunk.numpy().tobytes()
    (encoded,) = get_codec("lz4", "cpu").encode([chunk])
    assert lz4.block.decompress(encoded.numpy().tobytes(), uncompressed_size=len(data)) == data
    foreign = lz4.block.compress(data, store_size=False, mode="high_compression")
    (decoded,) = get_codec("lz4", "cpu").decode([_u8(foreign)], [chunk.numel()])
    assert torch.equal(decoded, chunk)


def test_raw_is_the_bytes_themselves() -> None:
    chunk = CHUNKS["random"]
    (encoded,) = get_codec("raw", "cpu").encode([chunk])
    assert torch.equal(encoded, chunk)


# --- configuration and registry ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        ("raw", {"id": "raw"}),
        ({"id": "zstd"}, {"id": "zstd", "level": 3}),
        ({"id": "zstd", "level": -5}, {"id": "zstd", "level": -5}),
        ({"id": "zstd", "level": 1, "long_matches_only": True}, {"id": "zstd", "level": 1, "long_matches_only": True}),
        ({"id": "zstd", "long_matches_only": False}, {"id": "zstd", "level": 3}),
        ({"id": "deflate", "level": 9}, {"id": "deflate", "level": 9}),
        ({"id": "deflate", "algorithm_type": 2}, {"id": "deflate", "level": 6, "algorithm_type": 2}),
        ({"id": "lz4"}, {"id": "lz4"}),
    ],
)
def test_config_round_trip(config: dict | str, expected: dict) -> None:
    codec = get_codec(config, "cpu")
    assert isinstance(codec, Codec) and codec.backend == "cpu"
    assert codec.get_config() == expected
    again = get_codec(codec.get_config(), "cpu")
    assert again == codec and hash(again) == hash(codec)


def test_equality_and_repr_follow_the_config() -> None:
    assert get_codec({"id": "zstd", "level": 1}, "cpu") != get_codec({"id": "zstd", "level": 2}, "cpu")
    assert get_codec("zstd", "cpu") != get_codec("deflate", "cpu")
    assert repr(get_codec({"id": "zstd", "level": 7}, "cpu")) == "ZstdCodec(level=7)"


def test_known_ids_are_derived_from_the_codec_classes() -> None:
    assert codec_ids() == {"raw", "zstd", "deflate", "lz4", "ans", "bitcomp", "gdeflate", "cascaded", "ckz-huff"}
    assert gpu_only_ids() == {"ans", "bitcomp", "cascaded"}  # gdeflate: tests/codecs/test_gdeflate_cpu.py
    assert all(has_codec(i, "cpu") for i in CPU_CODECS)
    assert not any(has_codec(i, "cpu") for i in gpu_only_ids())


def test_unknown_id_is_unsupported_format() -> None:
    with pytest.raises(
        UnsupportedFormatError,
        match=r"unknown codec id 'brotli'; this ckptzip knows \['ans', .*'zstd'\]\. Upgrade ckptzip",
    ):
        get_codec({"id": "brotli"}, "cpu")
    with pytest.raises(UnsupportedFormatError, match="unknown codec id None"):
        get_codec({"level": 1}, "cpu")


@pytest.mark.parametrize("codec_id", sorted(gpu_only_ids()))
def test_gpu_only_codec_on_cpu_explains(codec_id: str) -> None:
    with pytest.raises(CodecUnavailableError) as info:
        get_codec({"id": codec_id}, "cpu")
    message = str(info.value)
    assert f"codec {codec_id!r} is GPU-only (NVIDIA nvCOMP) and has no CPU decoder" in message
    assert "`ckptzip convert SRC DST --codec portable`" in message


@pytest.mark.skipif(has_codec("zstd", "cuda"), reason="nvCOMP runs here")
def test_gpu_backend_unavailable_explains() -> None:
    with pytest.raises(CodecUnavailableError, match="codec 'zstd' cannot run on the GPU here: "):
        get_codec("zstd", "cuda")


@pytest.mark.parametrize(
    "config",
    [
        {"id": "zstd", "level": 99},
        {"id": "zstd", "level": "3"},
        {"id": "zstd", "long_matches_only": "yes"},
        {"id": "deflate", "level": -2},
        {"id": "lz4", "acceleration": 4},
        {"id": "raw", "level": 1},
    ],
)
def test_invalid_options_are_corrupt(config: dict) -> None:
    with pytest.raises(CorruptCheckpointError, match=r"codec configuration \{.*\} is invalid: "):
        get_codec(config, "cpu")


def test_register_and_unavailable_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    monkeypatch.setattr(registry, "_UNAVAILABLE", dict(registry._UNAVAILABLE))
    registry._REGISTRY.pop(("lz4", "cpu"))
    registry.mark_unavailable("lz4", "cpu", "the lz4 package is not installed (pip install ckptzip[lz4])")
    assert not has_codec("lz4", "cpu")
    with pytest.raises(
        CodecUnavailableError,
        match=r"codec 'lz4' cannot run on the CPU here: "
        r"the lz4 package is not installed \(pip install ckptzip\[lz4\]\)",
    ):
        get_codec("lz4", "cpu")

    class Lz4Again(ZstdCodec):
        codec_id = "lz4"

    assert registry.register(Lz4Again) is Lz4Again
    assert type(get_codec({"id": "lz4"}, "cpu")) is Lz4Again


# --- GPU interchange (runs on a CUDA machine with nvCOMP) ----------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("codec_id", ["zstd", "deflate", "lz4"])
def test_cpu_and_gpu_bitstreams_interchange(codec_id: str) -> None:
    if not has_codec(codec_id, "cuda"):
        pytest.skip(f"no GPU implementation of {codec_id!r} here")
    cpu, gpu = get_codec(codec_id, "cpu"), get_codec(codec_id, "cuda")
    chunks = [c for c in CHUNKS.values() if c.numel() > 1]
    sizes = [c.numel() for c in chunks]
    from_gpu = [e.cpu() for e in gpu.encode([c.cuda() for c in chunks])]
    assert all(torch.equal(d, c) for d, c in zip(cpu.decode(from_gpu, sizes), chunks))
    from_cpu = [e.cuda() for e in cpu.encode(chunks)]
    assert all(torch.equal(d.cpu(), c) for d, c in zip(gpu.decode(from_cpu, sizes), chunks))


@pytest.mark.gpu
def test_frames_without_short_matches_decode_on_the_gpu() -> None:
    config = {"id": "zstd", "level": 1, "long_matches_only": True}
    if not has_codec("zstd", "cuda"):
        pytest.skip("no GPU implementation of 'zstd' here")
    weights = torch.randn(1 << 18, generator=torch.Generator().manual_seed(2)) * 0.02
    chunks = [c for c in CHUNKS.values() if c.numel() > 1]
    chunks.append(weights.view(torch.uint8).reshape(-1, 4)[:, 3].contiguous())
    from_cpu = [e.cuda() for e in get_codec(config, "cpu").encode(chunks)]
    decoded = get_codec(config, "cuda").decode(from_cpu, [c.numel() for c in chunks])
    assert all(torch.equal(d.cpu(), c) for d, c in zip(decoded, chunks))


def test_zstd_codes_many_tiny_segments_in_one_batch_call() -> None:
    rng = np.random.default_rng(5)
    base = torch.from_numpy(np.repeat(rng.integers(0, 256, 70_000, dtype=np.uint8), 3))
    lengths = rng.integers(1, 700, 300).astype(np.int64)
    offsets = np.cumsum(lengths) - lengths
    codec = ZstdCodec(level=1)
    out, out_offsets, out_lengths = codec.encode_segments(base, offsets, lengths)
    frames = [out[o : o + n].numpy().tobytes() for o, n in zip(out_offsets.tolist(), out_lengths.tolist())]
    assert [zstandard.ZstdDecompressor().decompress(f) for f in frames] == [
        base[o : o + n].numpy().tobytes() for o, n in zip(offsets.tolist(), lengths.tolist())]
    dst = torch.zeros(int(lengths.sum()) + 64, dtype=torch.uint8)
    codec.decode_segments(out, out_offsets, out_lengths, dst, offsets + 64, lengths)
    assert torch.equal(dst[64:], base[: int(lengths.sum())])


@pytest.mark.parametrize("damage", ["garbage", "declares another size"])
def test_a_damaged_chunk_in_a_zstd_batch_is_named(damage: str) -> None:
    codec = ZstdCodec(level=1)
    base = torch.arange(40_000, dtype=torch.int32).view(torch.uint8)
    lengths = np.full(8, 20_000, dtype=np.int64)
    offsets = np.cumsum(lengths) - lengths
    out, out_offsets, out_lengths = codec.encode_segments(base, offsets, lengths)
    raw = lengths.copy()
    if damage == "garbage":
        out[int(out_offsets[5]) : int(out_offsets[5]) + 4] = 0
    else:
        raw[5] -= 1
    dst = torch.empty(int(raw.sum()), dtype=torch.uint8)
    with pytest.raises(CorruptChunkError, match="zstd ") as info:
        codec.decode_segments(out, out_offsets, out_lengths, dst, np.cumsum(raw) - raw, raw)
    assert info.value.chunk == 5


@pytest.mark.parametrize(("extra", "message"), [
    (1, "^zstd data decoded to 5000 bytes, expected 5001$"),
    (-1, "^zstd data does not decode: decompression error: did not decompress full frame$")])
def test_a_zstd_frame_without_a_size_that_decodes_to_another_size_is_named(extra: int, message: str) -> None:
    """Frames of a streaming compressor declare no size: each decodes into exactly its place,
    and one that holds more or fewer bytes than the index says is named."""
    codec = ZstdCodec(level=1)
    pieces = [bytes([i]) * 5000 for i in range(6)]
    frames = [zstandard.ZstdCompressor(write_content_size=False).compress(p) for p in pieces]
    assert zstandard.frame_content_size(frames[0]) == -1
    src = torch.frombuffer(bytearray(b"".join(frames)), dtype=torch.uint8)
    lengths = np.array([len(f) for f in frames], dtype=np.int64)
    raw = np.full(6, 5000, dtype=np.int64)
    dst = torch.full((6 * 5001,), 0xAB, dtype=torch.uint8)
    places = np.arange(6, dtype=np.int64) * 5001  # a byte between the places, left as it was
    codec.decode_segments(src, np.cumsum(lengths) - lengths, lengths, dst, places, raw)
    assert b"".join(dst[int(p) : int(p) + 5000].numpy().tobytes() for p in places) == b"".join(pieces)
    assert dst[5000::5001].tolist() == [0xAB] * 6
    raw[4] += extra
    with pytest.raises(CorruptChunkError, match=message) as info:
        codec.decode_segments(src, np.cumsum(lengths) - lengths, lengths, dst, places, raw)
    assert info.value.chunk == 4


def test_zstd_decodes_many_chunks_straight_into_place_on_several_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_threads, "GROUP_BYTES", 1 << 16)  # many runs of chunks
    codec = ZstdCodec(level=1)
    base = (torch.randn(1 << 20, generator=torch.Generator().manual_seed(3)) * 0.02).view(torch.uint8)
    lengths = np.full(64, 1 << 16, dtype=np.int64)
    offsets = np.arange(64, dtype=np.int64) << 16
    out, out_offsets, out_lengths = codec.encode_segments(base, offsets, lengths)
    dst = torch.zeros(base.numel() + 64 * 8, dtype=torch.uint8)
    with _threads.codec_threads(4):
        codec.decode_segments(out, out_offsets, out_lengths, dst, offsets + 8 * np.arange(64), lengths)
    for k in range(64):
        start = int(offsets[k]) + 8 * k
        assert torch.equal(dst[start : start + (1 << 16)], base[int(offsets[k]) : int(offsets[k]) + (1 << 16)])


# --------------------------------------------------------------------- threads per batch


def test_batches_coded_at_once_split_the_cores_between_them(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CKPTZIP_THREADS", "16")
    assert [batch_share(n) for n in (0, 1, 2, 3, 16, 100)] == [16, 16, 8, 5, 1, 1]
    big = np.full(4, 1 << 20, dtype=np.int64)  # enough work for zstandard's threads
    assert cpu_module._batch_threads(big) == 16
    with _threads.codec_threads(1):
        assert _threads.codec_thread_count() == 1
        assert cpu_module._batch_threads(big) == 0  # the calling thread alone
        with _threads.codec_threads(4):
            assert cpu_module._batch_threads(big) == 4
        assert cpu_module._batch_threads(big) == 0
    assert _threads.codec_thread_count() == 16


def test_a_state_of_many_batches_round_trips_with_the_cores_shared(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CKPTZIP_THREADS", "4")
    monkeypatch.setattr(engine_plan, "SAVE_BATCH_BYTES", {"cuda": 1 << 30, "cpu": 1 << 18})
    monkeypatch.setattr(engine_plan, "LOAD_BATCH_BYTES", {"cuda": 1 << 29, "cpu": 1 << 18})
    shares: list[int] = []
    count = _threads.codec_thread_count
    monkeypatch.setattr(cpu_module, "codec_thread_count", lambda: shares.append(count()) or count())
    g = torch.Generator().manual_seed(0)
    state = {f"w{i}": torch.randn(1 << 16, generator=g) for i in range(8)}  # 8 batches of 256 KiB
    buf = io.BytesIO()
    ckptzip.save(state, buf, codec="zstd")
    got = ckptzip.load(buf.getvalue())
    assert all(torch.equal(got[k].view(torch.uint8), v.view(torch.uint8)) for k, v in state.items())
    assert shares and set(shares) == {1}  # 4 workers on 8 batches: one thread each
