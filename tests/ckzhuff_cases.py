"""ckz-huff chunks with one flaw each, and the flaw each decoder names (the CPU's tests and the
GPU's share them)."""

from __future__ import annotations

import numpy as np

import ckzhuff_reference as ref

FLAWED = [
    ("short", "fewer than 4 bytes"),
    ("other size", "a size word declaring another decoded size"),
    ("unknown form", "an unknown form"),
    ("stored, short", "stored bytes of another length than declared"),
    ("constant of two", "a constant of more than one byte"),
    ("one symbol", "a code of fewer than 2 symbols, or a header longer than the chunk"),
    ("header past the end", "a code of fewer than 2 symbols, or a header longer than the chunk"),
    ("padding", "header padding that is not zero"),
    ("the last length's other half", "header padding that is not zero"),
    ("length 0", "a code length outside 1 to 12"),
    ("incomplete", "an incomplete or over-subscribed code"),
    ("over-subscribed", "an incomplete or over-subscribed code"),
    ("lanes past the end", "lane lengths that do not add up to the chunk"),
    ("a word too many", "a lane whose codes do not fill its words exactly"),
    ("padding bits", "a lane whose codes do not fill its words exactly"),
    ("lane cut short", "a lane whose codes do not fill its words exactly"),
]


def data() -> np.ndarray:
    """21 symbols (an odd number: the code's last byte and its padding), 3003 bytes."""
    plane = np.repeat(np.arange(21, dtype=np.uint8) * 3, 13 * np.arange(1, 22))
    np.random.default_rng(5).shuffle(plane)
    return plane


def valid() -> bytes:
    return ref.encode(data().tobytes())


def _with(chunk: bytes, at: int, value: bytes) -> bytes:
    return chunk[:at] + value + chunk[at + len(value) :]


def malformed(name: str) -> tuple[bytes, int]:
    """A chunk with one flaw, and the size the index would declare."""
    good, plane = valid(), data()
    n = plane.size
    lengths = ref.code_lengths(np.bincount(plane, minlength=256))
    symbols = int((lengths > 0).sum())
    head = ref.header_size(symbols)
    if name == "short":
        return good[:3], n
    if name == "other size":
        return good, n + 1
    if name == "unknown form":
        return _with(good, 0, b"\x03"), n
    if name == "stored, short":
        return (ref.STORED | (n - 1) << 8).to_bytes(4, "little") + bytes(n - 1), n
    if name == "constant of two":
        return (ref.CONSTANT | (n - 1) << 8).to_bytes(4, "little") + b"\x01\x02", n
    if name == "one symbol":
        return ref._word(ref.HUFFMAN, n) + bytes(64) + b"\x01" + bytes(31) + b"\x01" + bytes(3), n
    if name == "header past the end":
        return good[: ref.FIXED_HEADER + 2], n
    if name == "padding":
        assert ref.FIXED_HEADER + (symbols + 1) // 2 < head
        return _with(good, head - 1, b"\x80"), n
    if name == "the last length's other half":
        last = ref.FIXED_HEADER + symbols // 2
        return _with(good, last, bytes([good[last] | 0x10])), n
    if name == "length 0":
        return _with(good, ref.FIXED_HEADER, bytes([good[ref.FIXED_HEADER] & 0xF0])), n
    if name == "incomplete":
        longer = lengths.copy()
        longer[int(np.argmin(np.where(lengths > 0, lengths, 99)))] += 1  # a code one bit longer leaves room unused
        return ref.huffman_chunk(plane, longer), n
    if name == "over-subscribed":
        shorter = lengths.copy()
        shorter[int(np.argmax(lengths))] -= 1
        return ref.huffman_chunk(plane, shorter), n
    if name == "lanes past the end":
        return good + bytes(4), n
    if name == "a word too many":
        words = int.from_bytes(good[4:6], "little")
        lane0_end = head + 4 * words
        return _with(good[:lane0_end] + bytes(4) + good[lane0_end:], 4, (words + 1).to_bytes(2, "little")), n
    if name == "padding bits":  # the last bit of a lane whose codes leave its last word's last bits unused
        bits = np.bincount(ref.lane_of(n), weights=lengths[plane], minlength=ref.LANES).astype(np.int64)
        lane = int(np.flatnonzero(bits % 32)[0])
        words = np.frombuffer(good[4 : 4 + 2 * ref.LANES], "<u2").astype(np.int64)
        last = head + 4 * int(words[: lane + 1].sum()) - 1
        return _with(good, last, bytes([good[last] | 1])), n
    if name == "lane cut short":
        w0, w1 = int.from_bytes(good[4:6], "little"), int.from_bytes(good[6:8], "little")
        moved = _with(good, 4, (w0 - 1).to_bytes(2, "little"))
        return _with(moved, 6, (w1 + 1).to_bytes(2, "little")), n
    raise AssertionError(name)


