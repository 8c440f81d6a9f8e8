"""ckptzip's nvCOMP codecs on this GPU, one by one (docs/gpu-codecs.md).

For normal fp32 and bf16 weights (N(0, 0.02), ``--mib`` each) and their byte planes
(``view(-1, k).t().contiguous()``), every codec and chunk size: checks the round trip bit-exactly
and prints the ratio and encode/decode GB/s (of raw bytes; CUDA events, one warm-up, median of
``--reps``), for the whole batch in one call and for one chunk per call. For zstd, deflate and lz4
it also checks that GPU streams decode on the CPU (zstandard, zlib raw, lz4.block) and back.

    ckptzip bench gpu-codecs [--mib 1024] [--chunk-kib 64 256 1024] [--reps 3] [--codecs ans zstd]
    python -m ckptzip_bench.gpu_codecs ...   (the same, from bench/ of a checkout)

Exit status: 0 all checks passed, 1 a mismatch or an error, 2 the GPU codecs cannot run here.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import zlib
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import zstandard

from ckptzip.codecs import get_codec, nvcomp
from .system import hardware

try:
    import lz4.block as lz4_block
except ImportError:  # the lz4 interchange check is then skipped
    lz4_block = None

T = TypeVar("T")

# Codecs for any data; data_type-specific ones only where the bytes are whole elements of that type.
CODECS: list[dict[str, Any]] = [
    {"id": "zstd"},
    {"id": "deflate", "algorithm_type": 0},
    {"id": "deflate"},
    {"id": "lz4"},
    {"id": "ans"},
    {"id": "bitcomp"},
    {"id": "bitcomp", "algorithm_type": 1},
    {"id": "gdeflate", "algorithm_type": 0},
    {"id": "gdeflate"},
    {"id": "cascaded"},
]
TYPED_CODECS: dict[str, list[dict[str, Any]]] = {
    "fp32": [{"id": "ans", "data_type": "<f4"}, {"id": "bitcomp", "data_type": "<f4"}],
    "bf16": [{"id": "ans", "data_type": "<f2"}],
}


def _zlib_raw(raw: bytes) -> bytes:
    compressor = zlib.compressobj(6, zlib.DEFLATED, -15)
    return compressor.compress(raw) + compressor.flush()


CPU_FORMATS: dict[str, tuple[Callable[[bytes], bytes], Callable[[bytes, int], bytes]]] = {
    "zstd": (
        lambda raw: zstandard.ZstdCompressor(level=3).compress(raw),
        lambda comp, n: zstandard.ZstdDecompressor().decompress(comp, max_output_size=n),
    ),
    "deflate": (_zlib_raw, lambda comp, n: zlib.decompress(comp, wbits=-15)),
}
if lz4_block is not None:
    CPU_FORMATS["lz4"] = (
        lambda raw: lz4_block.compress(raw, store_size=False),
        lambda comp, n: lz4_block.decompress(comp, uncompressed_size=n),
    )
INTERCHANGE_CHUNKS = 4


def variants(nbytes: int) -> dict[str, Callable[[], tuple[torch.Tensor, int]]]:
    """Makers of each data variant: (1-D uint8 CUDA bytes, offset of the high-byte plane or -1)."""

    def fp32() -> torch.Tensor:
        return (torch.randn(nbytes // 4, device="cuda") * 0.02).view(torch.uint8)

    def bf16() -> torch.Tensor:
        return (torch.randn(nbytes // 2, device="cuda") * 0.02).to(torch.bfloat16).view(torch.uint8)

    def planes(data: torch.Tensor, k: int) -> tuple[torch.Tensor, int]:
        split = data.view(-1, k).t().contiguous().view(-1)
        return split, (k - 1) * (split.numel() // k)  # little-endian: the last plane is the high byte

    return {
        "fp32": lambda: (fp32(), -1),
        "fp32-planes": lambda: planes(fp32(), 4),
        "bf16": lambda: (bf16(), -1),
        "bf16-planes": lambda: planes(bf16(), 2),
    }


def timed(fn: Callable[[], T], reps: int) -> tuple[T, float]:
    """One warm-up call, then the median seconds of ``reps`` calls (CUDA events on the current stream)."""
    result = fn()
    seconds = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        result = fn()
        end.record()
        end.synchronize()
        seconds.append(start.elapsed_time(end) / 1e3)
    return result, statistics.median(seconds)


def interchange(codec: Any, chunks: list[torch.Tensor], encoded: list[torch.Tensor]) -> str | None:
    """Check GPU streams decode on the CPU and CPU streams on the GPU; return what failed."""
    cpu_encode, cpu_decode = CPU_FORMATS[codec.codec_id]
    raws = [c.cpu().numpy().tobytes() for c in chunks[:INTERCHANGE_CHUNKS]]
    for i, (raw, e) in enumerate(zip(raws, encoded)):
        if cpu_decode(e.cpu().numpy().tobytes(), len(raw)) != raw:
            return f"GPU chunk {i} decodes differently on the CPU"
    stored = [torch.frombuffer(bytearray(cpu_encode(raw)), dtype=torch.uint8).cuda() for raw in raws]
    decoded = codec.decode(stored, [len(raw) for raw in raws])
    for i, (d, c) in enumerate(zip(decoded, chunks)):
        if not torch.equal(d, c):
            return f"CPU chunk {i} decodes differently on the GPU"
    return None


def probe(
    config: dict[str, Any], data: torch.Tensor, high: int, chunk: int, reps: int, single_bytes: int, cpu_check: bool
) -> dict[str, Any]:
    """Measure and check one codec at one chunk size on one data variant (``high``: see ``variants``)."""
    codec = get_codec(config, "cuda")
    chunks = list(data.split(chunk))
    sizes = [c.numel() for c in chunks]
    encoded, t_enc = timed(lambda: codec.encode(chunks), reps)
    decoded, t_dec = timed(lambda: codec.decode(encoded, sizes), reps)
    problems = [] if torch.equal(torch.cat(decoded), data) else ["batched round trip differs"]
    del decoded
    compressed = [e.numel() for e in encoded]
    high_compressed = sum(n for i, n in enumerate(compressed) if high >= 0 and i * chunk >= high)
    one = chunks[: max(1, single_bytes // chunk)]
    one_enc, t_enc1 = timed(lambda: [codec.encode([c])[0] for c in one], 1)
    one_dec, t_dec1 = timed(lambda: [codec.decode([e], [c.numel()])[0] for e, c in zip(one_enc, one)], 1)
    if not all(torch.equal(d, c) for d, c in zip(one_dec, one)):
        problems.append("one-chunk-per-call round trip differs")
    if cpu_check and codec.codec_id in CPU_FORMATS:
        try:
            problem = interchange(codec, chunks, encoded)
        except Exception as exc:  # a CPU library or the GPU decoder rejecting the other's stream
            problem = f"CPU interchange raised {type(exc).__name__}: {exc}"
        if problem:
            problems.append(problem)
    one_bytes = sum(c.numel() for c in one)
    return {
        "ratio": data.numel() / sum(compressed),
        "high": (data.numel() - high) / high_compressed if high_compressed else None,
        "enc": data.numel() / t_enc / 1e9,
        "dec": data.numel() / t_dec / 1e9,
        "enc1": one_bytes / t_enc1 / 1e9,
        "dec1": one_bytes / t_dec1 / 1e9,
        "problems": problems,
    }


def configure(parser: argparse.ArgumentParser) -> None:
    """The codec probe's arguments (``ckptzip bench gpu-codecs``, or this module run)."""
    parser.description = __doc__
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--mib", type=int, default=1024, help="bytes per data variant (MiB)")
    parser.add_argument("--chunk-kib", type=int, nargs="+", default=[64, 256, 1024], help="chunk sizes (KiB)")
    parser.add_argument("--reps", type=int, default=3, help="timed repetitions (median) after one warm-up")
    parser.add_argument("--single-mib", type=int, default=16, help="bytes coded one chunk per call (MiB)")
    parser.add_argument("--codecs", nargs="+", help="only these codec ids")


def run(args: argparse.Namespace) -> int:
    """Probe every codec asked for; 2 (and nothing run) where the GPU codecs cannot run."""
    if nvcomp.UNAVAILABLE_REASON is not None:
        print(f"ckptzip bench gpu-codecs: error: the GPU codecs cannot run here: {nvcomp.UNAVAILABLE_REASON}",
              file=sys.stderr)
        return 2
    print(
        f"{torch.cuda.get_device_name()} | torch {torch.__version__} (CUDA {torch.version.cuda}) | "
        f"{hardware()['versions']['nvcomp']} | {args.mib} MiB per variant, median of {args.reps}, "
        f"one-chunk-per-call columns on the first {args.single_mib} MiB"
    )
    header = (
        f"{'data':<12}{'codec':<26}{'chunk':>6}{'ratio':>7}{'high':>7}{'enc':>8}{'dec':>8}"
        f"{'enc 1/call':>11}{'dec 1/call':>11}  check"
    )
    print(header + "\n" + "-" * len(header), flush=True)
    failures = []
    began = time.perf_counter()
    for name, make in variants(args.mib << 20).items():
        data, high = make()
        configs = [c for c in CODECS + TYPED_CODECS.get(name, []) if not args.codecs or c["id"] in args.codecs]
        for config in configs:
            label = ",".join(f"{v}" if k == "id" else f"{k}={v}" for k, v in config.items())
            for kib in args.chunk_kib:
                where = f"{name:<12}{label:<26}{kib:>5}K"
                try:
                    row = probe(config, data, high, kib << 10, args.reps, args.single_mib << 20, name == "fp32")
                except Exception as exc:  # report and go on: one codec's failure must not hide the others
                    failures.append(f"{name} {label} {kib}K: {type(exc).__name__}: {exc}")
                    print(f"{where}  FAIL {type(exc).__name__}: {exc}", flush=True)
                    continue
                high_ratio = f"{row['high']:7.3f}" if row["high"] else f"{'-':>7}"
                check = "ok" if not row["problems"] else "FAIL " + "; ".join(row["problems"])
                failures += [f"{name} {label} {kib}K: {p}" for p in row["problems"]]
                print(
                    f"{where}{row['ratio']:7.3f}{high_ratio}{row['enc']:8.1f}{row['dec']:8.1f}"
                    f"{row['enc1']:11.2f}{row['dec1']:11.2f}  {check}",
                    flush=True,
                )
        del data
        torch.cuda.empty_cache()
    print(f"\nGB/s of raw bytes; 'high': ratio of the high-byte plane alone. {time.perf_counter() - began:.0f} s.")
    if lz4_block is None:
        print("lz4 CPU interchange not checked: the lz4 package is not installed.")
    if failures:
        print(f"\n{len(failures)} FAILED:\n  " + "\n  ".join(failures))
        return 1
    print("All round trips bit-exact.")
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m ckptzip_bench.gpu_codecs")
    configure(parser)
    sys.exit(run(parser.parse_args()))


if __name__ == "__main__":
    main()
