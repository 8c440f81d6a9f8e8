"""Issue 11, item 3: per tensor class of a trained state, the ratio of what ckptzip stores (byte
planes, each plane's codec picked as the backend does) against codecs on the tensor's raw bytes,
and the best of them per tensor (what a per-tensor trial could reach). On the CPU the raw-byte
candidates are zstd levels 1 and 3; on a GPU (``--device cuda``, needs nvCOMP) nvCOMP's zstd and
its ANS in float mode (``data_type`` from the dtype), one call per tensor.

    python3 bench/codec_candidates.py --preset tiny --steps 20            # fp32 weights, grads, AdamW
    python3 bench/codec_candidates.py --preset tiny --steps 20 --bf16     # bf16 weights + fp32 master
    python3 bench/codec_candidates.py --preset medium --steps 100 --device cuda
"""

from __future__ import annotations

import argparse
import collections
from collections.abc import Callable

import torch
import zstandard

import ckptzip
from ckptzip.bench.baselines import get_baseline
from ckptzip.bench.training import train, training_state
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
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--bf16", action="store_true", help="bf16 weights and grads, fp32 master weights")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    args = p.parse_args()
    run = train(args.preset, args.steps, device=torch.device(args.device), bf16_weights=args.bf16)
    state = training_state(run.model, run.optimizer, run.step, master_weights=run.master_weights, include_grads=True)
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
