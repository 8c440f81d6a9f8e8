"""First look on the GPU machine: bit-exactness of every preset on real training state, GPU-resident
throughput, end-to-end save/load against torch.save, and the hardware ceilings.

    python3 bench/gpu_probe.py --preset medium --steps 30 --out $OUT/probe.json
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch

import ckptzip
from ckptzip_bench.gpu import ceilings, measure_resident
from ckptzip_bench.measure import assert_state_equal, tensor_nbytes
from ckptzip_bench.gpu import encode_resident
from ckptzip.report import class_table, tensor_table
from ckptzip.demo.training import train


def _timed(fn):  # noqa: ANN001, ANN202
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, time.perf_counter() - start


def _profile(state, path, codec) -> None:  # noqa: ANN001
    from torch.profiler import ProfilerActivity, profile

    for name, fn in (("encode", lambda: encode_resident(state, codec)),
                     ("load", lambda: ckptzip.load(path, map_location="cuda"))):
        fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        print(f"--- profile {name} ({codec})")
        print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=22, max_name_column_width=60))
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="medium")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--bf16-weights", action="store_true")
    p.add_argument("--codecs", default="auto,fast,portable,zstd,ans")
    p.add_argument("--dir", default=None)
    p.add_argument("--out", default=None)
    p.add_argument("--profile", action="store_true", help="profile one encode and decode of the first codec")
    args = p.parse_args()
    result = train(args.preset, args.steps, device="cuda", bf16_weights=args.bf16_weights)
    state = result.state()
    raw = tensor_nbytes(state)
    print(f"state: {args.preset} bf16_weights={args.bf16_weights}, {raw / 1e9:.3f} GB, "
          f"loss {result.losses[0]:.3f}->{result.losses[-1]:.3f}", flush=True)
    report: dict = {"preset": args.preset, "raw_bytes": raw, "device": torch.cuda.get_device_name(),
                    "ceilings": ceilings(directory=args.dir), "methods": []}
    print("ceilings", json.dumps(report["ceilings"]), flush=True)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        pt = Path(tmp) / "state.pt"

        def torch_save() -> None:
            with open(pt, "wb") as f:
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())

        _, save_s = _timed(torch_save)
        _, load_s = _timed(lambda: torch.load(pt, map_location="cuda", weights_only=True))
        report["methods"].append({"name": "torch.save", "ratio": raw / pt.stat().st_size,
                                  "save_s": save_s, "load_s": load_s})
        pt.unlink()
        for codec in args.codecs.split(","):
            path = Path(tmp) / f"state-{codec}.ckz"
            _, save_s = _timed(lambda: ckptzip.save(state, path, codec=codec))
            back, load_s = _timed(lambda: ckptzip.load(path, map_location="cuda"))
            assert_state_equal(state, back)
            del back
            back_cpu = ckptzip.load(path, map_location="cpu")
            assert_state_equal(state, back_cpu)
            del back_cpu
            resident = measure_resident(state, path, codec)
            with ckptzip.open(path) as r:
                table = class_table(r.entries())
                if args.profile:
                    print(tensor_table(r.entries(), limit=12))
                    grads = [e for e in r.entries() if e.name.startswith("grads.")][:4]
                    print(tensor_table(grads))
            if args.profile:
                _profile(state, path, codec)
            row = {"name": f"ckptzip-{codec}", "ratio": raw / path.stat().st_size, "save_s": save_s,
                   "load_s": load_s, "resident_ratio": resident.ratio, "encode_gbps": resident.encode_gbps,
                   "decode_gbps": resident.decode_gbps, "classes": table}
            report["methods"].append(row)
            print(f"{codec}: bit-exact; file ratio {row['ratio']:.4f}; GPU-resident encode {resident.encode_gbps:.0f} "
                  f"GB/s decode {resident.decode_gbps:.0f} GB/s; save {save_s:.2f}s load {load_s:.2f}s\n{table}",
                  flush=True)
            path.unlink()
    print(f"{'method':20}{'ratio':>8}{'save s':>8}{'load s':>8}{'enc GB/s':>10}{'dec GB/s':>10}")
    for m in report["methods"]:
        print(f"{m['name']:20}{m['ratio']:8.4f}{m['save_s']:8.2f}{m['load_s']:8.2f}"
              f"{m.get('encode_gbps', 0):10.0f}{m.get('decode_gbps', 0):10.0f}")
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
