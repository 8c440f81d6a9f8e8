#!/usr/bin/env python3
"""ckz-huff, ckptzip's own coder of byte planes (issue 46), on one GPU, in one run:

1. bit-exactness: on every plane below, the GPU's chunks are the CPU coder's byte for byte, and
   each side decodes the other's;
2. the coder alone on the sign/exponent planes of a trained-like state (fp32 weights N(0, 0.02)
   after AdamW steps, AdamW's exp_avg and exp_avg_sq, bf16 gradients; ``--plane-mib`` MiB each):
   ratio, encode and decode GB/s of plane bytes (first call apart, then the median of ``--reps``)
   of ckz-huff (shipped kernels; its single-level decoder, FIRST=12, through Triton's JIT; in
   smaller chunks, ``--huff-chunks``, so a call has more chunks and the GPU more warps) against
   nvCOMP's ans, gdeflate (Huffman only, auto's plane codec) and zstd, each in its own chunk size;
3. the pipeline: ``ckptzip.save`` of a trained-like state of ``--state-gib`` GiB to a file object
   that discards its input and ``ckptzip.load`` from its bytes in host memory onto the GPU, with
   ``codec="huff"`` against ``"auto"`` (first call apart, then medians), and the same bytes
   loaded onto the CPU by a process that sees no GPU (every chunk decoded on the CPU's cores; the
   tensor checksums the GPU wrote verified);
4. the C decoder (codecs/_ckzhuff.c) on the GPU's chunks of step 2: 1 core and all cores, GB/s of
   decoded bytes, beside ckptzip's GDeflate decoder on gdeflate's chunks of the same planes;
5. with ``--encoder-split``, where ckz-huff's encode spends its time: each kernel's GPU time
   (torch.profiler) on the fp32 weights' and exp_avg's planes, for the planning program's bytes a
   step and warps (``ENCODER_VARIANTS``: the shipped one first, the others through Triton's JIT),
   every variant's chunks checked equal to the shipped one's.

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl   # nvCOMP wheels
    python3 setup.py -q build_ext --inplace                                       # the C coders
    PYTHONPATH=/tmp/site:src python3 bench/coder_gpu.py --json "$OUT/coder_gpu.json"

Without nvCOMP, the nvCOMP rows and the auto pipeline are left out. Exit status: 0, or 1 where a
chunk or a state is not bit-exact.
"""

from __future__ import annotations

import argparse
import collections
import io
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

import ckptzip
from ckptzip.codecs import codec_threads, cpu_threads, get_codec, has_codec
from ckptzip.errors import CorruptChunkError
from ckptzip.kernels import ckzhuff as gpu_huff
from ckptzip_bench.pipeline import discard_sink

GB = 1e9
# nvCOMP's formats, each in its engine chunk size (gdeflate: auto's Huffman-only plane codec)
NVCOMP: list[dict[str, Any]] = [{"id": "ans", "data_type": "|u1"}, {"id": "gdeflate", "algorithm_type": 0}, {"id": "zstd"}]


def trained_like(rows: int, cols: int, steps: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    """A weight matrix N(0, 0.02) after ``steps`` AdamW steps on gradients of per-row and per-column
    scales (heavy-tailed, as layers' are), its moments, and the last gradients in bf16, on ``g``'s device."""
    w = torch.randn(rows, cols, device=g.device, generator=g) * 0.02
    row = (torch.randn(rows, 1, device=g.device, generator=g) * 0.7).exp()
    col = (torch.randn(1, cols, device=g.device, generator=g) * 0.7).exp()
    m, v = torch.zeros_like(w), torch.zeros_like(w)
    lr, b1, b2, eps, wd = 1e-3, 0.9, 0.999, 1e-8, 0.1
    grad = w
    for t in range(1, steps + 1):
        grad = torch.randn(rows, cols, device=g.device, generator=g) * 1e-3 * row * col
        m.mul_(b1).add_(grad, alpha=1 - b1)
        v.mul_(b2).addcmul_(grad, grad, value=1 - b2)
        w.mul_(1 - lr * wd).addcdiv_(m / (1 - b1**t), (v / (1 - b2**t)).sqrt_().add_(eps), value=-lr)
    return {"weight": w, "exp_avg": m, "exp_avg_sq": v, "grad": grad.bfloat16()}


def high_plane(t: torch.Tensor) -> torch.Tensor:
    """The sign/exponent byte plane (the high byte of each little-endian element), contiguous."""
    return t.contiguous().view(torch.uint8).view(-1, t.element_size())[:, -1].contiguous()


def cuda_time(fn: Callable[[], Any]) -> tuple[float, Any]:
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start, out


def first_and_median(fn: Callable[[], Any], reps: int) -> tuple[float, float, Any]:
    first, out = cuda_time(fn)
    times = []
    for _ in range(reps):
        seconds, out = cuda_time(fn)
        times.append(seconds)
    return first, statistics.median(times), out


def chunks_of(n: int, size: int) -> tuple[np.ndarray, np.ndarray]:
    lengths = np.full(-(-n // size), size, dtype=np.int64)
    lengths[-1] = n - size * (lengths.size - 1)
    return np.cumsum(lengths) - lengths, lengths


def coder_row(name: str, codec: Any, plane: torch.Tensor, reps: int) -> dict[str, Any]:
    """One codec on one plane, in one call per direction: ratio, GB/s, and whether it round-trips
    (a decoder that rejects the chunks is a row that does not, its error kept, not a stopped run)."""
    offsets, lengths = chunks_of(plane.numel(), codec.chunk_bytes)
    first_e, enc, (out, out_offsets, sizes) = first_and_median(
        lambda: codec.encode_segments(plane, offsets, lengths), reps)
    back = torch.empty_like(plane)
    try:
        first_d, dec, _ = first_and_median(
            lambda: codec.decode_segments(out, out_offsets, sizes, back, offsets, lengths), reps)
        error = None
    except CorruptChunkError as exc:
        first_d, dec, error = math.nan, math.nan, str(exc)
    n = plane.numel()
    return {"codec": name, "chunk_kib": codec.chunk_bytes >> 10, "ratio": n / int(sizes.sum()),
            "stored": int(sizes.sum()), "enc_gbs": n / enc / GB, "dec_gbs": n / dec / GB,
            "first_enc_s": first_e, "first_dec_s": first_d, "exact": error is None and bool(torch.equal(back, plane)),
            "error": error, "coded": (out, out_offsets, sizes, offsets, lengths)}


# (bytes a planning program reads at once, its warps): the shipped variant first
ENCODER_VARIANTS = [(gpu_huff.BLOCK, gpu_huff.PLAN_WARPS), (8192, 8), (16384, 8), (4096, 4), (8192, 16), (16384, 16)]


def kernel_seconds(fn: Callable[[], Any], reps: int) -> dict[str, float]:
    """GPU seconds of each kernel in one call of ``fn`` (by name; torch.profiler), medians of ``reps``."""
    from torch.profiler import ProfilerActivity, profile

    seconds: dict[str, list[float]] = collections.defaultdict(list)
    for _ in range(reps):
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        for event in prof.key_averages():
            us = getattr(event, "device_time_total", 0) or getattr(event, "cuda_time_total", 0)
            if us:
                seconds[event.key].append(us / 1e6)
    return {name: statistics.median(values) for name, values in seconds.items()}


def compacted(out: torch.Tensor, offsets: np.ndarray, sizes: np.ndarray) -> torch.Tensor:
    return torch.cat([out[o : o + n] for o, n in zip(offsets.tolist(), sizes.tolist())])


def encoder_split(plane: torch.Tensor, reps: int) -> list[dict[str, Any]]:
    """ckz-huff's encode of ``plane`` in each of ``ENCODER_VARIANTS``: GB/s, each kernel's GPU
    seconds, and whether its chunks are the shipped variant's."""
    shipped = gpu_huff.BLOCK, gpu_huff.PLAN_WARPS
    codec = gpu_huff.CkzHuffCudaCodec()
    offsets, lengths = chunks_of(plane.numel(), codec.chunk_bytes)
    reference: torch.Tensor | None = None
    rows = []
    for block, warps in ENCODER_VARIANTS:
        gpu_huff.BLOCK, gpu_huff.PLAN_WARPS = block, warps
        try:
            def encode() -> Any:
                return codec.encode_segments(plane, offsets, lengths)

            first, median, (out, out_offsets, sizes) = first_and_median(encode, reps)
            kernels = kernel_seconds(encode, reps)
        finally:
            gpu_huff.BLOCK, gpu_huff.PLAN_WARPS = shipped
        coded = compacted(out, out_offsets, sizes)
        reference = coded if reference is None else reference
        rows.append({"block": block, "warps": warps, "enc_gbs": plane.numel() / median / GB, "first_s": first,
                     "kernels_s": kernels, "same_chunks": bool(torch.equal(coded, reference))})
    return rows


def decodes_to(expected: torch.Tensor, decode: Callable[[torch.Tensor], object]) -> bool:
    """Whether ``decode`` fills a tensor like ``expected`` with its bytes (a rejected chunk: no)."""
    back = torch.empty_like(expected)
    try:
        decode(back)
    except CorruptChunkError:
        return False
    return torch.equal(back, expected)


def check_against_cpu(plane: torch.Tensor, coded: tuple[Any, ...]) -> list[str]:
    """The GPU's chunks against the CPU coder's, byte for byte, and the GPU decoding the CPU's
    (the CPU decoding the GPU's: :func:`cpu_decode`)."""
    out, out_offsets, sizes, offsets, lengths = coded
    cpu = get_codec({"id": "ckz-huff"}, "cpu")
    host = plane.cpu()
    c_out, c_offsets, c_sizes = cpu.encode_segments(host, offsets, lengths)
    problems = []
    if not np.array_equal(c_sizes, sizes):
        problems.append(f"{int((c_sizes != sizes).sum())} chunks of other sizes on the CPU")
    else:
        g = out.cpu().numpy()
        c = c_out.numpy()
        differ = [i for i in range(sizes.size) if not np.array_equal(g[out_offsets[i]:][: sizes[i]],
                                                                      c[c_offsets[i]:][: c_sizes[i]])]
        if differ:
            problems.append(f"{len(differ)} chunks differ from the CPU's (first: {differ[0]})")
    c_dev = c_out.cuda()
    gpu = get_codec({"id": "ckz-huff"}, "cuda")
    aligned = np.all((c_offsets % gpu_huff.CkzHuffCudaCodec.alignment) == 0)

    def on_gpu(back: torch.Tensor) -> None:
        if aligned:
            gpu.decode_segments(c_dev, c_offsets, c_sizes, back, offsets, lengths)
        else:
            back.copy_(torch.cat(gpu.decode([c_dev[o : o + s] for o, s in zip(c_offsets.tolist(), c_sizes.tolist())],
                                            lengths.tolist())))

    if not decodes_to(plane, on_gpu):
        problems.append("the GPU does not decode the CPU's chunks to their bytes")
    return problems


def cpu_decode(codec_id: str, coded: tuple[Any, ...], plane: torch.Tensor, reps: int) -> dict[str, Any]:
    """A CPU decoder on chunks a GPU coded: GB/s of decoded bytes on 1 core and on all, timed
    where it first decodes them to the plane's bytes (else ``cpu_exact`` False, and no times)."""
    out, out_offsets, sizes, offsets, lengths = coded
    src, host, n = out.cpu(), plane.cpu(), plane.numel()
    codec = get_codec({"id": codec_id}, "cpu")
    if not decodes_to(host, lambda back: codec.decode_segments(src, out_offsets, sizes, back, offsets, lengths)):
        return {"cpu_exact": False}
    dst = torch.empty_like(host)
    result: dict[str, Any] = {"cpu_exact": True}
    for threads in (1, cpu_threads()):
        with codec_threads(threads):
            codec.decode_segments(src, out_offsets, sizes, dst, offsets, lengths)
            times = []
            for _ in range(reps):
                start = time.perf_counter()
                codec.decode_segments(src, out_offsets, sizes, dst, offsets, lengths)
                times.append(time.perf_counter() - start)
        result[f"{threads}_cores_gbs"] = n / statistics.median(times) / GB
    return result


def state_of(gib: float, g: torch.Generator) -> tuple[dict[str, Any], int]:
    """A trained-like state of about ``gib`` GiB: layers of weights, AdamW moments, bf16 gradients."""
    d = 4096
    per_layer = 4 * d * d * 14  # four d x d-sized matrices, 14 bytes a parameter
    layers = max(1, round(gib * (1 << 30) / per_layer))
    model, grads, opt = {}, {}, {}
    for i in range(layers * 4):
        t = trained_like(d, d, 3, g)
        model[f"{i}.weight"], grads[f"{i}.weight"] = t["weight"], t["grad"]
        opt[i] = {"step": torch.tensor(3.0), "exp_avg": t["exp_avg"], "exp_avg_sq": t["exp_avg_sq"]}
    state = {"model": model, "grads": grads, "optimizer": {"state": opt}}
    return state, layers * per_layer


def pipeline(state: dict[str, Any], size: int, codec: str, reps: int) -> dict[str, Any]:
    first_save, save, _ = first_and_median(lambda: ckptzip.save(state, discard_sink(), codec=codec), reps)
    memory = io.BytesIO()
    ckptzip.save(state, memory, codec=codec)
    data = memory.getvalue()
    first_load, load, back = first_and_median(lambda: ckptzip.load(data, map_location="cuda"), reps)
    exact = all(torch.equal(a.reshape(-1).view(torch.uint8), b.to(a.device).reshape(-1).view(torch.uint8))
                for a, b in zip(_tensors(state), _tensors(back)))
    del back
    return {"codec": codec, "ratio": size / len(data), "save_gbs": size / save / GB, "load_gbs": size / load / GB,
            "first_save_s": first_save, "first_load_s": first_load, "exact": exact,
            **cpu_load(data, size, reps)}


def cpu_load(data: bytes, size: int, reps: int) -> dict[str, Any]:
    """The file loaded onto the CPU by a process that sees no GPU: its GB/s (first call apart)."""
    folder = "/dev/shm" if os.path.isdir("/dev/shm") else None
    with tempfile.NamedTemporaryFile(dir=folder, suffix=".ckz") as f:
        f.write(data)
        f.flush()
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
        child = subprocess.run([sys.executable, __file__, "--cpu-load", f.name, "--reps", str(reps)], env=env,
                               capture_output=True, text=True, check=False)
    if child.returncode != 0:
        return {"cpu_load_error": child.stderr.strip()[-500:]}
    first, median = json.loads(child.stdout.splitlines()[-1])
    return {"cpu_load_gbs": size / median / GB, "first_cpu_load_s": first}


def _cpu_load_child(path: str, reps: int) -> None:
    with open(path, "rb") as f:
        data = f.read()
    times = []
    for _ in range(reps + 1):
        start = time.perf_counter()
        ckptzip.load(data, map_location="cpu")  # every tensor checksum verified
        times.append(time.perf_counter() - start)
    print(json.dumps([times[0], statistics.median(times[1:])]))


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj.contiguous()]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    return []


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--plane-mib", type=int, default=256, help="bytes of each class's plane (MiB)")
    parser.add_argument("--state-gib", type=float, default=4.0, help="size of the pipeline's state (GiB)")
    parser.add_argument("--reps", type=int, default=3, help="timed repetitions after the first call (median)")
    parser.add_argument("--huff-chunks", type=lambda v: [int(x) for x in v.split(",") if x], default=[64, 128],
                        help="ckz-huff also in chunks of these KiB (comma-separated; empty: none)")
    parser.add_argument("--encoder-split", action="store_true",
                        help="also time ckz-huff's encode kernel by kernel in the planning program's variants")
    parser.add_argument("--json", help="write the results here too")
    parser.add_argument("--cpu-load", help=argparse.SUPPRESS)  # the child process of cpu_load
    args = parser.parse_args(argv)
    if args.cpu_load:
        _cpu_load_child(args.cpu_load, args.reps)
        return 0
    if not torch.cuda.is_available() or not has_codec("ckz-huff", "cuda"):
        print("needs a CUDA GPU that runs ckz-huff's kernels", file=sys.stderr)
        return 2
    nvcomp = has_codec("ans", "cuda")
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | {cpu_threads()} CPU threads | "
          f"nvCOMP {'yes' if nvcomp else 'no'} | planes of {args.plane_mib} MiB, medians of {args.reps}", flush=True)
    g = torch.Generator(device="cuda").manual_seed(46)
    rows = (args.plane_mib << 20) // 4096
    tensors = trained_like(rows, 4096, 3, g)
    planes = {"fp32 weights": high_plane(tensors["weight"]), "exp_avg": high_plane(tensors["exp_avg"]),
              "exp_avg_sq": high_plane(tensors["exp_avg_sq"]), "bf16 grads": high_plane(tensors["grad"])}
    del tensors
    results: dict[str, Any] = {"device": torch.cuda.get_device_name(), "planes": {}, "pipeline": [], "problems": []}
    header = f"{'plane':<14}{'codec':<22}{'chunk':>6}{'ratio':>8}{'vs gdeflate':>12}{'enc GB/s':>10}{'dec GB/s':>10}" \
             f"{'1st enc s':>10}{'1st dec s':>10}{'CPU 1 core':>11}{'CPU all':>9}"
    print(header + "\n" + "-" * len(header), flush=True)
    for name, plane in planes.items():
        rows_out = []
        huff = coder_row("ckz-huff", get_codec({"id": "ckz-huff"}, "cuda"), plane, args.reps)
        rows_out.append(huff)
        problems = check_against_cpu(plane, huff["coded"])
        huff.update(cpu_decode("ckz-huff", huff["coded"], plane, args.reps))
        gpu_huff.FIRST = 12  # the single-level decoder: not shipped, so Triton's JIT compiles it
        try:
            single = coder_row("ckz-huff FIRST=12 (JIT)", gpu_huff.CkzHuffCudaCodec(), plane, args.reps)
        finally:
            gpu_huff.FIRST = 8
        rows_out.append(single)
        for kib in args.huff_chunks:  # more chunks a call, more warps at work: does the coder run faster?
            smaller = gpu_huff.CkzHuffCudaCodec()
            smaller.chunk_bytes = kib << 10  # type: ignore[misc]  # an instance's own chunk size
            rows_out.append(coder_row(f"ckz-huff {kib}K", smaller, plane, args.reps))
        for config in NVCOMP if nvcomp else []:
            row = coder_row(config["id"], get_codec(config, "cuda"), plane, args.reps)
            if config["id"] == "gdeflate" and has_codec("gdeflate", "cpu"):
                row.update(cpu_decode("gdeflate", row["coded"], plane, args.reps))
            rows_out.append(row)
        gdeflate = next((r for r in rows_out if r["codec"] == "gdeflate"), None)
        for row in rows_out:
            problems += [] if row["exact"] else [f"{row['codec']} does not round-trip" +
                                                 (f" ({row['error']})" if row["error"] else "")]
            problems += [f"the CPU does not decode {row['codec']}'s GPU chunks to their bytes"] \
                if row.get("cpu_exact") is False else []
            versus = f"{100 * (row['stored'] / gdeflate['stored'] - 1):+.2f}%" if gdeflate else "-"
            cpu1 = f"{row['1_cores_gbs']:.2f}" if "1_cores_gbs" in row else "-"
            cpus = f"{row[f'{cpu_threads()}_cores_gbs']:.2f}" if f"{cpu_threads()}_cores_gbs" in row else "-"
            print(f"{name:<14}{row['codec']:<22}{row['chunk_kib']:>5}K{row['ratio']:>8.4f}{versus:>12}"
                  f"{row['enc_gbs']:>10.1f}{row['dec_gbs']:>10.1f}{row['first_enc_s']:>10.3f}{row['first_dec_s']:>10.3f}"
                  f"{cpu1:>11}{cpus:>9}", flush=True)
            row.pop("coded")
        results["planes"][name] = rows_out
        results["problems"] += [f"{name}: {p}" for p in problems]
    if args.encoder_split:
        results["encoder_split"] = {}
        print("\nckz-huff's encode by kernel (GPU ms of one call; variants: the planning program's bytes a step, warps)")
        for name in ("fp32 weights", "exp_avg"):
            rows_out = results["encoder_split"][name] = encoder_split(planes[name], args.reps)
            for row in rows_out:
                kernels = ", ".join(f"{k} {1e3 * v:.2f}" for k, v in sorted(row["kernels_s"].items(), key=lambda kv: -kv[1]))
                print(f"  {name:<14}BLOCK {row['block']:>5} warps {row['warps']:>2}: {row['enc_gbs']:6.1f} GB/s "
                      f"(first {row['first_s']:.3f} s) | {kernels}", flush=True)
                results["problems"] += [] if row["same_chunks"] else \
                    [f"{name}: ckz-huff's encode with BLOCK={row['block']}, warps={row['warps']} gives other chunks"]
    del planes
    torch.cuda.empty_cache()
    state, size = state_of(args.state_gib, g)
    print(f"\npipeline: a trained-like state of {size / GB:.2f} GB (fp32 weights and moments, bf16 gradients)")
    for codec in ["huff", "auto"] if nvcomp else ["huff"]:
        row = pipeline(state, size, codec, args.reps)
        results["pipeline"].append(row)
        results["problems"] += [] if row["exact"] else [f"codec={codec}: the state does not load bit-exactly"]
        on_cpu = (f"{row['cpu_load_gbs']:.2f} GB/s on {cpu_threads()} cores (first {row['first_cpu_load_s']:.2f} s)"
                  if "cpu_load_gbs" in row else row.get("cpu_load_error", "?"))
        print(f"  codec={codec:<6} ratio {row['ratio']:.4f}  save {row['save_gbs']:.1f} GB/s (first "
              f"{row['first_save_s']:.2f} s)  load {row['load_gbs']:.1f} GB/s (first {row['first_load_s']:.2f} s)  "
              f"CPU load {on_cpu}", flush=True)
    for problem in results["problems"]:
        print(f"PROBLEM: {problem}")
    print("bit-exact: " + ("yes" if not results["problems"] else "NO"))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=1)
    return 1 if results["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
