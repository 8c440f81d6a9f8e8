"""GPU codecs (nvCOMP): registration and errors on any machine; bit-exact round trips and
CPU interchange on a CUDA machine with nvCOMP >= 6 (``pytest -m gpu``)."""

from __future__ import annotations

import ctypes.util
import importlib.util
import types
import zlib
from collections.abc import Callable

import pytest
import torch
import zstandard

from ckptzip.codecs import Codec, codec_ids, get_codec, has_codec
from ckptzip.codecs import _nvcomp_lib
from ckptzip.codecs import nvcomp as gpu
from ckptzip.errors import CodecUnavailableError, CorruptCheckpointError

needs_nvcomp = pytest.mark.skipif(
    gpu.UNAVAILABLE_REASON is not None, reason=f"GPU codecs unavailable: {gpu.UNAVAILABLE_REASON}"
)

# ----------------------------------------------------------------------- any machine


def test_every_gpu_codec_id_is_registered_or_marked_unavailable() -> None:
    assert {cls.codec_id for cls in gpu.CODECS} == codec_ids() - {"raw", "ckz-huff"}  # ckz-huff: kernels/ckzhuff.py
    for cls in gpu.CODECS:
        assert has_codec(cls.codec_id, "cuda") == (gpu.UNAVAILABLE_REASON is None)
        assert cls.backend == "cuda"
        assert {"max_chunk_bytes", "alignment"} <= set(vars(cls))  # the format's own, not Codec's defaults


@pytest.mark.skipif(gpu.UNAVAILABLE_REASON is None, reason="the GPU codecs are available here")
@pytest.mark.parametrize("codec_id", ["ans", "zstd"])
def test_unavailable_codec_error_names_codec_reason_and_fix(codec_id: str) -> None:
    with pytest.raises(CodecUnavailableError) as info:
        get_codec(codec_id, "cuda")
    assert str(info.value) == f"codec {codec_id!r} cannot run on the GPU here: {gpu.UNAVAILABLE_REASON}."
    if _nvcomp_lib.load()[1] is not None:
        assert "is not usable here" in str(info.value) and "pip install ckptzip[gpu]" in str(info.value)


@pytest.mark.skipif(gpu.UNAVAILABLE_REASON is None, reason="the GPU codecs are available here")
def test_unavailable_codec_refuses_work_but_not_an_empty_batch() -> None:
    codec = gpu.NvcompAnsCodec()
    assert codec.encode([]) == []
    assert codec.decode([], []) == []
    with pytest.raises(CodecUnavailableError, match=r"^codec 'ans' cannot run on the GPU here: "):
        codec.encode([torch.zeros(4, dtype=torch.uint8)])


def test_unavailability_reasons() -> None:
    assert gpu._why_unavailable(True, None) is None
    assert gpu._why_unavailable(True, "nvcomp is broken") == "nvcomp is broken"
    assert gpu._why_unavailable(False, None) == "no CUDA device is visible (torch.cuda.is_available() is False)"
    assert gpu._why_unavailable(False, "nvcomp is broken") == (
        "nvcomp is broken and no CUDA device is visible (torch.cuda.is_available() is False)"
    )


def test_nvcomp_library_not_found(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(_nvcomp_lib.ENV_VAR, "/nonexistent/libnvcomp.so.6")
    lib, problem = _nvcomp_lib._load()
    assert lib is None
    assert problem is not None and problem.startswith(
        "nvCOMP's library libnvcomp.so.6 is not usable here (/nonexistent/libnvcomp.so.6: cannot open shared object file")


def test_a_library_that_is_not_nvcomp_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    libm = ctypes.util.find_library("m")
    if libm is None:
        pytest.skip("no libm to stand in for another library")
    monkeypatch.setenv(_nvcomp_lib.ENV_VAR, libm)
    assert _nvcomp_lib._load() == (
        None, f"nvCOMP's library libnvcomp.so.6 is not usable here ({libm} is not nvCOMP's library "
              "(it has no nvcompGetProperties))")


def test_nvcomp_versions() -> None:
    assert _nvcomp_lib.version_problem("lib.so", 6000) is None
    assert _nvcomp_lib.version_problem("lib.so", 7102) is None
    assert _nvcomp_lib.version_problem("lib.so", 5301) == "lib.so is nvCOMP 5.3.1, older than the 6.0 ckptzip needs"


def test_a_missing_library_comes_with_the_install_hint(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_nvcomp_lib, "load", lambda: (None, "it is gone"))
    assert gpu._load_library() == (None, "it is gone; pip install ckptzip[gpu], or ckptzip[gpu-cu13] for CUDA 13")


@pytest.mark.skipif(importlib.util.find_spec("nvidia.libnvcomp") is None, reason="nvidia-libnvcomp is not installed")
def test_the_installed_library_takes_every_format_s_options_without_a_gpu() -> None:
    lib, problem = _nvcomp_lib._load()
    assert problem is None and lib is not None
    for cls in gpu.CODECS:
        assert lib.max_output_chunk_bytes(cls()._format, 1 << 16) >= 1 << 16
    # the option structs reach nvCOMP by value: ANS bounds its output by the data type it codes
    bytes_bound = lib.max_output_chunk_bytes(gpu.NvcompAnsCodec()._format, 1 << 20)
    assert lib.max_output_chunk_bytes(gpu.NvcompAnsCodec("<f4")._format, 1 << 20) < bytes_bound


def test_option_structs_are_nvcomp_s_64_bytes() -> None:
    with pytest.raises(ValueError, match=r"^nvCOMP Gdeflate: option structs are 64 bytes$"):
        _nvcomp_lib.Format("Gdeflate", bytes(60), bytes(64))
    assert gpu.NvcompGdeflateCodec(0)._format == _nvcomp_lib.Format("Gdeflate", bytes(64), bytes(64))


@pytest.mark.parametrize(
    ("codec", "config"),
    [
        (gpu.NvcompZstdCodec(), {"id": "zstd"}),
        (gpu.NvcompDeflateCodec(), {"id": "deflate", "algorithm_type": 1}),
        (gpu.NvcompLz4Codec(), {"id": "lz4"}),
        (gpu.NvcompAnsCodec(), {"id": "ans", "data_type": "|u1"}),
        (gpu.NvcompBitcompCodec(), {"id": "bitcomp", "algorithm_type": 0, "data_type": "|u1"}),
        (gpu.NvcompGdeflateCodec(0), {"id": "gdeflate", "algorithm_type": 0}),
        (gpu.NvcompCascadedCodec("<u4"), {"id": "cascaded", "data_type": "<u4"}),
    ],
)
def test_config_round_trip(codec: gpu._NvcompCodec, config: dict) -> None:
    assert codec.get_config() == config
    assert type(codec).from_config(config) == codec


def test_cpu_codec_configs_are_accepted_and_gpu_configs_read_on_the_cpu() -> None:
    assert gpu.NvcompZstdCodec.from_config({"id": "zstd", "level": 19}) == gpu.NvcompZstdCodec()
    assert gpu.NvcompZstdCodec.from_config({"id": "zstd", "level": 1, "long_matches_only": True}) == gpu.NvcompZstdCodec()
    assert gpu.NvcompDeflateCodec.from_config({"id": "deflate", "level": 9}) == gpu.NvcompDeflateCodec()
    for cls in (gpu.NvcompZstdCodec, gpu.NvcompDeflateCodec, gpu.NvcompLz4Codec):
        if has_codec(cls.codec_id, "cpu"):
            assert get_codec(cls().get_config(), "cpu").codec_id == cls.codec_id


LEVELS = "algorithm_type must be one of [0, 1, 2, 3, 4, 5]"


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"id": "ans", "data_type": "<f8"}, "codec 'ans' option data_type must be one of ['|u1', '<f2', '<f4'], got '<f8'"),
        ({"id": "deflate", "algorithm_type": 6}, f"codec 'deflate' option {LEVELS}, got 6"),
        ({"id": "gdeflate", "algorithm_type": 1.0}, f"codec 'gdeflate' option {LEVELS}, got 1.0"),
        ({"id": "bitcomp", "algorithm_type": True}, "codec 'bitcomp' option algorithm_type must be one of [0, 1], got True"),
        ({"id": "cascaded", "data_type": "<f4"}, "codec 'cascaded' option data_type must be one of ['|u1', '<u2', '<u4'], got '<f4'"),
        ({"id": "lz4", "level": 1}, "codec 'lz4' on the GPU has no option(s) ['level']; it takes no options"),
        ({"id": "ans", "type": "<f4"}, "codec 'ans' on the GPU has no option(s) ['type']; it takes ['data_type']"),
    ],
)
def test_invalid_options_are_rejected(config: dict, message: str) -> None:
    cls = next(c for c in gpu.CODECS if c.codec_id == config["id"])
    with pytest.raises(ValueError) as info:
        cls.from_config(config)
    assert str(info.value) == message


def test_aligned_packing_and_views() -> None:
    assert gpu._slots([5, 16, 1], 8) == ([0, 8, 24], 32)
    chunks = [torch.arange(n, dtype=torch.uint8) + n for n in (5, 16, 1)]
    packed, offsets = gpu._pack(chunks, [5, 16, 1], 8)
    assert offsets == [0, 8, 24] and packed.numel() == 32
    views = gpu._views(packed, offsets, [5, 16, 1])
    assert all(torch.equal(v, c) and v.data_ptr() - packed.data_ptr() == o for v, c, o in zip(views, chunks, offsets))


# ------------------------------------------------------------------- CUDA + nvCOMP

CONFIGS = [
    {"id": "zstd"},
    {"id": "deflate", "algorithm_type": 0},
    {"id": "deflate"},
    {"id": "lz4"},
    {"id": "ans"},
    {"id": "ans", "data_type": "<f2"},
    {"id": "ans", "data_type": "<f4"},
    {"id": "bitcomp"},
    {"id": "bitcomp", "algorithm_type": 1},
    {"id": "bitcomp", "data_type": "<f4"},
    {"id": "gdeflate", "algorithm_type": 0},
    {"id": "gdeflate"},
    {"id": "cascaded"},
    {"id": "cascaded", "data_type": "<u4"},
]


def _bytes(kind: str, n: int) -> torch.Tensor:
    """``n`` bytes (a multiple of 4) of one kind of data, on the GPU."""
    g = torch.Generator(device="cuda").manual_seed(n)
    if kind == "random":
        return torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda", generator=g)
    if kind == "zeros":
        return torch.zeros(n, dtype=torch.uint8, device="cuda")
    if kind == "constant":
        return torch.full((n,), 0x5A, dtype=torch.uint8, device="cuda")
    if kind == "float32":
        return (torch.randn(n // 4, device="cuda", generator=g) * 0.02).view(torch.uint8)
    assert kind == "bfloat16"
    return (torch.randn(n // 2, device="cuda", generator=g) * 0.02).to(torch.bfloat16).view(torch.uint8)


def _split(data: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    return list(data[: sum(sizes)].split(sizes))


def _round_trip(codec: Codec, chunks: list[torch.Tensor]) -> list[torch.Tensor]:
    encoded = codec.encode(chunks)
    assert len(encoded) == len(chunks)
    for e in encoded:
        assert e.is_cuda and e.dtype == torch.uint8 and e.dim() == 1 and e.numel() > 0
    decoded = codec.decode(encoded, [c.numel() for c in chunks])
    for i, (d, c) in enumerate(zip(decoded, chunks)):
        assert d.is_cuda and d.dtype == torch.uint8 and d.numel() == c.numel()
        assert torch.equal(d, c), f"chunk {i} differs after the round trip"
    return encoded


@pytest.mark.gpu
@needs_nvcomp
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "-".join(map(str, c.values())))
@pytest.mark.parametrize("kind", ["random", "zeros", "constant", "float32", "bfloat16"])
def test_batched_round_trip_is_bit_exact(config: dict, kind: str) -> None:
    codec = get_codec(config, "cuda")
    sizes = [1 << 16, 1 << 16, 1 << 18, 4000, 1 << 16]  # full chunks, a larger one and a tail
    _round_trip(codec, _split(_bytes(kind, 1 << 20), sizes))


@pytest.mark.gpu
@needs_nvcomp
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "-".join(map(str, c.values())))
def test_tiny_chunks_round_trip(config: dict) -> None:
    codec = get_codec(config, "cuda")
    itemsize = gpu._ITEMSIZE[config.get("data_type", "|u1")]
    sizes = [n for n in (1, 3, 4, 8, 12, 16, 100, 4096) if n % itemsize == 0]
    data = _bytes("float32", 8192)
    _round_trip(codec, _split(data, sizes))
    _round_trip(codec, [data[:itemsize]])  # a batch of one element


@pytest.mark.gpu
@needs_nvcomp
@pytest.mark.parametrize("config", [{"id": "ans"}, {"id": "zstd"}, {"id": "lz4"}])
def test_unaligned_and_unrelated_chunks_are_packed(config: dict) -> None:
    codec = get_codec(config, "cuda")
    big = _bytes("float32", 1 << 18)
    chunks = [big[1:40001], big[50003:60000], _bytes("bfloat16", 8192)]  # odd offsets, two allocations
    encoded = _round_trip(codec, chunks)
    # Compressed chunks cut at arbitrary offsets of one buffer, as a reader loads them.
    joined = torch.cat(encoded)
    stored = list(joined.split([e.numel() for e in encoded]))
    decoded = codec.decode(stored, [c.numel() for c in chunks])
    assert all(torch.equal(d, c) for d, c in zip(decoded, chunks))


@pytest.mark.gpu
@needs_nvcomp
def test_launches_whose_scratch_would_not_fit_are_cut_and_stay_bit_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    """nvCOMP's zstd asks scratch for every chunk of a launch (on an H200, 0.76 MiB a chunk to
    decompress, 3 GiB for a 1 GiB batch): where that would not fit, a batch is coded in launches
    of as many chunks as do, through one scratch buffer."""
    codec = get_codec({"id": "zstd"}, "cuda")
    lib = _nvcomp_lib.load()[0]
    assert lib is not None
    sizes = [1 << 16] * 40 + [4000]
    chunks = _split(_bytes("float32", 41 << 16), sizes)
    one = codec.scratch_bytes(1 << 16, decompress=True)
    assert one > 0 and codec.scratch_bytes(1 << 16) > 0
    # the auto preset's plane codec asks none, its LZ pass a little
    assert get_codec({"id": "gdeflate", "algorithm_type": 0}, "cuda").scratch_bytes(1 << 16) == 0
    assert get_codec({"id": "gdeflate", "algorithm_type": 1}, "cuda").scratch_bytes(1 << 16) < 1 << 20
    launches: list[int] = []
    real = type(lib).decompress

    def counted(self: object, fmt: object, *args: int) -> None:
        launches.append(args[4])  # the chunks of this launch
        real(self, fmt, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(type(lib), "decompress", counted)
    monkeypatch.setattr(gpu, "_SCRATCH_STEP", 0)  # allowed: a one-chunk launch's scratch, or a quarter of the room
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (0, 1 << 40))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 0)
    encoded = codec.encode(chunks)
    decoded = codec.decode(encoded, sizes)
    assert all(torch.equal(d, c) for d, c in zip(decoded, chunks))
    assert len(launches) == len(sizes) and set(launches) == {1}
    monkeypatch.setattr(gpu, "_SCRATCH_STEP", 128 << 20)
    launches.clear()
    assert all(torch.equal(d, c) for d, c in zip(codec.decode(encoded, sizes), chunks))
    assert launches == [len(sizes)]


@pytest.mark.gpu
@needs_nvcomp
def test_a_side_stream_codes_on_that_stream() -> None:
    codec = gpu.NvcompAnsCodec()
    data = _bytes("float32", 1 << 20)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        _round_trip(codec, _split(data, [1 << 18] * 4))
    torch.cuda.synchronize()


# Cross-backend: each GPU stream is a standard stream of its format, and back.

def _host(t: torch.Tensor) -> bytes:
    return t.cpu().numpy().tobytes()


def _device(b: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(b), dtype=torch.uint8).cuda()


def _zlib_raw(data: bytes) -> bytes:
    compressor = zlib.compressobj(6, zlib.DEFLATED, -15)
    return compressor.compress(data) + compressor.flush()


def _lz4_block() -> types.ModuleType:
    return pytest.importorskip("lz4.block")


CPU_FORMATS: dict[str, tuple[Callable[[bytes], bytes], Callable[[bytes, int], bytes]]] = {
    "zstd": (
        lambda raw: zstandard.ZstdCompressor(level=3).compress(raw),
        lambda comp, n: zstandard.ZstdDecompressor().decompress(comp, max_output_size=n),
    ),
    "deflate": (_zlib_raw, lambda comp, n: zlib.decompress(comp, wbits=-15)),
    "lz4": (
        lambda raw: _lz4_block().compress(raw, store_size=False),
        lambda comp, n: _lz4_block().decompress(comp, uncompressed_size=n),
    ),
}
INTERCHANGE_SIZES = [1 << 16, 1 << 18, 1 << 20, 12345]


@pytest.mark.gpu
@needs_nvcomp
@pytest.mark.parametrize(
    "config", [{"id": "zstd"}, {"id": "deflate"}, {"id": "deflate", "algorithm_type": 0}, {"id": "lz4"}]
)
def test_gpu_streams_decode_on_the_cpu(config: dict) -> None:
    _, cpu_decode = CPU_FORMATS[config["id"]]
    chunks = _split(_bytes("bfloat16", sum(INTERCHANGE_SIZES) + 3), INTERCHANGE_SIZES)
    encoded = get_codec(config, "cuda").encode(chunks)
    for i, (e, c) in enumerate(zip(encoded, chunks)):
        assert cpu_decode(_host(e), c.numel()) == _host(c), f"chunk {i} of {c.numel()} bytes"
    if has_codec(config["id"], "cpu"):  # and through the CPU codec the reader uses
        cpu = get_codec(config, "cpu")
        decoded = cpu.decode([e.cpu() for e in encoded], [c.numel() for c in chunks])
        assert all(torch.equal(d, c.cpu()) for d, c in zip(decoded, chunks))


@pytest.mark.gpu
@needs_nvcomp
@pytest.mark.parametrize("codec_id", ["zstd", "deflate", "lz4"])
def test_cpu_streams_decode_on_the_gpu(codec_id: str) -> None:
    cpu_encode, _ = CPU_FORMATS[codec_id]
    chunks = _split(_bytes("float32", sum(INTERCHANGE_SIZES) + 3), INTERCHANGE_SIZES)
    stored = [_device(cpu_encode(_host(c))) for c in chunks]
    decoded = get_codec(codec_id, "cuda").decode(stored, [c.numel() for c in chunks])
    for i, (d, c) in enumerate(zip(decoded, chunks)):
        assert torch.equal(d, c), f"chunk {i} of {c.numel()} bytes"


# Errors


@pytest.mark.gpu
@needs_nvcomp
def test_encode_rejects_what_it_cannot_code() -> None:
    zstd = gpu.NvcompZstdCodec()
    ok = torch.zeros(8, dtype=torch.uint8, device="cuda")
    cases: list[tuple[gpu._NvcompCodec, list[torch.Tensor], str]] = [
        (zstd, [ok, ok[:0]], "codec 'zstd' (cuda) needs non-empty chunks; chunk 1 has 0 bytes"),
        (
            gpu.NvcompLz4Codec(),
            [torch.zeros((1 << 24) + 1, dtype=torch.uint8, device="cuda")],
            "codec 'lz4' (cuda) takes chunks of at most 16777216 bytes; chunk 0 has 16777217: use smaller chunks",
        ),
        (
            gpu.NvcompAnsCodec("<f4"),
            [ok, ok[:6]],
            "codec 'ans' (cuda) with data_type '<f4' needs chunks of whole 4-byte elements; chunk 1 has 6 bytes",
        ),
        (
            zstd,
            [ok, ok.cpu()],
            f"codec 'zstd' (cuda) takes 1-D contiguous torch.uint8 tensors on one CUDA device ({ok.device} for "
            "chunk 0); chunk 1 is a 1-D torch.uint8 tensor on cpu",
        ),
        (
            zstd,
            [ok.view(torch.int32)],
            f"codec 'zstd' (cuda) takes 1-D contiguous torch.uint8 tensors on one CUDA device ({ok.device} for "
            f"chunk 0); chunk 0 is a 1-D torch.int32 tensor on {ok.device}",
        ),
    ]
    for codec, chunks, message in cases:
        with pytest.raises(ValueError) as info:
            codec.encode(chunks)
        assert str(info.value) == message


@pytest.mark.gpu
@needs_nvcomp
def test_decode_rejects_mismatched_or_empty_input() -> None:
    codec = gpu.NvcompZstdCodec()
    encoded = codec.encode([torch.ones(64, dtype=torch.uint8, device="cuda")])
    with pytest.raises(ValueError, match=r"^codec 'zstd': 1 chunks but 2 raw sizes$"):
        codec.decode(encoded, [64, 64])
    with pytest.raises(CorruptCheckpointError, match=r"^zstd chunk 1 is empty; a compressed chunk has bytes$"):
        codec.decode([encoded[0], encoded[0][:0]], [64, 64])
    empty = r"^codec 'zstd' \(cuda\) needs non-empty chunks; chunk 0 decodes to 0 bytes$"
    with pytest.raises(CorruptCheckpointError, match=empty):
        codec.decode(encoded, [0])


@pytest.mark.gpu
@needs_nvcomp
@pytest.mark.parametrize("delta", [-1, 1])
def test_decode_names_the_chunk_of_another_size(delta: int) -> None:
    raw = _bytes("float32", 1000)
    frame = _device(zstandard.ZstdCompressor(write_content_size=True).compress(_host(raw)))
    with pytest.raises(CorruptCheckpointError, match=r"^zstd chunk 1 (does not decode on the GPU|decoded to)"):
        gpu.NvcompZstdCodec().decode([frame, frame], [1000, 1000 + delta])
