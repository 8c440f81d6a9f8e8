"""How fast pinned staging is made: ckptzip's snapshot slab (``ckptzip.memory.pinned.Slab``: an anonymous mapping
advised to huge pages, faulted in by torch's threads, registered with CUDA) against the same
without the advice (``torch.empty`` + ``fill_`` + ``cudaHostRegister``), alternated.
Usage: python bench/pinned_probe.py [--gib 1,8]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from ckptzip.memory import pinned


def plain(nbytes: int) -> None:
    memory = torch.empty(nbytes, dtype=torch.uint8).fill_(0)
    cudart = torch.cuda.cudart()
    cudart.cudaHostRegister(memory.data_ptr(), nbytes, 0)
    cudart.cudaHostUnregister(memory.data_ptr())


def slab(nbytes: int) -> None:
    pinned.Slab(nbytes)  # unregistered and freed when dropped


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", default="1,8")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    torch.zeros(1, device="cuda")
    for gib in (int(g) for g in args.gib.split(",")):
        for _ in range(args.rounds):
            for name, make in (("plain", plain), ("slab", slab)):
                start = time.perf_counter()
                make(gib << 30)
                seconds = time.perf_counter() - start
                print(json.dumps({"method": name, "gib": gib, "s": round(seconds, 3),
                                  "gbps": round((gib << 30) / seconds / 1e9, 1)}), flush=True)


if __name__ == "__main__":
    main()
