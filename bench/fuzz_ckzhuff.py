#!/usr/bin/env python3
"""Mutation fuzz of ckz-huff's C decoder (codecs/_ckzhuff.c), meant to run under AddressSanitizer
and UndefinedBehaviorSanitizer: a file is untrusted, so no damaged chunk may read or write outside
its buffers, whatever its bytes.

Valid chunks of every sample kind of the specification's reference (tests/ckzhuff_reference.py)
and of the trained-like exponent planes bench/coder_gpu.py makes, from 700 bytes to past the GPU's
256 KiB, are damaged at
random (truncated, extended, bytes and bits changed, lanes replaced, the lanes' word counts
shuffled) and decoded from a buffer of exactly their size into a slot between two guard zones. A
decode either fills its slot or raises ``CorruptChunkError``; anything else, a guard zone written
or a sanitizer's report, stops the run. Build the extensions with the sanitizers in a checkout of
their own (``--inplace`` would replace the normal build's), then preload their runtimes::

    git worktree add /tmp/ckz-asan HEAD && cd /tmp/ckz-asan
    CFLAGS="-fsanitize=address,undefined -fno-omit-frame-pointer -O1 -g" \\
        LDFLAGS="-fsanitize=address,undefined" python3 setup.py -q build_ext --inplace
    ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \\
        LD_PRELOAD="$(gcc -print-file-name=libasan.so) $(gcc -print-file-name=libubsan.so)" \\
        PYTHONPATH=src python3 bench/fuzz_ckzhuff.py --seconds 300 --seed 1
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import ckzhuff_reference as ref  # noqa: E402  (the specification's reference, beside the tests)

from ckptzip.codecs import get_codec  # noqa: E402
from ckptzip.codecs.ckzhuff import CkzHuffCpuCodec  # noqa: E402
from coder_gpu import high_plane, trained_like  # noqa: E402
from ckptzip.errors import CorruptChunkError  # noqa: E402

SIZES = (700, 5000, 20000, 65536, 262144, 262144 + 37)
GUARD = 32  # bytes either side of a decode's slot that it must leave as they were
MARK = 0xA5


def samples(rng: np.random.Generator) -> Iterator[np.ndarray]:
    g = torch.Generator().manual_seed(int(rng.integers(1 << 30)))
    trained = [high_plane(t).numpy() for t in trained_like(512, 1024, 3, g).values()]  # 512 KiB or more each
    for n in SIZES:
        yield from ref.samples(n, int(rng.integers(1 << 30))).values()
        yield from (plane[:n] for plane in trained)


def decode(codec: CkzHuffCpuCodec, chunk: np.ndarray, n: int, out: np.ndarray, at: int) -> None:
    codec.decode_segments(torch.from_numpy(chunk), np.array([0]), np.array([chunk.size]),
                          torch.from_numpy(out), np.array([at]), np.array([n]))


def damaged(chunk: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """``chunk`` with one kind of damage, chosen at random."""
    d = chunk.copy()
    kind = int(rng.integers(0, 7))
    if kind == 0:
        d = d[: int(rng.integers(0, d.size))]
    elif kind == 1:
        at = rng.integers(0, d.size, int(rng.integers(1, 5)))
        d[at] = rng.integers(0, 256, at.size)
    elif kind == 2:
        bits = rng.integers(0, 8 * d.size, int(rng.integers(1, 9)))
        np.bitwise_xor.at(d, bits // 8, (1 << (bits % 8)).astype(np.uint8))
    elif kind == 3 and d.size > 100:  # the lanes replaced under the header's first words
        d[100:] = rng.integers(0, 256, d.size - 100)
    elif kind == 4 and d.size > 68:  # the lanes' word counts shuffled
        words = d[4:68].copy().view("<u2")
        rng.shuffle(words)
        d[4:68] = words.view(np.uint8)
    elif kind == 5:
        d = np.concatenate([d, rng.integers(0, 256, int(rng.integers(1, 64))).astype(np.uint8)])
    else:
        start = int(rng.integers(0, max(1, d.size - 8)))
        d[start : start + 8] = 0xFF
    return np.ascontiguousarray(d)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0, help="how long to damage and decode")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    rng = np.random.default_rng(args.seed)
    codec = get_codec({"id": "ckz-huff"}, "cpu")
    assert isinstance(codec, CkzHuffCpuCodec)
    valid = []
    for data in samples(rng):
        (coded,) = codec.encode([torch.from_numpy(np.ascontiguousarray(data, dtype=np.uint8))])
        chunk = coded.numpy().copy()
        back = np.empty(data.size, np.uint8)
        decode(codec, chunk, data.size, back, 0)
        if bytes(back) != bytes(data):
            print("a valid chunk does not decode to its bytes", file=sys.stderr)
            return 1
        valid.append((chunk, data.size))
    start, trials, refused = time.monotonic(), 0, 0
    while time.monotonic() - start < args.seconds:
        chunk, n = valid[int(rng.integers(len(valid)))]
        source = damaged(chunk, rng).copy()  # a buffer of exactly its size: a read past it is caught
        slot = np.full(n + 2 * GUARD, MARK, np.uint8)
        try:
            decode(codec, source, n, slot, GUARD)
        except CorruptChunkError:
            refused += 1
        if not ((slot[:GUARD] == MARK).all() and (slot[GUARD + n :] == MARK).all()):
            print(f"a damaged chunk ({source.size} bytes, {n} declared) wrote outside its slot", file=sys.stderr)
            return 1
        trials += 1
    print(f"{len(valid)} valid chunks; {trials} damaged ones decoded, {refused} refused as corrupt; "
          f"every decode stayed in its slot")
    return 0


if __name__ == "__main__":
    sys.exit(main())
