"""Single-thread GDeflate decoding on the CPU: ckptzip's decoder (codecs/_gdeflate.c) against
nvCOMP's (``nvcomp::gdeflate::decompressCPU`` in libnvcomp_cpu, called directly: valid streams
only), each into buffers allocated once, MB/s of stored and of decoded bytes, medians of
``--reps`` alternating runs after a warm one.

Chunks: Huffman-only ones as nvCOMP's GPU encoder writes them by default (algorithm_type 0, from
tests/gdeflate_writer.py) of fp32 exponent and bf16 sign/exponent planes of N(0, 0.02) weights;
the H200's golden chunks (tests/golden); and what nvCOMP's CPU encoder writes (LZ at level 1) for
the same planes, for sparse XOR-delta bitmaps (what a GPU codes with algorithm_type 1) and for
random bytes (stored blocks). Each case decodes about ``--mib`` MiB of chunks per run::

    PYTHONPATH=src:tests python3 bench/gdeflate_decode_probe.py
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from ckptzip.codecs import _gdeflate_lib, codec_threads, get_codec
from gdeflate_writer import huffman_only, weight_planes

GOLDEN = Path(__file__).parents[1] / "tests" / "golden" / "gdeflate_gpu_chunks.npz"
Chunks = list[tuple[bytes, bytes]]  # (stored, decoded)


def _cpu_encoded(chunks: list[bytes]) -> Chunks:
    coded = get_codec({"id": "gdeflate"}, "cpu").encode([torch.frombuffer(bytearray(c), dtype=torch.uint8)
                                                          for c in chunks])
    return [(c.numpy().tobytes(), raw) for c, raw in zip(coded, chunks)]


def _sparse_bitmap(n: int, seed: int) -> bytes:
    """A bitmap of the 1 % of elements a step changed, as XOR deltas of barely moved weights have."""
    changed = np.random.default_rng(seed).random(8 * n) < 0.01
    return np.packbits(changed).tobytes()


def cases() -> dict[str, Chunks]:
    out: dict[str, Chunks] = {}
    for n in (1 << 16, 1 << 18):
        for kind, data in weight_planes(n, n).items():
            out[f"Huffman-only {kind}, {n >> 10} KiB"] = [(huffman_only(data), data)]
    golden = np.load(GOLDEN)
    for name, label in (("262144_0", "256 KiB, type 0"), ("65537_1", "64 KiB, type 1"), ("65537_5", "64 KiB, type 5")):
        out[f"H200 golden, {label}"] = [(golden[f"enc_{name}"].tobytes(), golden[f"raw_{name.split('_')[0]}"].tobytes())]
    if _gdeflate_lib.load()[0] is not None:
        for kind, data in weight_planes(1 << 16, 7).items():
            out[f"CPU-encoded (LZ) {kind}, 64 KiB"] = _cpu_encoded([data])
        out["CPU-encoded (LZ) sparse delta bitmap, 64 KiB"] = _cpu_encoded([_sparse_bitmap(1 << 16, 8)])
        out["CPU-encoded random bytes (stored), 64 KiB"] = _cpu_encoded([np.random.default_rng(9).bytes(1 << 16)])
    return out


def _ckptzip(chunks: Chunks) -> Callable[[], None]:
    codec = get_codec({"id": "gdeflate"}, "cpu")
    stored = np.array([len(s) for s, _ in chunks])
    raw = np.array([len(r) for _, r in chunks])
    src = torch.frombuffer(bytearray(b"".join(s for s, _ in chunks)), dtype=torch.uint8)
    dst = torch.empty(int(raw.sum()), dtype=torch.uint8)

    def run() -> None:
        with codec_threads(1):
            codec.decode_segments(src, np.cumsum(stored) - stored, stored, dst, np.cumsum(raw) - raw, raw)

    return run


def _nvcomp(chunks: Chunks) -> Callable[[], None]:
    library = ctypes.CDLL(_gdeflate_lib._library_candidates()[0])
    decompress = library._ZN6nvcomp8gdeflate13decompressCPUEPKPKvPKmmPKPvPmSA_
    n = len(chunks)
    src = [np.frombuffer(s, np.uint8) for s, _ in chunks]
    dst = [np.empty(len(r), np.uint8) for _, r in chunks]
    args = ((ctypes.c_void_p * n)(*[s.ctypes.data for s in src]), (ctypes.c_size_t * n)(*[s.size for s in src]),
            ctypes.c_size_t(n), (ctypes.c_void_p * n)(*[d.ctypes.data for d in dst]),
            (ctypes.c_size_t * n)(*[d.size for d in dst]), (ctypes.c_size_t * n)())

    def run() -> None:
        decompress(*args)
        assert src and dst  # the addresses in args stay theirs

    return run


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--mib", type=float, default=8.0)
    args = p.parse_args()
    nvcomp = _gdeflate_lib.load()[0] is not None
    print("| chunks | ratio | ckptzip MB/s stored (decoded) | nvCOMP MB/s stored (decoded) | x |")
    print("| --- | --- | --- | --- | --- |")
    for name, chunks in cases().items():
        copies = max(1, int(args.mib * (1 << 20)) // sum(len(r) for _, r in chunks))
        stored, raw = copies * sum(len(s) for s, _ in chunks), copies * sum(len(r) for _, r in chunks)
        runs = {"ckptzip": _ckptzip(chunks * copies), **({"nvcomp": _nvcomp(chunks * copies)} if nvcomp else {})}
        seconds: dict[str, list[float]] = {k: [] for k in runs}
        for run in runs.values():  # warm: tables, pages
            run()
        for _ in range(args.reps):
            for key, run in runs.items():
                start = time.perf_counter()
                run()
                seconds[key].append(time.perf_counter() - start)
        median = {k: statistics.median(v) for k, v in seconds.items()}
        cells = [f"{stored / t / 1e6:.0f} ({raw / t / 1e6:.0f})" for t in median.values()]
        speedup = f"{median['nvcomp'] / median['ckptzip']:.1f}" if nvcomp else "-"
        print(f"| {name} | {raw / stored:.2f} | {' | '.join(cells + ([] if nvcomp else ['-']))} | {speedup} |")


if __name__ == "__main__":
    main()
