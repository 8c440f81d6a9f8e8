"""Issue 11, item 3: per tensor class of a trained state, the ratio of what ckptzip stores (byte
planes, each plane's codec picked as the backend does) against codecs on the tensor's raw bytes,
and the best of them per tensor (what a per-tensor trial could reach). On the CPU the raw-byte
candidates are zstd levels 1 and 3; on a GPU (``--device cuda``, needs nvCOMP) nvCOMP's zstd and
its ANS in float mode (``data_type`` from the dtype), one call per tensor, beside what ckptzip's
``auto`` stores when the same tensor is saved from the CPU (zstd per plane, picked by a trial) and
what ``portable`` stores on the GPU (nvCOMP zstd per plane).

    python3 bench/codec_candidates.py --preset tiny --steps 20            # fp32 weights, grads, AdamW
    python3 bench/codec_candidates.py --preset tiny --steps 20 --bf16     # bf16 weights + fp32 master
    python3 bench/codec_candidates.py --preset medium --steps 100 --device cuda
    python3 bench/codec_candidates.py --preset medium --steps 100 --device cuda --planes

``--planes`` splits each float tensor into its byte planes (as ckptzip does) and codes every plane
with each codec of both backends, beside its order-0 entropy bound: where one backend's plane codec
loses to another's, by tensor class and plane.
"""

from __future__ import annotations

import argparse
import collections
from collections.abc import Callable

import numpy as np
import torch
import zstandard

import ckptzip
from ckptzip_bench.baselines import get_baseline
from ckptzip.demo.training import train, training_state
from ckptzip.engine.policy import codec_for
from ckptzip.report import tensor_class
from ckptzip.tree import flatten

LEVELS = (1, 3)
GPU_CANDIDATES = ("nvcomp-zstd", "nvcomp-ans-typed")


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def candidates(device: str) -> dict[str, Callable[[torch.Tensor], int]]:
    """Name -> the stored size of a tensor's raw bytes under that codec."""
    if device == "cpu":
        coders = {level: zstandard.ZstdCompressor(level=level) for level in LEVELS}
        return {f"zstd-{level} raw": (lambda t, c=c: len(c.compress(_raw(t).numpy().tobytes())))
                for level, c in coders.items()}
    out = {}
    for name in GPU_CANDIDATES:
        baseline = get_baseline(name)
        ok, why = baseline.available()
        if not ok:
            raise SystemExit(f"{name}: {why}")
        out[f"{name} raw"] = lambda t, b=baseline: sum(x.numel() for x in b.encode_on_device([t]))
    out["ckptzip auto, cpu"] = lambda t: ckptzip.compress(t.cpu()).compressed_nbytes
    out["ckptzip portable"] = lambda t: ckptzip.compress(t, codec="portable").compressed_nbytes
    return out


# GPU codecs of ckptzip tried on each plane, in the chunks ckptzip would store them in.
GPU_PLANE_CODECS = {
    "ans": ({"id": "ans", "data_type": "|u1"}, 1 << 20),
    "gdeflate-0": ({"id": "gdeflate", "algorithm_type": 0}, 1 << 16),
    "gdeflate-1": ({"id": "gdeflate", "algorithm_type": 1}, 1 << 16),
    "nvcomp zstd": ({"id": "zstd"}, 1 << 18),
}


def _chunked(config: dict, chunk: int) -> Callable[[torch.Tensor], int]:
    codec = codec_for(config, "cuda")

    def size(plane: torch.Tensor) -> int:
        offsets = np.arange(0, plane.numel(), chunk, dtype=np.int64)
        lengths = np.minimum(chunk, plane.numel() - offsets)
        return min(plane.numel(), int(codec.encode_segments(plane, offsets, lengths)[2].sum()))

    return size


def _zstd_size(compressor: zstandard.ZstdCompressor) -> Callable[[torch.Tensor], int]:
    return lambda t: len(compressor.compress(t.cpu().numpy().tobytes()))


def plane_candidates(device: str) -> dict[str, Callable[[torch.Tensor], int]]:
    """Name -> the stored size of a ``uint8`` plane under that codec (zstd on the CPU, with
    ckptzip's float-plane candidates; on a GPU also ckptzip's nvCOMP codecs, chunked as stored)."""
    out: dict[str, Callable[[torch.Tensor], int]] = {
        f"zstd-{level}": _zstd_size(zstandard.ZstdCompressor(level=level)) for level in LEVELS}
    literals = codec_for({"id": "zstd", "level": 1, "long_matches_only": True}, "cpu")
    out["zstd-1 long matches"] = lambda t: literals.encode([t.cpu()])[0].numel()
    if device == "cuda":
        out.update({name: _chunked(config, chunk) for name, (config, chunk) in GPU_PLANE_CODECS.items()})
    return out


def entropy_bytes(plane: torch.Tensor) -> float:
    """The order-0 entropy bound of ``plane`` in bytes."""
    counts = torch.bincount(plane, minlength=256).double()
    p = counts[counts > 0] / plane.numel()
    return float(-(p * p.log2()).sum()) * plane.numel() / 8


def by_plane(state: object, device: str) -> None:
    """Print, per tensor class, dtype and plane, the ratio of each codec against the entropy bound."""
    coders = plane_candidates(device)
    rows: dict[str, list[float]] = collections.defaultdict(lambda: [0.0] * (2 + len(coders)))
    for item in flatten(state).tensors:
        t = item.tensor
        if not t.is_floating_point() or t.nbytes < 4096 or t.element_size() not in (2, 4, 8):
            continue
        planes = t.detach().contiguous().view(torch.uint8).reshape(-1, t.element_size())
        for p in range(t.element_size()):
            plane = planes[:, p].contiguous()
            row = rows[f"{tensor_class(item.name, t)} {str(t.dtype).removeprefix('torch.')} #{p}"]
            row[0] += plane.numel()
            row[1] += entropy_bytes(plane)
            for k, size_of in enumerate(coders.values()):
                row[2 + k] += size_of(plane)
    print(f"{'class, plane (#0: low byte)':32s} {'MB':>7s} {'bound':>7s} " + " ".join(f"{n:>16s}" for n in coders))
    for name, (n, bound, *sizes) in sorted(rows.items()):
        print(f"{name:32s} {n / 1e6:7.2f} {n / bound:7.3f} " + " ".join(f"{n / s:16.3f}" for s in sizes))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--bf16", action="store_true", help="bf16 weights and grads, fp32 master weights")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--planes", action="store_true", help="per byte plane, against the entropy bound")
    args = p.parse_args()
    run = train(args.preset, args.steps, device=torch.device(args.device), bf16_weights=args.bf16)
    state = training_state(run.model, run.optimizer, run.step, master_weights=run.master_weights, include_grads=True)
    if args.planes:
        by_plane(state, args.device)
        return
    coders = candidates(args.device)
    rows: dict[str, list[int]] = collections.defaultdict(lambda: [0] * (3 + len(coders)))
    for item in flatten(state).tensors:
        t = item.tensor
        if not t.is_floating_point() or t.dim() == 0:
            continue
        planes = ckptzip.compress(t).compressed_nbytes  # stored streams, no container header
        others = [size_of(t) for size_of in coders.values()]
        row = rows[f"{tensor_class(item.name, t)} {str(t.dtype).removeprefix('torch.')}"]
        row[0] += t.nbytes
        row[1] += planes
        row[2] += min(planes, *others)
        for k, size in enumerate(others):
            row[3 + k] += size
    print(f"{'class':24s} {'MB':>7s} {'ckptzip':>8s} " + " ".join(f"{name:>18s}" for name in coders) + f" {'best of':>8s}")
    for name, (n, planes, best, *others) in sorted(rows.items()):
        print(f"{name:24s} {n / 1e6:7.2f} {n / planes:8.3f} " + " ".join(f"{n / size:18.3f}" for size in others)
              + f" {n / best:8.3f}")


if __name__ == "__main__":
    main()
