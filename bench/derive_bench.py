"""Issue 24's numbers: the duplicate and cast search on many equal-size small tensors, where it was
quadratic (20k tensors saved in 32 s, 100k in over 200 s).

For each count N: N float32 tensors of ``--numel`` elements (one size, so all are candidates of one
another), a copy of every 7th and a bf16 cast of every 11th; the time of ``find_duplicates`` plus
``find_casts`` alone, then of ``ckptzip.save`` + ``ckptzip.load`` of the whole state (checked
bit-exact, references checked found) against ``torch.save`` + ``torch.load``, all in memory.

    PYTHONPATH=src python bench/derive_bench.py --counts 10000 20000 50000 100000 --out derive.json
"""

from __future__ import annotations

import argparse
import io
import json
import time
from typing import Any

import torch

import ckptzip
from ckptzip.engine.derive import find_casts, find_duplicates


def make_state(n: int, numel: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(n)
    state = {f"t{i}": torch.randn(numel, generator=g) for i in range(n)}
    state.update({f"copy{i}": state[f"t{i}"].clone() for i in range(0, n, 7)})
    state.update({f"cast{i}": state[f"t{i}"].bfloat16() for i in range(3, n, 11)})
    return state


def timed(fn: Any) -> tuple[float, Any]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def measure(n: int, numel: int) -> dict[str, Any]:
    state = make_state(n, numel)
    tensors = list(state.values())
    search_s, (dups, casts) = timed(lambda: (d := find_duplicates(tensors), find_casts(tensors, skip=set(d))))
    assert len(dups) == len(range(0, n, 7)) and len(casts) == len(range(3, n, 11)), (len(dups), len(casts))
    buf = io.BytesIO()
    save_s, _ = timed(lambda: ckptzip.save(state, buf))
    load_s, loaded = timed(lambda: ckptzip.load(buf.getvalue()))
    assert loaded.keys() == state.keys() and all(
        torch.equal(loaded[k].view(torch.uint8), v.view(torch.uint8)) for k, v in state.items())
    ref = io.BytesIO()
    torch_save_s, _ = timed(lambda: torch.save(state, ref))
    torch_load_s, _ = timed(lambda: torch.load(io.BytesIO(ref.getvalue())))
    return {"tensors": len(state), "search_s": search_s, "save_s": save_s, "load_s": load_s,
            "torch_save_s": torch_save_s, "torch_load_s": torch_load_s, "duplicates": len(dups), "casts": len(casts)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--counts", type=int, nargs="+", default=[10_000, 20_000, 50_000, 100_000])
    parser.add_argument("--numel", type=int, default=16)
    parser.add_argument("--out", help="write the rows as JSON here")
    args = parser.parse_args()
    rows = []
    print("| N | tensors | search s | ckptzip save s | ckptzip load s | torch.save s | torch.load s |")
    print("|---|---|---|---|---|---|---|")
    for n in args.counts:
        row = {"n": n, **measure(n, args.numel)}
        rows.append(row)
        print(f"| {n} | {row['tensors']} | {row['search_s']:.2f} | {row['save_s']:.2f} | {row['load_s']:.2f} | "
              f"{row['torch_save_s']:.2f} | {row['torch_load_s']:.2f} |", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"numel": args.numel, "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
