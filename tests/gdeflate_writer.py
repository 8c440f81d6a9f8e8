"""A GDeflate writer for tests: streams of stored and fixed-code blocks with any symbols, and
malformed ones, to check ckptzip's decoder on what nvCOMP's encoders rarely or never write.

The format (ckptzip/codecs/_gdeflate.c): DEFLATE's bits dealt to 32 lanes. An operation puts
fields (value, bits; least significant bit first) on one lane; a lane that then holds fewer than
32 unread bits takes the stream's next 32-bit word. :class:`Lanes` records the operations in the
decoder's order and lays the words out; :func:`fixed_block` and :func:`stored_block` deal a
block's operations as the decoder reads them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

LANES = 32
END = 256


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


def _huffman(code: int, n: int) -> tuple[int, int]:
    """A Huffman code (written most significant bit first) as an LSB-first field."""
    return int(format(code, f"0{n}b")[::-1], 2), n


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


def fixed_block(lanes: Lanes, tokens: list[Token], final: bool = True) -> None:
    """A fixed-code block of ``tokens`` then its end: round-robin from lane 0, a match's distance
    on its lane in the next round."""
    header(lanes, final, 1)
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
                    lanes.op(lane, fixed_code(token))


def expand(tokens: list[Token], into: bytearray) -> None:
    """What ``tokens`` decode to, after ``into``."""
    for token in tokens:
        if isinstance(token, tuple):
            length, distance = token
            for _ in range(length):
                into.append(into[-distance])
        else:
            into.append(token)
