"""Write the golden files. Run on a machine with a CUDA GPU and nvCOMP to make all of them:

    PYTHONPATH=src:tests python tests/golden/make_golden.py tests/golden

Files: cpu_zstd_v1_0.ckz (CPU, portable), gpu_zstd_v1_0.ckz (GPU nvCOMP zstd, portable),
gpu_ans_v1_0.ckz (GPU nvCOMP ans, default preset). Never regenerate a committed golden file for
the same format version: old files must keep reading.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

import ckptzip
from golden_state import golden_state


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
    ckptzip.save(state, out / "cpu_zstd_v1_0.ckz", codec="portable")
    if torch.cuda.is_available():
        gpu = _to(state, "cuda")
        ckptzip.save(gpu, out / "gpu_zstd_v1_0.ckz", codec="portable")
        ckptzip.save(gpu, out / "gpu_ans_v1_0.ckz", codec="auto")
    for path in sorted(out.glob("*.ckz")):
        with ckptzip.open(path) as r:
            codecs = sorted({c for e in r.entries() for c in e.codecs})
            print(f"{path.name}: {r.file_size} bytes, codecs {codecs}")


if __name__ == "__main__":
    main(sys.argv[1])
