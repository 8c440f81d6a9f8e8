"""The CPU gdeflate codec (ckptzip's decoder, nvCOMP's libnvcomp_cpu encoder through ckptzip's
shim): round trips, damaged input, files, and the absence of either (the decoder's bitstream
tests: test_gdeflate_decoder.py)."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import torch

import ckptzip
from ckptzip import CodecUnavailableError
from ckptzip.codecs import _gdeflate_lib, get_codec, gpu_first_ids, gpu_only_ids, has_codec, registry
from ckptzip.codecs import _threads as codec_threads_module
from ckptzip.codecs import gdeflate_cpu
from ckptzip.codecs.nvcomp import NvcompGdeflateCodec
from ckptzip.engine import policy
from ckptzip.errors import CorruptChunkError
from golden_state import golden_state
from helpers import assert_same

GOLDEN = Path(__file__).parents[1] / "golden"
needs_decoder = pytest.mark.skipif(not has_codec("gdeflate", "cpu"), reason="ckptzip's GDeflate decoder is not built")
needs_library = pytest.mark.skipif(_gdeflate_lib.load()[0] is None or not has_codec("gdeflate", "cpu"),
                                   reason="nvCOMP's CPU library (the encoder) is not installed")
SIZES = [1, 2, 7, 255, 256, 257, 4095, 4096, 65535, 65536]


def _codec(algorithm_type: int = 0) -> gdeflate_cpu.GdeflateCpuCodec:
    codec = get_codec({"id": "gdeflate", "algorithm_type": algorithm_type}, "cpu")
    assert isinstance(codec, gdeflate_cpu.GdeflateCpuCodec)
    return codec


def _data(n: int, kind: str) -> torch.Tensor:
    """``n`` bytes: a uint8 view of bf16 weights, random bytes, or zeros."""
    g = torch.Generator().manual_seed(n)
    if kind == "bf16":
        return (torch.randn(-(-n // 2), generator=g) * 0.02).bfloat16().view(torch.uint8)[:n].clone()
    if kind == "random":
        return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
    return torch.zeros(n, dtype=torch.uint8)


def test_gdeflate_decodes_on_the_cpu_but_is_best_decoded_on_a_gpu() -> None:
    assert "gdeflate" not in gpu_only_ids()
    assert "gdeflate" in gpu_first_ids()


@needs_library
@pytest.mark.parametrize("kind", ["bf16", "random", "zeros"])
def test_round_trip_at_every_edge_size(kind: str) -> None:
    codec = _codec()
    chunks = [_data(n, kind) for n in SIZES]
    coded = codec.encode(chunks)
    if kind == "zeros":
        assert sum(c.numel() for c in coded) < sum(SIZES) // 10
    for got, want in zip(codec.decode(coded, SIZES), chunks):
        assert torch.equal(got, want)


@needs_library
def test_segments_round_trip_in_place_at_odd_offsets() -> None:
    codec = _codec()
    lengths = np.array(SIZES, dtype=np.int64)
    offsets = np.cumsum(lengths + 3) - lengths  # gaps, and odd addresses
    base = _data(int(offsets[-1] + lengths[-1]), "bf16")
    out, out_offsets, sizes = codec.encode_segments(base, offsets, lengths)
    dst = torch.full_like(base, 0xAB)
    codec.decode_segments(out, out_offsets, sizes, dst, offsets, lengths)
    for o, n in zip(offsets.tolist(), lengths.tolist()):
        assert torch.equal(dst[o : o + n], base[o : o + n])
    assert torch.equal(dst[offsets[0] + lengths[0] : offsets[1]], torch.full((3,), 0xAB, dtype=torch.uint8))


@needs_library
def test_many_chunks_on_several_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(codec_threads_module, "GROUP_BYTES", 1 << 17)
    base = _data(300 * 65536 + 123, "bf16")
    lengths = np.minimum(65536, base.numel() - np.arange(0, base.numel(), 65536))
    offsets = np.arange(0, base.numel(), 65536)
    out, out_offsets, sizes = _codec().encode_segments(base, offsets, lengths)
    dst = torch.empty_like(base)
    _codec().decode_segments(out, out_offsets, sizes, dst, offsets, lengths)
    assert torch.equal(dst, base)


@needs_library
@pytest.mark.parametrize("size", [0, 65537])
def test_encoder_rejects_empty_and_oversized_chunks(size: int) -> None:
    with pytest.raises(ValueError, match="encodes chunks of 1 to 65536 bytes; chunk 1 has"):
        _codec().encode([_data(10, "bf16"), _data(size, "bf16")])


@needs_library
def test_a_damaged_chunk_is_named() -> None:
    codec = _codec()
    chunks = [_data(n, "bf16") for n in (4096, 65536, 4096)]
    coded = [c.clone() for c in codec.encode(chunks)]
    coded[1][40:400] = 0xFF
    with pytest.raises(CorruptChunkError, match="gdeflate chunk 1 does not decode on the CPU") as info:
        codec.decode(coded, [4096, 65536, 4096])
    assert info.value.chunk == 1


@needs_library
@pytest.mark.parametrize(("raw", "match"), [
    (5000, "gdeflate chunk 2 decoded to 4096 bytes, expected 5000"),
    (0, "gdeflate chunk 2 declares 0 decoded bytes"),
    (1 << 32, "gdeflate chunk 2 declares 4294967296 decoded bytes"),
])
def test_a_chunk_of_another_size_is_named(raw: int, match: str) -> None:
    codec = _codec()
    chunks = [_data(4096, "bf16") for _ in range(3)]
    coded = codec.encode(chunks)
    src = torch.cat(coded)
    lengths = np.array([c.numel() for c in coded])
    raw_lengths = np.array([4096, 4096, raw])
    dst = torch.empty(int(raw_lengths.sum()), dtype=torch.uint8)
    with pytest.raises(CorruptChunkError, match=match) as info:
        codec.decode_segments(src, np.cumsum(lengths) - lengths, lengths, dst, np.cumsum(raw_lengths) - raw_lengths,
                              raw_lengths)
    assert info.value.chunk == 2


@needs_library
def test_an_empty_stored_chunk_is_named() -> None:
    codec = _codec()
    coded = codec.encode([_data(100, "bf16")])
    with pytest.raises(CorruptChunkError, match="gdeflate chunk 1 is empty") as info:
        codec.decode([coded[0], torch.empty(0, dtype=torch.uint8)], [100, 100])
    assert info.value.chunk == 1


@needs_decoder
def test_garbage_never_crashes_and_is_named() -> None:
    rng = np.random.default_rng(0)
    codec = _codec()
    for _ in range(200):
        junk = torch.from_numpy(rng.integers(0, 256, int(rng.integers(1, 2000)), dtype=np.uint8))
        try:
            (got,) = codec.decode([junk], [65536])
        except CorruptChunkError as exc:
            assert exc.chunk == 0
        else:
            assert got.numel() == 65536


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {"w": torch.randn(300, 1000, generator=g) * 0.02, "m": (torch.randn(70_000, generator=g) * 1e-3).bfloat16(),
            "ids": torch.randint(0, 50_000, (20_000,), generator=g), "tiny": torch.ones(3)}


@needs_library
def test_a_file_coded_with_gdeflate_on_the_cpu_loads_bit_exactly() -> None:
    buffer = io.BytesIO()
    ckptzip.save(_state(), buffer, codec="gdeflate")
    with ckptzip.open(io.BytesIO(buffer.getvalue())) as reader:
        assert {e.name: e.codecs for e in reader.entries()}["w"] == ["gdeflate"]
    assert_same(ckptzip.load(io.BytesIO(buffer.getvalue())), _state())


@needs_library
def test_a_file_whose_float_planes_use_gdeflate_loads_bit_exactly(monkeypatch: pytest.MonkeyPatch) -> None:
    """As a GPU's ``codec="auto"`` stores them: planes, the structured ones in gdeflate (here
    coded on the CPU, by making gdeflate the CPU planner's only float-plane candidate)."""
    monkeypatch.setattr(policy, "_CPU_FLOAT_CANDIDATES", ({"id": "gdeflate", "algorithm_type": 0},))
    buffer = io.BytesIO()
    ckptzip.save(_state(), buffer, codec="auto")
    monkeypatch.undo()
    with ckptzip.open(io.BytesIO(buffer.getvalue())) as reader:
        planes = {e.name: e.codecs for e in reader.entries()}
    assert "gdeflate" in planes["w"] and "raw" in planes["w"], planes
    assert_same(ckptzip.load(io.BytesIO(buffer.getvalue())), _state())


@pytest.fixture
def without_library(monkeypatch: pytest.MonkeyPatch) -> None:
    """The registry as a machine without libnvcomp_cpu (nor a GPU that runs gdeflate) has it."""
    monkeypatch.setattr(_gdeflate_lib, "load", _gdeflate_lib.load.__wrapped__)  # not the cached first try
    monkeypatch.setattr(_gdeflate_lib, "_library_candidates", lambda: ["/nonexistent/libnvcomp_cpu.so.6"])
    _fresh_registry(monkeypatch)


def _fresh_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """gdeflate known to the registry as before its first use, on the CPU only."""
    monkeypatch.setattr(registry, "_REGISTRY", {k: v for k, v in registry._REGISTRY.items() if k[0] != "gdeflate"})
    monkeypatch.setattr(registry, "_UNAVAILABLE", {k: v for k, v in registry._UNAVAILABLE.items()
                                                   if k != ("gdeflate", "cpu")})
    monkeypatch.setattr(registry, "_PENDING", {**{k: v for k, v in registry._PENDING.items() if k != ("gdeflate", "cuda")},
                                               ("gdeflate", "cpu"): gdeflate_cpu._load})
    monkeypatch.setattr(policy, "_codec", policy._codec.__wrapped__)  # no cached codec objects


def _assert_encoder_hint(message: str) -> None:
    assert "codec 'gdeflate' cannot encode on the CPU here: nvCOMP's CPU library libnvcomp_cpu is not found" in message
    assert "pip install ckptzip[gdeflate]" in message
    assert 'code with a CPU codec (codec="auto", "portable" or "zstd") or on a CUDA GPU' in message


@needs_decoder
@pytest.mark.usefixtures("without_library")
def test_without_the_library_the_codec_decodes_and_says_how_to_encode() -> None:
    assert has_codec("gdeflate", "cpu")
    golden = np.load(GOLDEN / "gdeflate_gpu_chunks.npz")
    (got,) = _codec().decode([torch.from_numpy(golden["enc_4096_1"])], [4096])
    assert np.array_equal(got.numpy(), golden["raw_4096"])
    with pytest.raises(CodecUnavailableError) as info:
        _codec().encode([_data(100, "bf16")])
    _assert_encoder_hint(str(info.value))
    with pytest.raises(CodecUnavailableError) as info:
        ckptzip.save(_state(), io.BytesIO(), codec="gdeflate")
    _assert_encoder_hint(str(info.value))


@needs_library
def test_without_the_library_a_gdeflate_file_loads(request: pytest.FixtureRequest) -> None:
    buffer = io.BytesIO()
    ckptzip.save(_state(), buffer, codec="gdeflate")
    request.getfixturevalue("without_library")
    assert_same(ckptzip.load(io.BytesIO(buffer.getvalue())), _state())


def _assert_decoder_hint(message: str) -> None:
    assert "codec 'gdeflate' cannot run on the CPU here: ckptzip was installed without its GDeflate decoder" in message
    assert "where a C compiler (gcc or clang) is at hand" in message
    assert "`ckptzip convert SRC DST --codec portable`" in message


@needs_library
def test_without_the_decoder_the_codec_and_a_gdeflate_file_say_how_to_get_it(monkeypatch: pytest.MonkeyPatch) -> None:
    buffer = io.BytesIO()
    ckptzip.save(_state(), buffer, codec="gdeflate")
    monkeypatch.setattr(gdeflate_cpu, "_decoder", lambda: None)
    _fresh_registry(monkeypatch)
    assert not has_codec("gdeflate", "cpu")
    with pytest.raises(CodecUnavailableError) as info:
        get_codec({"id": "gdeflate", "algorithm_type": 0}, "cpu")
    _assert_decoder_hint(str(info.value))
    with pytest.raises(CodecUnavailableError) as info:
        gdeflate_cpu.GdeflateCpuCodec(0)
    _assert_decoder_hint(str(info.value))
    with pytest.raises(CodecUnavailableError) as info:
        ckptzip.load(io.BytesIO(buffer.getvalue()))
    _assert_decoder_hint(str(info.value))
    assert "tensor 'w'" in str(info.value)


def test_without_the_shim_the_encoder_says_how_to_build_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_gdeflate_lib, "_shim_path", lambda: None)
    library, reason = _gdeflate_lib._load()
    assert library is None and reason is not None
    assert "installed without its GDeflate shim" in reason


def test_the_library_is_found_in_the_environment_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(_gdeflate_lib.ENV_VAR, "/opt/x/libnvcomp_cpu.so.6")
    assert _gdeflate_lib._library_candidates() == ["/opt/x/libnvcomp_cpu.so.6"]
    monkeypatch.delenv(_gdeflate_lib.ENV_VAR)
    assert _gdeflate_lib._library_candidates()[-1] == _gdeflate_lib.SONAME


def test_a_gpu_auto_file_codes_planes_with_huffman_only_gdeflate_in_chunks_a_cpu_decodes() -> None:
    assert policy._PRESET_CODECS[("auto", "cuda")] == {"id": "gdeflate", "algorithm_type": 0}
    assert policy._PRESET_CODECS[("fast", "cuda")]["id"] == "ans"
    assert gdeflate_cpu.GdeflateCpuCodec.chunk_bytes <= gdeflate_cpu.GdeflateCpuCodec.max_chunk_bytes
    auto = policy.Policy.parse("auto")
    assert auto.chunk_bytes_for(NvcompGdeflateCodec(algorithm_type=0)) <= gdeflate_cpu.MAX_DECODE_CHUNK


@needs_library
def test_the_report_says_where_a_gdeflate_file_loads() -> None:
    from ckptzip.report import portability_note

    buffer = io.BytesIO()
    ckptzip.save(_state(), buffer, codec="gdeflate")
    with ckptzip.open(io.BytesIO(buffer.getvalue())) as reader:
        note = portability_note(reader.entries())
    assert note.startswith("loads on a GPU or, for gdeflate, on a CPU where ckptzip was built with its C decoder")
    assert "ckptzip convert SRC DST --codec portable" in note


@needs_decoder
def test_the_golden_file_an_h200_saved_with_auto_loads_on_the_cpu() -> None:
    """tests/golden/gpu_gdeflate_v2_1.ckz: tests/golden_state.py's state on a GPU, saved with
    ``codec="auto"`` (tests/golden/make_golden.py)."""
    path = GOLDEN / "gpu_gdeflate_v2_1.ckz"
    with ckptzip.open(path) as reader:
        entries = {e.name: e for e in reader.entries()}
    assert entries["model.embed.weight"].device == "cuda:0"
    assert entries["model.embed.weight"].codecs == ["raw", "raw", "raw", "gdeflate"]
    assert_same(ckptzip.load(path, map_location="cpu"), golden_state())


def test_gpu_auto_codes_near_constant_planes_with_gdeflate_lz_and_no_other_preset_does() -> None:
    """A Huffman-only coder spends a bit on every byte: XOR deltas of barely moved weights stored
    7.5x at best. Their planes, and other near-constant ones, get gdeflate's LZ pass on the GPU."""
    assert policy.Policy.parse("auto").low_entropy_candidate("cuda") == {"id": "gdeflate", "algorithm_type": 1}
    assert policy.Policy.parse("auto").low_entropy_candidate("cpu") is None
    for name in ("fast", "portable", "gdeflate", "zstd"):
        assert policy.Policy.parse(name).low_entropy_candidate("cuda") is None
    assert 0 < policy.LOW_ENTROPY_BITS < 8 * 0.125 + 1e-9  # below one bit a byte: where Huffman's floor costs


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@needs_library
def test_a_gpu_auto_file_with_near_constant_planes_codes_them_with_lz_and_loads_on_the_cpu() -> None:
    g = torch.Generator(device="cuda").manual_seed(3)
    grads = (torch.randn(1 << 22, generator=g, device="cuda") * 1e-3).bfloat16().float()  # low planes all zero
    weights = torch.randn(1 << 22, generator=g, device="cuda") * 0.02
    state = {"grad": grads, "w": weights}
    buf = io.BytesIO()
    ckptzip.save(state, buf)
    with ckptzip.open(buf.getvalue()) as reader:
        entries = {e.name: e for e in reader.entries()}
    low = [s.codec for s in entries["grad"].streams[:2]]
    assert low == [{"id": "gdeflate", "algorithm_type": 1}] * 2
    assert sum(c.length for s in entries["grad"].streams[:2] for c in s.chunks) < grads.numel() * 2 // 50  # 60x on an H200
    assert entries["w"].streams[3].codec == {"id": "gdeflate", "algorithm_type": 0}  # exponents: Huffman only
    assert_same(ckptzip.load(buf.getvalue(), map_location="cpu"), {k: v.cpu() for k, v in state.items()})
