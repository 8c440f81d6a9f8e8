"""How long one nvCOMP encode launch takes against the bytes and the chunks in it.

A save on a GPU that training has filled codes small batches: if a codec's launch costs about the
same whatever it holds, small batches pay it many times. Codes an exponent-like plane (byte 3 of
fp32 weights of scale 0.02) in launches of several sizes and chunk sizes, and prints the median
time per launch and GB/s. Usage: python bench/chunk_probe.py [--codecs gdeflate-0,ans]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from ckptzip.codecs import get_codec

_CODECS = {"gdeflate-0": {"id": "gdeflate", "algorithm_type": 0}, "gdeflate-1": {"id": "gdeflate", "algorithm_type": 1},
           "ans": {"id": "ans", "data_type": "|u1"}}


def plane(nbytes: int) -> torch.Tensor:
    weights = torch.randn(nbytes, device="cuda") * 0.02
    return weights.view(torch.uint8).view(-1, 4)[:, 3].contiguous()


def launch_seconds(codec: object, data: torch.Tensor, launch: int, chunk: int, reps: int) -> float:
    chunks = [data[i : i + chunk] for i in range(0, launch, chunk)]
    codec.encode(chunks)  # type: ignore[attr-defined]
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        codec.encode(chunks)  # type: ignore[attr-defined]
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--codecs", default="gdeflate-0,ans")
    ap.add_argument("--launch-mib", default="16,64,128,512,1024")
    ap.add_argument("--chunk-kib", default="32,64,128,256")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    launches = [int(m) << 20 for m in args.launch_mib.split(",")]
    data = plane(max(launches))
    for name in args.codecs.split(","):
        codec = get_codec(_CODECS[name], "cuda")
        for chunk in (int(k) << 10 for k in args.chunk_kib.split(",")):
            for launch in launches:
                seconds = launch_seconds(codec, data, launch, chunk, args.reps)
                print(json.dumps({"codec": name, "chunk_kib": chunk >> 10, "launch_mib": launch >> 20,
                                  "chunks": launch // chunk, "ms": round(seconds * 1e3, 3),
                                  "gbps": round(launch / seconds / 1e9, 1)}), flush=True)


if __name__ == "__main__":
    main()
