"""ckptzip's GDeflate decoder (codecs/_gdeflate.c) through the CPU codec: bit-exact on chunks an
H200 and nvCOMP's CPU encoder wrote and on streams of every block type written here
(tests/gdeflate_writer.py, whose streams nvCOMP's CPU decoder reads alike), and every malformed
stream an error naming its chunk."""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import pytest
import torch

from ckptzip.codecs import _gdeflate_lib, get_codec, has_codec
from ckptzip.codecs.gdeflate_cpu import GdeflateCpuCodec
from ckptzip.errors import CorruptChunkError
from gdeflate_writer import (END, Lanes, Token, expand, fixed_block, header, huffman_block, huffman_only, stored_block,
                             weight_planes)

GOLDEN = Path(__file__).parents[1] / "golden"
pytestmark = pytest.mark.skipif(not has_codec("gdeflate", "cpu"), reason="ckptzip's GDeflate decoder is not built")
needs_encoder = pytest.mark.skipif(_gdeflate_lib.load()[0] is None, reason="nvCOMP's CPU library is not installed")


def _codec() -> GdeflateCpuCodec:
    codec = get_codec({"id": "gdeflate", "algorithm_type": 0}, "cpu")
    assert isinstance(codec, GdeflateCpuCodec)
    return codec


def _decode(stream: bytes, raw: int) -> bytes:
    (got,) = _codec().decode([torch.frombuffer(bytearray(stream), dtype=torch.uint8)], [raw])
    return got.numpy().tobytes()


def _fixed(*blocks: list[Token]) -> tuple[bytes, bytes]:
    """A stream of fixed-code blocks, and what it decodes to."""
    lanes, out = Lanes(), bytearray()
    for i, tokens in enumerate(blocks):
        fixed_block(lanes, tokens, final=i == len(blocks) - 1)
        expand(tokens, out)
    return lanes.stream(), bytes(out)


def test_chunks_an_h200_wrote_decode_without_nvcomp() -> None:
    """tests/golden/gdeflate_gpu_chunks.npz: nvCOMP 6.0's GPU encoder, algorithm types 0, 1 and 5."""
    golden = np.load(GOLDEN / "gdeflate_gpu_chunks.npz")
    names = [k for k in golden.files if k.startswith("enc_")]
    assert len(names) == 16
    for name in names:
        raw = golden[f"raw_{name.split('_')[1]}"]
        assert _decode(golden[name].tobytes(), raw.size) == raw.tobytes(), name


@pytest.mark.parametrize("n", [1, 2, 33, 4096, 65_537])
def test_huffman_only_planes_decode_bit_exactly(n: int) -> None:
    for data in weight_planes(n, n).values():
        assert _decode(huffman_only(data), n) == data


@pytest.mark.parametrize("sizes", [[0], [1], [31, 32, 33], [65535, 1000], [0, 5, 0]])
def test_stored_blocks(sizes: list[int]) -> None:
    rng = np.random.default_rng(len(sizes))
    lanes, want = Lanes(), b""
    for i, n in enumerate(sizes):
        data = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        stored_block(lanes, data, final=i == len(sizes) - 1)
        want += data
    if want:
        assert _decode(lanes.stream(), len(want)) == want


def test_fixed_code_blocks_with_matches_of_every_reach() -> None:
    """Literals, matches overlapping their source or not, short and long, run-length ones, 258
    (symbol 284) and Deflate64's long lengths (symbol 285) and far distances (symbols 30, 31),
    matches whose distances come in the block's last round, and an empty block between."""
    rng = np.random.default_rng(0)
    first = [int(x) for x in rng.integers(0, 256, 50_000)]
    second: list[Token] = [(3, 1), (258, 7), (1000, 40_000), 9, (4, 3), (65_538, 49_200), 1, 2, (40, 2),
                           (20, 9), (5, 10), (16, 16), (17, 8), (7, 7), (9, 3)]
    last: list[Token] = [7] * 40 + [(3, 10)] * 5  # five matches in one round: their distances after the end
    stream, want = _fixed(first, second, [], last)
    assert _decode(stream, len(want)) == want


def test_blocks_of_both_kinds_in_one_stream() -> None:
    lanes = Lanes()
    fixed_block(lanes, [1, 2, 3, (10, 3)], final=False)
    stored_block(lanes, b"stored", final=False)
    fixed_block(lanes, [(6, 6)], final=True)
    assert _decode(lanes.stream(), 25) == bytes([1, 2, 3] * 4 + [1]) + b"storedstored"


def _dynamic_header(lanes: Lanes, precode: dict[int, int], hlit: int = 257, hdist: int = 1) -> None:
    """A dynamic block's header with the code-length code of lengths ``precode`` (symbol: length)."""
    order = [16, 17, 18, 0, 8, 7, 9, 6, 10, 5, 11, 4, 12, 3, 13, 2, 14, 1, 15]
    header(lanes, True, 2)
    lanes.op(0, (hlit - 257, 5), (hdist - 1, 5), (19 - 4, 4))
    for lane, symbol in enumerate(order):
        lanes.op(lane, (precode.get(symbol, 0), 3))


def _malformed(name: str) -> tuple[bytes, int]:
    """A stream with the flaw ``name``, and the raw size it declares."""
    lanes = Lanes()
    if name == "block type 3":
        header(lanes, True, 3)
    elif name == "over-subscribed code":
        _dynamic_header(lanes, dict.fromkeys(range(19), 1))
    elif name == "incomplete code":
        _dynamic_header(lanes, {0: 2, 1: 2})
    elif name == "repeat of nothing":
        _dynamic_header(lanes, {0: 1, 16: 1})
        lanes.op(0, (1, 1), (0, 2))  # symbol 16 first
    elif name == "lengths past their count":
        _dynamic_header(lanes, {0: 1, 18: 1})  # 257 + 1 lengths: two runs of 138 zeros
        lanes.op(0, (1, 1), (127, 7))
        lanes.op(1, (1, 1), (127, 7))
    elif name == "symbol 286":
        fixed_block(lanes, [286])
    elif name == "unused half of a one-codeword code":
        _dynamic_header(lanes, {0: 1})
        lanes.op(0, (1, 1))
    elif name == "distance before the start":
        fixed_block(lanes, [5, (3, 2)])
    elif name == "longer than declared":
        stored_block(lanes, bytes(100))
        return lanes.stream(), 99
    elif name == "cut short":
        stored_block(lanes, bytes(range(200)) * 5)
        return lanes.stream()[:300], 1000
    return lanes.stream(), 100


@pytest.mark.parametrize(("name", "why"), [
    ("block type 3", "a block of reserved type 3"),
    ("over-subscribed code", "an over-subscribed or incomplete Huffman code"),
    ("incomplete code", "an over-subscribed or incomplete Huffman code"),
    ("repeat of nothing", "code lengths that repeat nothing or run past their count"),
    ("lengths past their count", "code lengths that repeat nothing or run past their count"),
    ("symbol 286", "a symbol its code does not allow"),
    ("unused half of a one-codeword code", "a symbol its code does not allow"),
    ("distance before the start", "a distance beyond the start of the output"),
    ("longer than declared", "more output than its declared size"),
    ("cut short", "its bits end before its last block does"),
])
def test_a_malformed_stream_is_named_with_its_flaw(name: str, why: str) -> None:
    stream, raw = _malformed(name)
    good, good_raw = _fixed([1, 2, 3])
    chunks = [torch.frombuffer(bytearray(s), dtype=torch.uint8) for s in (good, stream)]
    with pytest.raises(CorruptChunkError) as info:
        _codec().decode(chunks, [len(good_raw), raw])
    assert str(info.value) == f"gdeflate chunk 1 does not decode on the CPU: {why}"
    assert info.value.chunk == 1


def _blocks(kind: str, count: int, data: bytes) -> bytes:
    """``count`` blocks of one kind, each of ``data``."""
    lanes = Lanes()
    for i in range(count):
        final = i == count - 1
        if kind == "dynamic":
            huffman_block(lanes, data, final)
        elif kind == "fixed":
            fixed_block(lanes, list(data), final)
        else:
            stored_block(lanes, data, final)
    return lanes.stream()


@pytest.mark.parametrize(("kind", "count", "data"), [("dynamic", 300, b""), ("dynamic", 300, b"a"),
                                                     ("stored", 3000, b""), ("fixed", 3000, b"")])
def test_blocks_that_decode_next_to_nothing_are_refused_before_they_cost_more_than_their_bytes(
        kind: str, count: int, data: bytes) -> None:
    """8 MiB of empty dynamic blocks took 2.86 s of CPU to reject (each builds its tables): a block
    costs its work, paid by the bytes the chunk reads and decodes, so degenerate blocks are refused
    after a few, at about the speed of ordinary chunks."""
    stream = _blocks(kind, count, data)
    chunks = [torch.frombuffer(bytearray(stream), dtype=torch.uint8)]
    with pytest.raises(CorruptChunkError) as info:
        _codec().decode(chunks, [max(1, count * len(data))])
    assert str(info.value) == ("gdeflate chunk 0 does not decode on the CPU: more blocks than its bytes pay for "
                               "(blocks that decode next to nothing)")


def test_blocks_of_ordinary_sizes_decode_however_many_a_chunk_has() -> None:
    """Dynamic blocks of 2 KiB of weights' exponents each (nvCOMP's encoders write blocks of
    several KiB), stored blocks of 200 bytes, fixed blocks of 40 literals."""
    planes = weight_planes(2048 * 32, 5)["fp32 exponents"]
    rng = np.random.default_rng(6)
    for kind, n, blocks in [("dynamic", 2048, 32), ("stored", 200, 300), ("fixed", 40, 300)]:
        datas = [planes[i * n : (i + 1) * n] if kind == "dynamic" else rng.integers(0, 256, n, np.uint8).tobytes()
                 for i in range(blocks)]
        lanes = Lanes()
        for i, data in enumerate(datas):
            {"dynamic": huffman_block, "stored": stored_block,
             "fixed": lambda lanes, data, final: fixed_block(lanes, list(data), final)}[kind](lanes, data,
                                                                                           i == blocks - 1)
        assert _decode(lanes.stream(), n * blocks) == b"".join(datas), kind


def test_a_stream_ending_early_is_short() -> None:
    lanes = Lanes()
    fixed_block(lanes, [1, 2, END, 3])  # an end of block before the last literal
    with pytest.raises(CorruptChunkError, match="gdeflate chunk 0 decoded to 2 bytes, expected 3"):
        _decode(lanes.stream(), 3)


def _valid_streams() -> list[tuple[bytes, int]]:
    golden = np.load(GOLDEN / "gdeflate_gpu_chunks.npz")
    streams = [(golden[k].tobytes(), golden[f"raw_{k.split('_')[1]}"].size) for k in golden.files
               if k.startswith("enc_") and int(k.split("_")[1]) <= 65537]
    rng = np.random.default_rng(1)
    stream, want = _fixed([int(x) for x in rng.integers(0, 256, 3000)], [(300, 2000), (5, 1), 1, (3, 4)])
    lanes = Lanes()
    stored_block(lanes, bytes(range(256)) * 3)
    return [*streams, (stream, len(want)), (lanes.stream(), 768)]


def test_damaged_streams_never_crash_and_decode_to_their_size_or_fail() -> None:
    """Random bit flips and truncations of valid streams: each decodes into its slot, exactly, or
    raises CorruptChunkError naming it (never a crash, a hang or a write outside the slot)."""
    rng = np.random.default_rng(2)
    codec = _codec()
    failed = 0
    for stream, raw in _valid_streams():
        for trial in range(150):
            data = np.frombuffer(stream, np.uint8).copy()
            if trial % 3 == 0:
                data = data[: int(rng.integers(1, data.size))]
            else:
                bits = rng.integers(0, 8 * data.size, int(rng.integers(1, 8)))
                np.bitwise_xor.at(data, bits // 8, (1 << (bits % 8)).astype(np.uint8))
            slot = torch.full((raw + 64,), 0xA5, dtype=torch.uint8)
            try:
                codec.decode_segments(torch.from_numpy(data), np.array([0]), np.array([data.size]), slot,
                                      np.array([32]), np.array([raw]))
            except CorruptChunkError as exc:
                assert exc.chunk == 0
                failed += 1
            assert bool((slot[:32] == 0xA5).all()) and bool((slot[32 + raw:] == 0xA5).all())
    assert failed > 0


def _nvcomp_decode(stream: bytes, raw: int) -> bytes:
    """nvCOMP's CPU decoder (nvcomp::gdeflate::decompressCPU), called directly: on valid streams
    only, since it throws a C++ exception on others, which no ctypes frame survives."""
    library = ctypes.CDLL(_gdeflate_lib._library_candidates()[0])
    decompress = library._ZN6nvcomp8gdeflate13decompressCPUEPKPKvPKmmPKPvPmSA_
    src, out = np.frombuffer(stream, np.uint8), np.zeros(raw, np.uint8)
    got = (ctypes.c_size_t * 1)()
    decompress((ctypes.c_void_p * 1)(src.ctypes.data), (ctypes.c_size_t * 1)(src.size), ctypes.c_size_t(1),
               (ctypes.c_void_p * 1)(out.ctypes.data), (ctypes.c_size_t * 1)(raw), got)
    return out[: got[0]].tobytes()


@needs_encoder
def test_nvcomps_cpu_decoder_reads_the_streams_written_here_alike() -> None:
    """The writer's (and so the decoder's) reading of the format is nvCOMP's: Huffman-only, stored and fixed
    blocks, Deflate64's long lengths and far distances."""
    streams = [(huffman_only(data), data) for data in weight_planes(65_536, 3).values()]
    streams.append(_fixed([int(x) for x in np.random.default_rng(4).integers(0, 256, 50_000)],
                          [(3, 1), (258, 7), (1000, 40_000), (65_538, 49_200), (40, 2)]))
    lanes = Lanes()
    stored_block(lanes, b"stored", final=False)
    fixed_block(lanes, [(6, 6), 1])
    streams.append((lanes.stream(), b"storedstored\x01"))
    for stream, want in streams:
        assert _nvcomp_decode(stream, len(want)) == want
        assert _decode(stream, len(want)) == want


def _kind(kind: str, n: int, g: torch.Generator) -> torch.Tensor:
    """``n`` bytes of one kind of plane or data."""
    if kind == "fp32 exponents":
        return ((torch.randn(n, generator=g) * 0.02).view(torch.int32) >> 23 & 0xFF).to(torch.uint8)
    if kind == "bf16 sign+exponent":
        return ((torch.randn(n, generator=g) * 0.02).bfloat16().view(torch.int16) >> 8 & 0xFF).to(torch.uint8)
    if kind == "random":
        return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
    if kind == "zeros":
        return torch.zeros(n, dtype=torch.uint8)
    if kind == "runs":
        values = torch.randint(0, 4, (n,), dtype=torch.uint8, generator=g)
        return torch.repeat_interleave(values, torch.randint(1, 40, (n,), generator=g))[:n].contiguous()
    head = torch.randint(0, 256, ((n * 5 + 7) // 8,), dtype=torch.uint8, generator=g)  # far repeats
    return torch.cat([head, head])[:n].contiguous()


@needs_encoder
@pytest.mark.parametrize("kind", ["fp32 exponents", "bf16 sign+exponent", "random", "zeros", "runs", "far repeats"])
def test_what_nvcomps_cpu_encoder_writes_decodes_bit_exactly(kind: str) -> None:
    g = torch.Generator().manual_seed(7)
    sizes = [1, 2, 3, 31, 32, 33, 127, 128, 129, 1000, 4095, 4096, 4097, 30_000, 65_535, 65_536]
    chunks = [_kind(kind, n, g) for n in sizes]
    coded = _codec().encode(chunks)
    for got, want in zip(_codec().decode(coded, sizes), chunks):
        assert torch.equal(got, want)
