"""Benchmark support: baselines to compare against and helpers to measure and verify.

``ckptzip.bench.baselines`` wraps torch.save, safetensors, DCP (plain and zstd), CPU zstd, ZipNN
and plain nvCOMP behind one save/load interface; ``ckptzip.bench.measure`` walks and compares
states bit for bit and times a baseline end to end.
"""

from ckptzip.bench.baselines import BASELINES, Baseline, CodecThroughput, SaveResult, get_baseline
from ckptzip.bench.measure import (
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
