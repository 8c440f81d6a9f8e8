"""Files the CPU writes decode bit-exactly on a GPU (nvCOMP's zstd reads the CPU's frames, those
of ``long_matches_only`` included), and GPU ``portable`` files on the CPU. On a GPU machine:

    python3 bench/cross_device_check.py
"""

from __future__ import annotations

import io

import torch

import ckptzip
from ckptzip.demo.training import train, training_state
from ckptzip.tree import flatten


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.detach().cpu().contiguous().view(torch.uint8), b.detach().cpu().contiguous().view(torch.uint8))


def main() -> None:
    run = train("tiny", 20, device="cuda")
    state = training_state(run.model, run.optimizer, run.step, include_grads=True)
    on_gpu = {item.name: item.tensor for item in flatten(state).tensors}
    host = {name: t.cpu() for name, t in on_gpu.items()}
    for codec in ("auto", "portable"):
        blob = io.BytesIO()
        ckptzip.save(host, blob, codec=codec)
        with ckptzip.open(io.BytesIO(blob.getvalue())) as reader:
            literal = sum(bool(s.codec.get("long_matches_only")) for e in reader.entries() for s in e.streams)
        back = ckptzip.load(io.BytesIO(blob.getvalue()), map_location="cuda")
        assert all(back[k].is_cuda and same_bits(back[k], host[k]) for k in host), codec
        print(f"CPU {codec} -> GPU: bit-exact, {literal} streams without short matches")
    blob = io.BytesIO()
    ckptzip.save(on_gpu, blob, codec="portable")
    back = ckptzip.load(io.BytesIO(blob.getvalue()), map_location="cpu")
    assert all(same_bits(back[k], host[k]) for k in host)
    print("GPU portable -> CPU: bit-exact")


if __name__ == "__main__":
    main()
