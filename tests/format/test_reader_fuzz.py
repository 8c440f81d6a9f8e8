"""Fuzzing the reader: mutated files either load correctly or raise a CkptzipError, promptly.

Mutations are drawn from a seeded RNG, so a failure names a reproducible case. Raw byte damage
must always be detected. Edits made behind the checksums (a rewritten index with a matching
hash, a replaced chunk with a matching XXH3) may yield a different valid file, but never another
exception type, a hang, or an allocation sized by an unchecked header.
"""

from __future__ import annotations

import copy
import random
import signal
import struct
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
import zstandard
from helpers import CkzParts, assert_same, load_bytes, random_tensor, save_bytes, small_chunks, with_preamble

from ckptzip import CkptzipError

CASE_TIMEOUT_S = 10.0


class _Hang(BaseException):
    """Raised by the alarm; a BaseException so no `except Exception` in the code under test eats it."""


@contextmanager
def _deadline(seconds: float) -> Iterator[None]:
    def alarm(signum: int, frame: object) -> None:
        raise _Hang

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _objects() -> list[tuple[dict[str, Any], str]]:
    gen = torch.Generator().manual_seed(0)
    smooth = {
        "w": torch.randn(1200, generator=gen),  # > 4 KiB: byte planes, raw mantissas, zstd exponents
        "h": torch.randn(2100, generator=gen).to(torch.bfloat16),
        "ids": torch.arange(600, dtype=torch.int64) % 9,
        "mask": torch.arange(50) % 3 == 0,
        "noise": random_tensor(torch.uint8, (300,), seed=1),
        "empty": torch.empty(0, 2),
        "tied": None,
        "meta": {"step": 10, "lr": 1e-3, "betas": (0.9, 0.99), "tag": "fuzz", "raw": b"\x00\x01"},
    }
    smooth["tied"] = smooth["w"]
    return [(smooth, "auto"), (smooth, "deflate"), (smooth, "lz4"), ({"z": torch.zeros(700), "n": None}, "zstd")]


@pytest.fixture(scope="module")
def bases() -> list[tuple[bytes, Any]]:
    """Valid files (several codecs, chunks of SMALL_CHUNK_BYTES so tensors span chunks) and their objects."""
    out = []
    for obj, codec in _objects():
        data = save_bytes(obj, codec=small_chunks(codec))
        out.append((data, load_bytes(data)))
    return out


# --- mutations -----------------------------------------------------------------------------------


def _random_bytes(rng: random.Random, n: int) -> bytes:
    return bytes(rng.getrandbits(8) for _ in range(n))


def _raw_mutation(rng: random.Random, data: bytes) -> bytes:
    b = bytearray(data)
    kind = rng.randrange(6)
    pos = rng.randrange(len(b))
    if kind == 0:
        for _ in range(rng.randint(1, 4)):
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
    elif kind == 1:
        b[pos:pos] = _random_bytes(rng, rng.randint(1, 16))
    elif kind == 2:
        del b[pos : pos + rng.randint(1, 16)]
    elif kind == 3:
        del b[pos:]
    elif kind == 4:
        n = rng.randint(1, 64)
        b[pos : pos + n] = _random_bytes(rng, len(b[pos : pos + n]))
    else:
        n = rng.randint(1, 64)
        b[pos:pos] = b[rng.randrange(len(b)) :][:n]
    return bytes(b)


_INTERESTING: list[Any] = [
    None,
    True,
    False,
    0,
    1,
    -1,
    2,
    3,
    4,
    8,
    16,
    255,
    256,
    2**28,
    2**28 + 1,
    2**31,
    2**32,
    2**53 + 1,
    2**63 - 1,
    2**63,
    2**64,
    -(2**63),
    10**40,
    0.5,
    -0.0,
    1e308,
    "",
    "x",
    "float32",
    "bool",
    "complex64",
    "zstd",
    "ans",
    "raw",
    "byteplanes",
    "cpu",
    "cuda:0",
    "meta",
    "wsum64:0000000000000000",
    [],
    {},
    [0],
    [16, 1, 1, "0000000000000000"],
    {"id": "raw"},
    {"id": "byteplanes", "itemsize": 2},
    {"tensor": 0},
    {"tensor": 1},
    {"float": "7ff8000000000001"},
    {"npscalar": ["<f8", "00"]},
    {"odict": [], "meta": None},
    [[[[[[[[[[[]]]]]]]]]]],
]


def _nodes(doc: Any, path: tuple = ()) -> Iterator[tuple[Any, Any]]:
    """(container, key) of every value inside ``doc``."""
    if isinstance(doc, dict):
        for key in list(doc):
            yield doc, key
            yield from _nodes(doc[key], (*path, key))
    elif isinstance(doc, list):
        for i in range(len(doc)):
            yield doc, i
            yield from _nodes(doc[i], (*path, i))


def _edit_json(rng: random.Random, index: dict) -> None:
    container, key = rng.choice(list(_nodes(index)))
    value = container[key]
    kind = rng.randrange(6)
    if kind == 0 or (kind == 1 and type(value) is not int):
        container[key] = copy.deepcopy(rng.choice(_INTERESTING))
    elif kind == 1:
        container[key] = value + rng.choice([-1, 1, -8, 8, 1000, -(2**20)])
    elif kind == 2:
        del container[key]
    elif kind == 3 and isinstance(container, list):
        container.insert(key, container[key])
    elif kind == 4 and isinstance(container, list) and len(container) > 1:
        other = rng.randrange(len(container))
        container[key], container[other] = container[other], container[key]
    elif isinstance(container, dict):
        container[rng.choice(["name", "dtype", "shape", "nbytes", "x", "tree", "chunks", "id"])] = container.pop(key)
    else:
        container[key] = [value, value]


def _json_mutation(rng: random.Random, data: bytes) -> bytes:
    parts = CkzParts.parse(data)
    for _ in range(rng.randint(1, 3)):
        _edit_json(rng, parts.index)
    if rng.random() < 0.1:
        return with_preamble(
            parts.build(), major=rng.choice([1, 2]), minor=rng.choice([0, 1]), flags=rng.choice([0, 0, 4])
        )
    return parts.build()


def _chunk_positions(parts: CkzParts, codec_id: str | None = None) -> list[tuple[int, int, int]]:
    """(tensor, stream, chunk) of every chunk, or only of the streams stored with ``codec_id``."""
    return [
        (i, j, k)
        for i, t in enumerate(parts.index["tensors"])
        for j, s in enumerate(t["streams"])
        if codec_id is None or s["codec"]["id"] == codec_id
        for k in range(len(s["chunks"]))
    ]


def _chunk_mutation(rng: random.Random, data: bytes) -> bytes:
    """Damage one chunk's stored bytes and fix its XXH3, so the codec and the tensor checksum see it."""
    parts = CkzParts.parse(data)
    i, j, k = rng.choice(_chunk_positions(parts))
    offset, length, _, _ = parts.chunk(i, j, k)
    stored = parts.data[offset - 16 : offset - 16 + length]
    parts.replace_chunk(i, j, k, _raw_mutation(rng, stored) if length > 1 else _random_bytes(rng, rng.randint(1, 9)))
    return parts.build()


def _zstd_bomb(rng: random.Random, data: bytes) -> bytes:
    """Replace a zstd chunk by a frame whose header claims a huge decoded size."""
    parts = CkzParts.parse(data)
    i, j, k = rng.choice(_chunk_positions(parts, codec_id="zstd"))
    claimed = rng.randint(2**32, 2**62)
    body = zstandard.ZstdCompressor(write_content_size=False).compress(_random_bytes(rng, 64))
    assert body[4] == 0  # no content size, not single-segment: a window byte follows the descriptor
    # Descriptor 0xC0: an 8-byte content size after the window byte.
    bomb = body[:4] + b"\xc0" + body[5:6] + struct.pack("<Q", claimed) + body[6:]
    assert zstandard.frame_content_size(bomb) == claimed
    parts.replace_chunk(i, j, k, bomb)
    return parts.build()


def _run_cases(
    bases: list[tuple[bytes, Any]], mutate: Callable[[random.Random, bytes], bytes], n: int, seed: int, *, success: str
) -> dict[str, int]:
    """Run ``n`` mutated loads. ``success`` says what a load that does not raise must give:
    "unchanged" (only an unchanged file may load), "same" (the original object), or "any"."""
    outcomes = {"loaded": 0, "refused": 0}
    for case in range(n):
        rng = random.Random(seed * 1_000_003 + case)
        data, expected = bases[case % len(bases)]
        mutated = mutate(rng, data)
        try:
            with _deadline(CASE_TIMEOUT_S):
                got = load_bytes(mutated)
        except CkptzipError:
            outcomes["refused"] += 1
            continue
        except _Hang:
            pytest.fail(f"case {case} (seed {seed}, {mutate.__name__}) ran longer than {CASE_TIMEOUT_S} s")
        except Exception as exc:  # the point of the test: nothing but CkptzipError may escape
            raise AssertionError(
                f"case {case} (seed {seed}, {mutate.__name__}) raised {type(exc).__name__}: {exc}"
            ) from exc
        outcomes["loaded"] += 1
        if success == "unchanged":
            assert mutated == data, f"case {case} (seed {seed}): damaged bytes loaded without an error"
        if success in ("unchanged", "same"):
            assert_same(got, expected, f"case {case} (seed {seed})")
    return outcomes


def test_raw_damage_is_always_detected(bases: list[tuple[bytes, Any]]) -> None:
    outcomes = _run_cases(bases, _raw_mutation, 3000, seed=1, success="unchanged")
    assert outcomes["refused"] >= 2990


def test_index_edits_behind_the_hash_never_escape(bases: list[tuple[bytes, Any]]) -> None:
    outcomes = _run_cases(bases, _json_mutation, 4000, seed=2, success="any")
    assert outcomes["refused"] > 3000  # most edits break a rule; some (a name, a tree value) are valid


def test_chunk_edits_behind_the_hash_are_caught_by_codec_or_checksum(bases: list[tuple[bytes, Any]]) -> None:
    outcomes = _run_cases(bases, _chunk_mutation, 1500, seed=3, success="same")
    assert outcomes["refused"] >= 1490


def test_zstd_headers_claiming_huge_sizes_are_refused_unread(bases: list[tuple[bytes, Any]]) -> None:
    for case in range(50):
        rng = random.Random(case)
        data = _zstd_bomb(rng, bases[0][0])
        with (
            _deadline(CASE_TIMEOUT_S),
            pytest.raises(CkptzipError, match=r"zstd frame header declares \d+ bytes, expected \d+"),
        ):
            load_bytes(data)
