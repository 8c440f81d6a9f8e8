"""A GDeflate writer for tests and benchmarks: streams of stored, fixed-code and Huffman-only
blocks with any symbols, and malformed ones, to check ckptzip's decoder on what nvCOMP's encoders
rarely or never write (and, Huffman-only, on what its GPU encoder writes by default).

The format (ckptzip/codecs/_gdeflate.c): DEFLATE's bits dealt to 32 lanes. An operation puts
fields (value, bits; least significant bit first) on one lane; a lane that then holds fewer than
32 unread bits takes the stream's next 32-bit word. :class:`Lanes` records the operations in the
decoder's order and lays the words out; :func:`stored_block`, :func:`fixed_block` and
:func:`huffman_block` deal a block's operations as the decoder reads them.
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

LANES = 32
END = 256
PRECODE_ORDER = [16, 17, 18, 0, 8, 7, 9, 6, 10, 5, 11, 4, 12, 3, 13, 2, 14, 1, 15]
Field = tuple[int, int]


@dataclass
class Lanes:
    """The 32 lanes' bits and the order in which they take words."""

    bits: list[int] = field(default_factory=lambda: [0] * LANES)
    used: list[int] = field(default_factory=lambda: [0] * LANES)  # bits written per lane
    held: list[int] = field(default_factory=lambda: [32] * LANES)  # bits a decoder would hold
    order: list[int] = field(default_factory=list)

    def op(self, lane: int, *fields: tuple[int, int]) -> None:
        for value, n in fields:
            assert 0 <= value < 1 << n
            self.bits[lane] |= value << self.used[lane]
            self.used[lane] += n
            self.held[lane] -= n
        assert self.held[lane] >= 0, "an operation took more bits than a lane holds"
        if self.held[lane] < 32:
            self.order.append(lane)
            self.held[lane] += 32

    def stream(self) -> bytes:
        """One word per lane, then the words in the order the lanes take them."""
        taken = [0] * LANES
        words = []
        for lane in [*range(LANES), *self.order]:
            words.append(self.bits[lane] >> (32 * taken[lane]) & 0xFFFFFFFF)
            taken[lane] += 1
        return b"".join(w.to_bytes(4, "little") for w in words)


def _huffman(code: int, n: int) -> Field:
    """A Huffman code (written most significant bit first) as an LSB-first field."""
    return int(format(code, f"0{n}b")[::-1], 2), n


def code_lengths(counts: dict[int, int], limit: int) -> dict[int, int]:
    """Lengths of a complete prefix code of at most ``limit`` bits for symbols with these counts."""
    if len(counts) == 1:  # a second symbol makes the code complete
        counts = {**counts, min(set(range(2)) - set(counts)): 1}
    heap: list[tuple[int, int, list[int]]] = [(n, s, [s]) for s, n in counts.items()]
    heapq.heapify(heap)
    lens = dict.fromkeys(counts, 0)
    while len(heap) > 1:
        n1, s1, a = heapq.heappop(heap)
        n2, _, b = heapq.heappop(heap)
        for s in a + b:
            lens[s] += 1
        heapq.heappush(heap, (n1 + n2, s1, a + b))
    lens = {s: min(n, limit) for s, n in lens.items()}
    by_count = sorted(lens, key=lambda s: (counts[s], s))  # rarest first
    while sum(2 ** (limit - n) for n in lens.values()) > 2**limit:  # over-subscribed: lengthen a rare short code
        lens[next(s for s in by_count if lens[s] < limit)] += 1
    while (room := 2**limit - sum(2 ** (limit - n) for n in lens.values())) > 0:  # incomplete: shorten a longest code
        lens[max((s for s in lens if 2 ** (limit - lens[s]) <= room), key=lambda s: (lens[s], -counts[s]))] -= 1
    return lens


def canonical(lens: dict[int, int]) -> dict[int, Field]:
    """DEFLATE's canonical code of these lengths, as fields."""
    codes, code, previous = {}, 0, 0
    for s in sorted(lens, key=lambda s: (lens[s], s)):
        code <<= lens[s] - previous
        codes[s], code, previous = _huffman(code, lens[s]), code + 1, lens[s]
    return codes


def fixed_code(symbol: int) -> tuple[int, int]:
    """DEFLATE's fixed literal/length code (RFC 1951, 3.2.6), symbols 286 and 287 included."""
    if symbol < 144:
        return _huffman(0x30 + symbol, 8)
    if symbol < 256:
        return _huffman(0x190 + symbol - 144, 9)
    if symbol < 280:
        return _huffman(symbol - 256, 7)
    return _huffman(0xC0 + symbol - 280, 8)


def length_fields(length: int) -> list[tuple[int, int]]:
    """A match length's symbol and extra bits; above 258, Deflate64's symbol 285 (3 + 16 bits)."""
    if length > 258:
        return [fixed_code(285), (length - 3, 16)]
    for symbol in range(284, 256, -1):
        i = symbol - 257
        extra = 0 if i < 8 else (i >> 2) - 1
        base = i + 3 if i < 8 else ((4 + (i & 3)) << extra) + 3
        if base <= length:
            return [fixed_code(symbol), (length - base, extra)]
    raise ValueError(length)


def distance_fields(distance: int) -> list[tuple[int, int]]:
    """A distance's fixed 5-bit code and extra bits (symbols 30 and 31 as in Deflate64)."""
    for symbol in range(31, -1, -1):
        extra = 0 if symbol < 4 else (symbol >> 1) - 1
        base = symbol + 1 if symbol < 4 else ((2 + (symbol & 1)) << extra) + 1
        if base <= distance:
            return [_huffman(symbol, 5), (distance - base, extra)]
    raise ValueError(distance)


def header(lanes: Lanes, final: bool, block_type: int) -> None:
    lanes.op(0, (int(final), 1), (block_type, 2))


def stored_block(lanes: Lanes, data: bytes, final: bool = True) -> None:
    header(lanes, final, 0)
    lanes.op(0, (len(data), 16))
    for i, byte in enumerate(data):
        lanes.op(i % LANES, (byte, 8))


Token = int | tuple[int, int]  # a literal or a symbol (0-287), or (length, distance)


def _symbols(lanes: Lanes, tokens: list[Token], literal: Callable[[int], Field]) -> None:
    """``tokens`` then the end of the block, round-robin from lane 0: symbols in the code
    ``literal``, a match's length and distance in the fixed codes, the distance on its lane in the
    next round."""
    queue = [*tokens, END]
    distances: dict[int, int] = {}
    while queue or distances:
        for lane in range(LANES):
            if lane in distances:
                lanes.op(lane, *distance_fields(distances.pop(lane)))
            elif queue:
                token = queue.pop(0)
                if isinstance(token, tuple):
                    lanes.op(lane, *length_fields(token[0]))
                    distances[lane] = token[1]
                else:
                    lanes.op(lane, literal(token))


def fixed_block(lanes: Lanes, tokens: list[Token], final: bool = True) -> None:
    """A fixed-code block of ``tokens`` then its end."""
    header(lanes, final, 1)
    _symbols(lanes, tokens, fixed_code)


def _run_length(lens: list[int]) -> list[tuple[int, Field | None]]:
    """Code lengths as code-length symbols: runs of zeros (17, 18) and repeats (16)."""
    items: list[tuple[int, Field | None]] = []
    i = 0
    while i < len(lens):
        run = next((j for j in range(i, len(lens)) if lens[j] != lens[i]), len(lens)) - i
        if lens[i] == 0 and run >= 3:
            n = min(run, 138)
            items.append((18, (n - 11, 7)) if n >= 11 else (17, (n - 3, 3)))
        elif i > 0 and lens[i] == lens[i - 1] and run >= 3:
            n = min(run, 6)
            items.append((16, (n - 3, 2)))
        else:
            n = 1
            items.append((lens[i], None))
        i += n
    return items


def huffman_block(lanes: Lanes, data: bytes, final: bool = True) -> None:
    """A dynamic block of literals only, its code from ``data``'s counts (15 bits at most) and no
    distance code: what nvCOMP's GPU encoder writes with ``algorithm_type`` 0."""
    lens = code_lengths({**Counter(data), END: 1}, 15)
    all_lens = [lens.get(s, 0) for s in range(257)] + [0]  # one distance length, 0: no distance code
    items = _run_length(all_lens)
    pre_lens = code_lengths(dict(Counter(sym for sym, _ in items)), 7)
    count = max(4, 1 + max(i for i, s in enumerate(PRECODE_ORDER) if pre_lens.get(s, 0)))
    header(lanes, final, 2)
    lanes.op(0, (0, 5), (0, 5), (count - 4, 4))
    for lane, symbol in enumerate(PRECODE_ORDER[:count]):
        lanes.op(lane, (pre_lens.get(symbol, 0), 3))
    pre_codes = canonical(pre_lens)
    for i, (symbol, extra) in enumerate(items):
        lanes.op(i % LANES, pre_codes[symbol], *([extra] if extra else []))
    codes = canonical(lens)
    _symbols(lanes, list(data), codes.__getitem__)


def huffman_only(data: bytes) -> bytes:
    """A stream of one Huffman-only block of ``data``, as nvCOMP's GPU encoder writes by default."""
    lanes = Lanes()
    huffman_block(lanes, data)
    return lanes.stream()


def weight_planes(n: int, seed: int) -> dict[str, bytes]:
    """``n`` bytes of each plane a GPU codes Huffman-only, of N(0, 0.02) weights: fp32 exponents,
    bf16 signs and exponents."""
    weights = torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 0.02
    return {"fp32 exponents": (weights.view(torch.int32) >> 23 & 0xFF).to(torch.uint8).numpy().tobytes(),
            "bf16 sign+exponent": (weights.bfloat16().view(torch.int16) >> 8 & 0xFF).to(torch.uint8).numpy().tobytes()}


def expand(tokens: list[Token], into: bytearray) -> None:
    """What ``tokens`` decode to, after ``into``."""
    for token in tokens:
        if isinstance(token, tuple):
            length, distance = token
            for _ in range(length):
                into.append(into[-distance])
        else:
            into.append(token)
