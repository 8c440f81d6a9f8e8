"""The benchmark harness (``ckptzip bench``, docs/BENCH.md), kept out of the ckptzip wheel: it uses
ckptzip's public API and the engine's modules, and the models of :mod:`ckptzip.demo.training`.
Install it with ``pip install -e bench`` from a checkout; ``ckptzip bench`` also finds it there.

``ckptzip_bench.baselines`` wraps torch.save, safetensors, DCP (plain and zstd), CPU zstd, ZipNN
and plain nvCOMP behind one save/load interface; ``ckptzip_bench.measure`` walks states and times
a baseline end to end, comparing what it restored bit for bit.
"""

from .baselines import BASELINES, Baseline, CodecThroughput, SaveResult, get_baseline
from .measure import (
    BaselineRun,
    assert_state_equal,
    flat_tensors,
    iter_tensors,
    run_baseline,
    tensor_nbytes,
)

__all__ = [
    "BASELINES",
    "Baseline",
    "BaselineRun",
    "CodecThroughput",
    "SaveResult",
    "assert_state_equal",
    "flat_tensors",
    "get_baseline",
    "iter_tensors",
    "run_baseline",
    "tensor_nbytes",
]
