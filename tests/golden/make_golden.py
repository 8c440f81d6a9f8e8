"""Write the golden files. Run on a machine with a CUDA GPU and nvCOMP to make all of them:

    PYTHONPATH=src:tests python tests/golden/make_golden.py tests/golden

ckz-huff (the "huff" preset): cpu_ckzhuff_v2_1.ckz (golden_state, a cast making it 2.1), its GPU
twin gpu_ckzhuff_v2_1.ckz, cpu_ckzhuff_v2_2_sparse.ckz (golden_sparse_delta_state against
cpu_zstd_v2_1_refs.ckz), and ckzhuff_chunks.npz (chunks of every kind, raw and coded).
Files of format 2.0: cpu_zstd_v2_0.ckz (CPU, portable), gpu_zstd_v2_0.ckz (GPU nvCOMP zstd,
portable), gpu_ans_v2_0.ckz (GPU nvCOMP ans, then the default preset; now "fast").
Format 2.1: gpu_gdeflate_v2_1.ckz (GPU, "auto", the default preset since issue 22), cpu_zstd_v2_1_refs.ckz
(casts and a duplicate, golden_state_2_1) and cpu_zstd_v2_1_delta.ckz (golden_delta_state, XOR
deltas against cpu_zstd_v2_1_refs.ckz as its base, "step" 100). Format 2.2:
cpu_zstd_v2_2_sparse.ckz (golden_sparse_delta_state, XOR deltas coded sparse against the same
base). torch_checkpointing_v1.pt: golden_state_2_1 as ckptzip.integrations.torch_checkpointing
writes an item (a torch.save archive of one ckptzip container, its format 1). The *_v1_0 files were
written by ckptzip 0.1.0 in format 1.0. Never regenerate a committed golden file of an earlier
format version: old files must keep reading. Files that exist are not overwritten.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

import ckptzip
from ckptzip.api import write_checkpoint
from ckptzip.engine.policy import Policy
from ckptzip.engine.sources import DeltaBase
from ckptzip.format import BaseRef, content_hash
from ckptzip.tree import flatten
import numpy as np

from ckzhuff_reference import samples
from ckptzip.codecs import get_codec
from golden_state import golden_delta_state, golden_sparse_delta_state, golden_state, golden_state_2_1


def _to(obj, device):  # noqa: ANN001, ANN202
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, dict):
        out = type(obj)((k, _to(v, device)) for k, v in obj.items())
        return out
    if isinstance(obj, list):
        return [_to(v, device) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_to(v, device) for v in obj)
    return obj


def main(out_dir: str) -> None:
    out = Path(out_dir)
    state = golden_state()
    targets = [("cpu_zstd_v2_0.ckz", state, "portable"), ("cpu_ckzhuff_v2_1.ckz", state, "huff")]
    if torch.cuda.is_available():
        gpu = _to(state, "cuda")
        targets += [("gpu_zstd_v2_0.ckz", gpu, "portable"), ("gpu_ans_v2_0.ckz", gpu, "fast"),
                    ("gpu_gdeflate_v2_1.ckz", gpu, "auto"), ("gpu_ckzhuff_v2_1.ckz", gpu, "huff")]
    targets += [("cpu_zstd_v2_1_refs.ckz", golden_state_2_1(), "portable")]
    for name, obj, codec in targets:
        if not (out / name).exists():
            ckptzip.save(obj, out / name, codec=codec)
    with ckptzip.open(out / "cpu_zstd_v2_1_refs.ckz") as base:
        ref = BaseRef(100, "cpu_zstd_v2_1_refs.ckz", content_hash(base.entries()))
    tensors = {item.name: item.tensor for item in flatten(golden_state_2_1()).tensors}
    for name, later, codec in [("cpu_zstd_v2_1_delta.ckz", golden_delta_state, "portable"),
                               ("cpu_zstd_v2_2_sparse.ckz", golden_sparse_delta_state, "portable"),
                               ("cpu_ckzhuff_v2_2_sparse.ckz", golden_sparse_delta_state, "huff")]:
        if not (out / name).exists():
            with open(out / name, "xb") as f:
                write_checkpoint(f, later(), Policy.parse(codec), base=DeltaBase(ref, tensors))
    ckzhuff_chunks(out / "ckzhuff_chunks.npz")
    if not (out / "torch_checkpointing_v1.pt").exists():  # an item of ckptzip.integrations.torch_checkpointing
        from ckptzip.memory.pinned import PinnedPool
        from ckptzip.integrations.torch_checkpointing import CompressedItem

        torch.save(CompressedItem.stage(golden_state_2_1(), "portable", PinnedPool(), None),
                   out / "torch_checkpointing_v1.pt")
    for path in sorted(out.glob("*.ckz")):
        with ckptzip.open(path) as r:
            codecs = sorted({c for e in r.entries() for c in e.codecs})
            print(f"{path.name}: {r.file_size} bytes, codecs {codecs}")


def ckzhuff_chunks(path: Path) -> None:
    """ckz-huff chunks of every kind and of sizes around its rounds, written by the CPU encoder
    (the GPU's writes the same bytes): raw_<kind>_<n> and enc_<kind>_<n>."""
    if path.exists():
        return
    codec = get_codec({"id": "ckz-huff"}, "cpu")
    arrays = {}
    for n in (1, 17, 513, 4096, 8193, 65_536):
        for kind, data in samples(n, n).items():
            if n == 65_536 and kind != "fp32 sign+exponent":
                continue
            key = f"{kind.replace(' ', '-')}_{n}"
            (coded,) = codec.encode([torch.from_numpy(data)])
            arrays[f"raw_{key}"], arrays[f"enc_{key}"] = data, coded.numpy()
    np.savez_compressed(path, **arrays)


if __name__ == "__main__":
    main(sys.argv[1])
