"""An independent implementation of the ``ckz-huff`` bitstream (docs/FORMAT.md, "ckz-huff"), in
Python and NumPy, written from the specification alone: the encoder every ckptzip encoder of the
codec agrees with byte for byte (the C one, ``codecs/_ckzhuff.c``, and the GPU kernels,
``kernels/_ckzhuff_triton.py``), and a strict decoder. Slow; for tests."""

from __future__ import annotations

import heapq

import numpy as np
import torch

LANES = 32
GROUP = 16  # bytes of a lane in each round of LANES * GROUP bytes
MAX_LEN = 12
MAX_CHUNK = 1 << 22
STORED, CONSTANT, HUFFMAN = 0, 1, 2
FIXED_HEADER = 4 + 2 * LANES + 32  # the size word, the lanes' word counts, the presence bitmap


class Malformed(ValueError):
    """A chunk the strict decoder refuses."""


def lane_of(n: int) -> np.ndarray:
    """The lane of each of ``n`` bytes: groups of GROUP bytes dealt to the lanes in turn."""
    return (np.arange(n) // GROUP) % LANES


def huffman_depths(counts: np.ndarray) -> np.ndarray:
    """Depth of each present symbol in the Huffman tree that merges, again and again, the two
    nodes of smallest (weight, id): a leaf's id is its symbol, the k-th merged node's 256 + k."""
    heap = [(int(counts[s]), s) for s in range(256) if counts[s]]
    heapq.heapify(heap)
    parent: dict[int, int] = {}
    node = 256
    while len(heap) > 1:
        w1, a = heapq.heappop(heap)
        w2, b = heapq.heappop(heap)
        parent[a] = parent[b] = node
        heapq.heappush(heap, (w1 + w2, node))
        node += 1
    depths = np.zeros(256, dtype=np.int64)
    for s in range(256):
        if counts[s]:
            x = s
            while x in parent:
                x = parent[x]
                depths[s] += 1
    return depths


def limit(bl: np.ndarray) -> np.ndarray:
    """Counts of codes per length moved to lengths of at most MAX_LEN (JPEG, Annex K.3): two codes
    of the deepest length become one a level up, and a code of the deepest length below that
    splits in two one level down; the code stays complete."""
    bl = bl.copy()
    i = bl.size - 1
    while i > MAX_LEN:
        if bl[i] > 0:
            j = i - 2
            while bl[j] == 0:
                j -= 1
            bl[i] -= 2
            bl[i - 1] += 1
            bl[j + 1] += 2
            bl[j] -= 1
        else:
            i -= 1
    return bl


def code_lengths(counts: np.ndarray) -> np.ndarray:
    """The encoder's code lengths for byte counts of two or more symbols: the Huffman tree's
    depths, limited to MAX_LEN, dealt shortest first to the symbols by decreasing count (equal
    counts: the smaller symbol first)."""
    depths = huffman_depths(counts)
    bl = limit(np.bincount(depths[counts > 0], minlength=32))
    order = sorted(np.flatnonzero(counts).tolist(), key=lambda s: (-int(counts[s]), s))
    lengths = np.zeros(256, dtype=np.int64)
    lengths[order] = np.repeat(np.arange(bl.size), bl)
    return lengths


def canonical_codes(lengths: np.ndarray) -> np.ndarray:
    """DEFLATE's canonical code: symbols in (length, symbol) order take consecutive codes."""
    bl = np.bincount(lengths[lengths > 0], minlength=MAX_LEN + 1)
    next_code = np.zeros(MAX_LEN + 1, dtype=np.int64)
    code = 0
    for n in range(1, MAX_LEN + 1):
        code = (code + (bl[n - 1] if n > 1 else 0)) << 1
        next_code[n] = code
    codes = np.zeros(256, dtype=np.int64)
    for s in range(256):
        if lengths[s]:
            codes[s] = next_code[lengths[s]]
            next_code[lengths[s]] += 1
    return codes


def _lane_bytes(codes: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The codes, most significant bit first, in bytes filled from their most significant bit,
    zero bits up to a multiple of 4 bytes."""
    if not codes.size:
        return np.zeros(0, dtype=np.uint8)
    j = np.arange(MAX_LEN)
    bits = (codes[:, None] >> np.maximum(lengths[:, None] - 1 - j, 0)) & 1
    stream = bits[j < lengths[:, None]].astype(np.uint8)
    stream = np.concatenate([stream, np.zeros(-stream.size % 32, dtype=np.uint8)])
    return np.packbits(stream)


def header_size(symbols: int) -> int:
    return -(-(FIXED_HEADER + (symbols + 1) // 2) // 4) * 4


def encode(data: bytes) -> bytes:
    """One chunk of 1 to MAX_CHUNK bytes, as ckptzip's encoders write it."""
    x = np.frombuffer(data, dtype=np.uint8)
    n = x.size
    assert 1 <= n <= MAX_CHUNK
    counts = np.bincount(x, minlength=256)
    symbols = np.flatnonzero(counts)
    if symbols.size == 1:
        return _word(CONSTANT, n) + bytes([int(symbols[0])])
    chunk = huffman_chunk(x, code_lengths(counts))
    return chunk if len(chunk) < n + 4 else _word(STORED, n) + data


def huffman_chunk(x: np.ndarray, lengths: np.ndarray) -> bytes:
    """The Huffman form of bytes ``x`` with the code of these lengths (any complete code that
    gives every byte of ``x`` a codeword; the encoder's choice or another)."""
    n = x.size
    symbols = np.flatnonzero(lengths)
    codes = canonical_codes(lengths)
    lanes = lane_of(n)
    streams = [_lane_bytes(codes[x[lanes == lane]], lengths[x[lanes == lane]]) for lane in range(LANES)]
    nibbles = lengths[symbols]
    nibbles = np.concatenate([nibbles, np.zeros(nibbles.size % 2, dtype=np.int64)]).reshape(-1, 2)
    head = (_word(HUFFMAN, n) + np.array([b.size // 4 for b in streams], dtype="<u2").tobytes()
            + np.packbits(lengths > 0, bitorder="little").tobytes()
            + (nibbles[:, 0] | nibbles[:, 1] << 4).astype(np.uint8).tobytes())
    head += bytes(-len(head) % 4)
    return head + b"".join(b.tobytes() for b in streams)


def _word(form: int, n: int) -> bytes:
    return (form | (n - 1) << 8).to_bytes(4, "little")


def decode(chunk: bytes, n: int) -> bytes:
    """The ``n`` bytes a chunk holds; ``Malformed`` for anything the specification does not allow."""
    if len(chunk) < 4:
        raise Malformed("shorter than its size word")
    word = int.from_bytes(chunk[:4], "little")
    form, declared = word & 0xFF, (word >> 8) + 1
    if declared != n:
        raise Malformed(f"declares {declared} bytes")
    if form == STORED:
        if len(chunk) != n + 4:
            raise Malformed("stored bytes of another length")
        return chunk[4:]
    if form == CONSTANT:
        if len(chunk) != 5:
            raise Malformed("a constant of another length")
        return chunk[4:5] * n
    if form != HUFFMAN:
        raise Malformed("an unknown form")
    if len(chunk) < FIXED_HEADER:
        raise Malformed("shorter than its header")
    counts = np.frombuffer(chunk[4 : 4 + 2 * LANES], dtype="<u2").astype(np.int64)
    present = np.unpackbits(np.frombuffer(chunk[4 + 2 * LANES : FIXED_HEADER], np.uint8), bitorder="little")
    symbols = np.flatnonzero(present)
    size = header_size(symbols.size)
    if symbols.size < 2 or len(chunk) < size:
        raise Malformed("too few symbols or a short header")
    packed = np.frombuffer(chunk[FIXED_HEADER:size], np.uint8)
    nibbles = np.stack([packed & 15, packed >> 4], axis=1).reshape(-1)
    if nibbles[symbols.size :].any() or any(chunk[FIXED_HEADER + (symbols.size + 1) // 2 : size]):
        raise Malformed("padding that is not zero")
    lengths = np.zeros(256, dtype=np.int64)
    lengths[symbols] = nibbles[: symbols.size]
    if (lengths[symbols] < 1).any() or (lengths > MAX_LEN).any():
        raise Malformed("a code length out of range")
    if int((1 << (MAX_LEN - lengths[symbols])).sum()) != 1 << MAX_LEN:
        raise Malformed("an incomplete or over-subscribed code")
    if size + 4 * int(counts.sum()) != len(chunk):
        raise Malformed("lanes that do not fill the chunk")
    codes = canonical_codes(lengths)
    table = {(int(lengths[s]), int(codes[s])): s for s in symbols}
    out = np.zeros(n, dtype=np.uint8)
    lanes = lane_of(n)
    start = size
    for lane in range(LANES):
        bits = np.unpackbits(np.frombuffer(chunk[start : start + 4 * int(counts[lane])], np.uint8))
        start += 4 * int(counts[lane])
        at = 0
        decoded = []
        for _ in range(int((lanes == lane).sum())):
            code, length = 0, 0
            while (length, code) not in table:
                if length == MAX_LEN or at >= bits.size:
                    raise Malformed("bits that run out")
                code, length, at = code << 1 | int(bits[at]), length + 1, at + 1
            decoded.append(table[(length, code)])
        if bits.size - at >= 32 or bits[at:].any():
            raise Malformed("a lane with bits it does not use")
        out[lanes == lane] = decoded
    return out.tobytes()


def samples(n: int, seed: int) -> dict[str, np.ndarray]:
    """``n`` bytes of each kind a chunk may hold (planes of weights and gradients, skewed and
    sparse bytes, noise, a constant)."""
    rng = np.random.default_rng(seed)
    g = torch.Generator().manual_seed(seed)
    weights = torch.randn(n, generator=g) * 0.02
    gradients = (torch.randn(n, generator=g) * torch.randn(n, generator=g).exp() * 1e-2).bfloat16()
    return {
        "fp32 sign+exponent": (weights.view(torch.int32) >> 24 & 0xFF).to(torch.uint8).numpy(),
        "bf16 gradients": (gradients.view(torch.int16) >> 8 & 0xFF).to(torch.uint8).numpy(),
        "two symbols": rng.integers(0, 2, n).astype(np.uint8) * 0x80,
        "skewed": np.minimum(rng.zipf(1.3, n), 255).astype(np.uint8),
        "geometric": (rng.geometric(0.2, n) % 256).astype(np.uint8),
        "random": rng.integers(0, 256, n).astype(np.uint8),
        "constant": np.full(n, 0x3C, dtype=np.uint8),
        "sparse bitmap": np.packbits(rng.random(8 * n) < 0.01, bitorder="little")[:n],
    }
