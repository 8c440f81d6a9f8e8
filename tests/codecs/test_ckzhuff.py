"""ckptzip's ckz-huff coder on the CPU (codecs/_ckzhuff.c through codecs/ckzhuff.py): its chunks
are byte for byte those of the specification's reference encoder (tests/ckzhuff_reference.py), it
decodes any valid chunk (the encoder's codes or others), the committed golden chunks decode and
re-encode alike, and every malformed chunk is an error naming its chunk and flaw, never a crash,
a hang or a write outside its slot."""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import sys
from pathlib import Path

import ckzhuff_cases as cases
import ckzhuff_reference as ref
import numpy as np
import pytest
import torch

from ckptzip.codecs import get_codec, has_codec
from ckptzip.codecs.ckzhuff import MAX_CHUNK, CkzHuffCpuCodec
from ckptzip.errors import CorruptChunkError

GOLDEN = Path(__file__).parents[1] / "golden" / "ckzhuff_chunks.npz"
pytestmark = pytest.mark.skipif(not has_codec("ckz-huff", "cpu"), reason="ckptzip's ckz-huff coder is not built")


def _codec() -> CkzHuffCpuCodec:
    codec = get_codec({"id": "ckz-huff"}, "cpu")
    assert isinstance(codec, CkzHuffCpuCodec)
    return codec


def _t(data: bytes | np.ndarray) -> torch.Tensor:
    return torch.frombuffer(bytearray(bytes(data)), dtype=torch.uint8)


def _encode(data: np.ndarray) -> bytes:
    (coded,) = _codec().encode([torch.from_numpy(np.ascontiguousarray(data, dtype=np.uint8))])
    return coded.numpy().tobytes()


def _decode(chunk: bytes, n: int) -> bytes:
    (got,) = _codec().decode([_t(chunk)], [n])
    return got.numpy().tobytes()


SIZES = [1, 2, 3, 15, 16, 17, 31, 33, 511, 512, 513, 1000, 4097, 16_383, 70_001]


@pytest.mark.parametrize("n", SIZES)
def test_chunks_are_the_reference_encoders_byte_for_byte_and_decode(n: int) -> None:
    for kind, data in ref.samples(n, n).items():
        coded = _encode(data)
        assert coded == ref.encode(data.tobytes()), kind
        assert _decode(coded, n) == data.tobytes(), kind
        if n <= 4097:
            assert ref.decode(coded, n) == data.tobytes(), kind


def test_the_forms_a_chunk_takes() -> None:
    constant = _encode(np.full(1000, 7, dtype=np.uint8))
    assert constant == (ref.CONSTANT | 999 << 8).to_bytes(4, "little") + b"\x07"
    noise = np.random.default_rng(0).integers(0, 256, 5000).astype(np.uint8)
    assert _encode(noise) == (ref.STORED | 4999 << 8).to_bytes(4, "little") + noise.tobytes()
    planes = _encode(ref.samples(5000, 0)["fp32 sign+exponent"])
    assert planes[0] == ref.HUFFMAN and len(planes) < 5000 // 2


def test_long_codes_are_limited_to_12_bits_at_no_cost_to_the_rest() -> None:
    """Counts that are Fibonacci numbers make a Huffman tree as deep as it gets (24 here): its
    codes are limited to 12 bits (JPEG Annex K.3), the code stays complete, and the file is the
    reference encoder's."""
    fib = [1, 1]
    while len(fib) < 25:
        fib.append(fib[-1] + fib[-2])
    data = np.repeat(np.arange(25, dtype=np.uint8) * 9, fib)
    np.random.default_rng(1).shuffle(data)
    counts = np.bincount(data, minlength=256)
    assert ref.huffman_depths(counts).max() == 24
    lengths = ref.code_lengths(counts)
    assert lengths.max() == 12 and (1 << (12 - lengths[counts > 0])).sum() == 1 << 12
    coded = _encode(data)
    assert coded == ref.encode(data.tobytes()) and _decode(coded, data.size) == data.tobytes()


def test_equal_counts_are_broken_alike() -> None:
    """Many symbols of equal counts (the tree and the dealing of lengths both meet ties)."""
    rng = np.random.default_rng(2)
    for trial in range(20):
        symbols = rng.choice(256, int(rng.integers(2, 60)), replace=False).astype(np.uint8)
        data = np.repeat(symbols, rng.integers(1, 4, symbols.size) * (1 + trial % 3))
        rng.shuffle(data)
        assert _encode(data) == ref.encode(data.tobytes()), trial


def test_codes_the_encoder_would_not_choose_decode_too() -> None:
    """Any complete code of at most 12 bits that covers the bytes: a flat one, a lopsided one,
    one with lengths for absent bytes."""
    rng = np.random.default_rng(3)
    data = rng.integers(0, 16, 20_000).astype(np.uint8)
    flat = np.zeros(256, dtype=np.int64)
    flat[:16] = 4
    lopsided = np.zeros(256, dtype=np.int64)
    lopsided[:9] = np.arange(1, 10)
    lopsided[9] = 11
    lopsided[10:16] = 12
    assert (1 << (12 - lopsided[lopsided > 0])).sum() == 1 << 12
    extra = np.zeros(256, dtype=np.int64)
    extra[:32] = 5
    for lengths in (flat, lopsided, extra):
        chunk = ref.huffman_chunk(data, lengths)
        assert _decode(chunk, data.size) == data.tobytes()


def _lengths(spec: dict[int, int]) -> np.ndarray:
    """A complete code of ``spec[length]`` symbols of each length, spread over the byte values."""
    lengths = np.zeros(256, dtype=np.int64)
    spread = np.arange(256) * 7 % 256  # distinct bytes: 7 is prime to 256
    lengths[spread[: sum(spec.values())]] = np.repeat(list(spec), list(spec.values()))
    assert (1 << (12 - lengths[lengths > 0])).sum() == 1 << 12
    return lengths


# Codes whose 12-bit table entries hold 3, 2 or 1 symbols (codes of 4, 6, 8 bits), as many as a
# lookup takes (two 1-bit codes: 3, though 12 would fit), and all of these mixed (1 to 12 bits).
LOOKUPS = {
    "3 a lookup": {4: 16},
    "2 a lookup": {6: 64},
    "1 a lookup": {8: 256},
    "1-bit codes": {1: 2},
    "1 to 12 bits": {**{n: 1 for n in range(1, 12)}, 12: 2},
}


@pytest.mark.parametrize("name", sorted(LOOKUPS))
def test_codes_of_every_lookup_width_round_trip(name: str) -> None:
    """The GPU's chunk size (each lane's bytes decoded side by side with seven others, then the
    lane's last bytes one lookup at a time) and short rounds, in one call, each chunk's bytes
    drawn from its code's symbols alike (long codes as often as short ones)."""
    lengths = _lengths(LOOKUPS[name])
    rng = np.random.default_rng(10)
    sizes = [5, 1 << 18, 70_001, 1000]  # a call's staging is sized by its largest chunk
    data = [rng.choice(np.flatnonzero(lengths), n).astype(np.uint8) for n in sizes]
    chunks = [ref.huffman_chunk(d, lengths) for d in data]
    got = _codec().decode([_t(c) for c in chunks], sizes)
    for d, g in zip(data, got):
        assert g.numpy().tobytes() == d.tobytes()
    assert ref.decode(chunks[-1], sizes[-1]) == data[-1].tobytes()


def test_a_chunk_of_the_largest_size_round_trips() -> None:
    data = ref.samples(MAX_CHUNK, 4)["bf16 gradients"]
    coded = _encode(data)
    assert coded[0] == ref.HUFFMAN and _decode(coded, MAX_CHUNK) == data.tobytes()
    with pytest.raises(ValueError, match=f"encodes chunks of 1 to {MAX_CHUNK} bytes; chunk 0 has {MAX_CHUNK + 1}"):
        _codec().encode([torch.zeros(MAX_CHUNK + 1, dtype=torch.uint8)])


def test_golden_chunks_decode_and_encode_alike() -> None:
    """tests/golden/ckzhuff_chunks.npz, written by this encoder (make_golden.py): what a file holds
    keeps decoding, and the encoder keeps writing the same bytes (GPU and CPU agree on them)."""
    golden = np.load(GOLDEN)
    names = sorted(k for k in golden.files if k.startswith("raw_"))
    assert len(names) >= 8
    for name in names:
        raw, coded = golden[name], golden[name.replace("raw_", "enc_")].tobytes()
        assert _decode(coded, raw.size) == raw.tobytes(), name
        assert _encode(raw) == coded, name
        if raw.size <= 8193:
            assert ref.decode(coded, raw.size) == raw.tobytes(), name


@pytest.mark.parametrize(("name", "why"), cases.FLAWED)
def test_a_malformed_chunk_is_named_with_its_flaw(name: str, why: str) -> None:
    chunk, n = cases.malformed(name)
    good = cases.valid()
    with pytest.raises(CorruptChunkError) as info:
        _codec().decode([_t(good), _t(chunk)], [cases.data().size, n])
    assert str(info.value) == f"ckz-huff chunk 1 does not decode: {why}"
    assert info.value.chunk == 1
    with pytest.raises(ref.Malformed):
        ref.decode(chunk, n)


def test_declared_sizes_are_checked_before_anything_is_allocated() -> None:
    with pytest.raises(CorruptChunkError, match=rf"ckz-huff chunk 1 declares {MAX_CHUNK + 1} decoded bytes"):
        _codec().decode([_t(cases.valid()), _t(cases.valid())], [cases.data().size, MAX_CHUNK + 1])


def _fuzz_inputs() -> list[tuple[bytes, int]]:
    inputs = []
    for n, seed in ((700, 6), (5000, 7)):
        for kind in ("fp32 sign+exponent", "skewed", "two symbols", "constant", "random"):
            data = ref.samples(n, seed)[kind]
            inputs.append((ref.encode(data.tobytes()), n))
    return inputs


def test_damaged_chunks_never_crash_and_decode_to_their_size_or_fail() -> None:
    """Random bit flips, byte changes, truncations and random lanes of valid chunks (the CI fuzz
    of the decoder, bounded): each decodes into its slot, exactly, or raises CorruptChunkError
    naming it, and never writes outside its slot."""
    rng = np.random.default_rng(8)
    codec = _codec()
    failed = 0
    for chunk, n in _fuzz_inputs():
        for trial in range(200):
            data = np.frombuffer(chunk, np.uint8).copy()
            if trial % 5 == 0:
                data = data[: int(rng.integers(0, data.size))]
            elif trial % 5 == 4 and data[0] == ref.HUFFMAN:  # random lanes under a valid header
                head = ref.header_size(int(np.unpackbits(data[68:100]).sum()))
                data[head:] = rng.integers(0, 256, data.size - head)
            elif trial % 5 == 1:
                at = rng.integers(0, data.size, int(rng.integers(1, 4)))
                data[at] = rng.integers(0, 256, at.size)
            else:
                bits = rng.integers(0, 8 * data.size, int(rng.integers(1, 8)))
                np.bitwise_xor.at(data, bits // 8, (1 << (bits % 8)).astype(np.uint8))
            slot = torch.full((n + 64,), 0xA5, dtype=torch.uint8)
            src = torch.from_numpy(np.concatenate([data, np.full(16, 0x5A, np.uint8)]))  # bytes beyond the chunk
            try:
                codec.decode_segments(src, np.array([0]), np.array([data.size]), slot, np.array([32]), np.array([n]))
            except CorruptChunkError as exc:
                assert exc.chunk == 0
                failed += 1
            assert bool((slot[:32] == 0xA5).all()) and bool((slot[32 + n :] == 0xA5).all())
    assert failed > 0


def test_damaged_chunks_decode_or_fail_as_the_reference_does() -> None:
    """Chunks whose lanes (625 bytes each) decode mostly side by side, damaged: flipped bits in the
    lanes, a lane's words moved to the next, random lanes. The decoder decodes each to the bytes
    the specification's reference decoder does, or fails with one of its flaws where it fails."""
    rng = np.random.default_rng(11)
    codec = _codec()
    n, outcomes = 20_000, set()
    for kind in ("fp32 sign+exponent", "bf16 gradients", "skewed", "geometric"):
        chunk = np.frombuffer(ref.encode(ref.samples(n, 12)[kind].tobytes()), np.uint8)
        assert chunk[0] == ref.HUFFMAN
        head = ref.header_size(int(np.unpackbits(chunk[68:100]).sum()))
        for trial in range(6):
            data = chunk.copy()
            if trial % 3 == 0:
                bits = rng.integers(8 * head, 8 * data.size, int(rng.integers(1, 4)))
                np.bitwise_xor.at(data, bits // 8, (1 << (bits % 8)).astype(np.uint8))
            elif trial % 3 == 1:
                lane = int(rng.integers(0, ref.LANES - 1))
                words = data[4:68].view("<u2")
                words[lane] -= 1
                words[lane + 1] += 1
            else:
                data[head:] = rng.integers(0, 256, data.size - head)
            try:
                expected: bytes | None = ref.decode(data.tobytes(), n)
            except ref.Malformed:
                expected = None
            slot = torch.full((n + 64,), 0xA5, dtype=torch.uint8)
            try:
                codec.decode_segments(torch.from_numpy(data), np.array([0]), np.array([data.size]), slot,
                                      np.array([32]), np.array([n]))
                got: bytes | None = slot[32 : 32 + n].numpy().tobytes()
            except CorruptChunkError as exc:
                assert str(exc) in {f"ckz-huff chunk 0 does not decode: {why}" for _, why in cases.FLAWED}
                got = None
            assert got == expected, (kind, trial)
            assert bool((slot[:32] == 0xA5).all()) and bool((slot[32 + n :] == 0xA5).all())
            outcomes.add(got is None)
    assert outcomes == {True, False}  # both ways taken


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="guards the chunk's end with mprotect")
def test_reads_stay_within_the_chunk() -> None:
    """Each chunk, valid or damaged, ends where an unreadable page begins: a decoder that read a
    byte past it (a lane's 8-byte windows near the payload's end) would crash the process."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    rng = np.random.default_rng(13)
    codec, n = _codec(), 20_000
    chunks = [np.frombuffer(ref.encode(ref.samples(n, 14)[kind].tobytes()), np.uint8)
              for kind in ("fp32 sign+exponent", "skewed", "two symbols")]
    for chunk in list(chunks):
        damaged = chunk.copy()
        damaged[-64:] = rng.integers(0, 256, 64)  # the last lane's codes
        chunks += [damaged, chunk[:-4]]
    for chunk in chunks:
        pages = -(-chunk.size // mmap.PAGESIZE)
        guarded = mmap.mmap(-1, (pages + 1) * mmap.PAGESIZE)
        buffer = (ctypes.c_char * len(guarded)).from_buffer(guarded)
        guard = ctypes.addressof(buffer) + pages * mmap.PAGESIZE
        assert libc.mprotect(guard, mmap.PAGESIZE, 0) == 0, ctypes.get_errno()  # PROT_NONE
        src = torch.frombuffer(guarded, dtype=torch.uint8)
        at = pages * mmap.PAGESIZE - chunk.size
        src[at : at + chunk.size] = torch.from_numpy(chunk.copy())
        with contextlib.suppress(CorruptChunkError):  # damaged: fails, or decodes to other bytes
            codec.decode_segments(src, np.array([at]), np.array([chunk.size]), torch.empty(n, dtype=torch.uint8),
                                  np.array([0]), np.array([n]))
        assert libc.mprotect(guard, mmap.PAGESIZE, mmap.PROT_READ | mmap.PROT_WRITE) == 0
        del src, buffer
        guarded.close()


def test_chunks_decode_on_the_codec_threads_alike() -> None:
    """A tensor's many chunks decode in groups on ckptzip's CPU threads, each into its place."""
    data = ref.samples(3 << 20, 9)["fp32 sign+exponent"]
    chunks = list(torch.from_numpy(data).split(1 << 16))
    coded = _codec().encode(chunks)
    got = _codec().decode(coded, [c.numel() for c in chunks])
    assert torch.equal(torch.cat(got), torch.from_numpy(data))
