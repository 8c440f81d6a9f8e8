"""Issue 11, item 3 on the CPU backend: per tensor class of a trained state, the ratio of what
ckptzip stores (byte planes, each plane's codec picked by a trial on a sample) against zstd on the
tensor's raw bytes, and the best of the two per tensor (what a per-tensor trial could reach).

    python3 bench/codec_candidates.py --preset tiny --steps 20            # fp32 weights, grads, AdamW
    python3 bench/codec_candidates.py --preset tiny --steps 20 --bf16     # bf16 weights + fp32 master
"""

from __future__ import annotations

import argparse
import collections

import torch
import zstandard

import ckptzip
from ckptzip.bench.training import train, training_state
from ckptzip.report import tensor_class
from ckptzip.tree import flatten

LEVELS = (1, 3)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--bf16", action="store_true", help="bf16 weights and grads, fp32 master weights")
    args = p.parse_args()
    run = train(args.preset, args.steps, device=torch.device("cpu"), bf16_weights=args.bf16)
    state = training_state(run.model, run.optimizer, run.step, master_weights=run.master_weights, include_grads=True)
    coders = {level: zstandard.ZstdCompressor(level=level) for level in LEVELS}
    rows: dict[str, list[int]] = collections.defaultdict(lambda: [0] * (3 + len(LEVELS)))
    for item in flatten(state).tensors:
        t = item.tensor
        if not t.is_floating_point() or t.dim() == 0:
            continue
        raw = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        planes = ckptzip.compress(t).compressed_nbytes  # stored streams, no container header
        lz = [len(coders[level].compress(raw)) for level in LEVELS]
        row = rows[f"{tensor_class(item.name, t)} {str(t.dtype).removeprefix('torch.')}"]
        row[0] += len(raw)
        row[1] += planes
        row[2] += min(planes, *lz)
        for k, size in enumerate(lz):
            row[3 + k] += size
    print(f"{'class':24s} {'MB':>7s} {'ckptzip':>8s} " + " ".join(f"{'zstd-' + str(v) + ' raw':>11s}" for v in LEVELS)
          + f" {'best of':>8s}")
    for name, (n, planes, best, *lz) in sorted(rows.items()):
        print(f"{name:24s} {n / 1e6:7.2f} {n / planes:8.3f} " + " ".join(f"{n / size:11.3f}" for size in lz)
              + f" {n / best:8.3f}")


if __name__ == "__main__":
    main()
