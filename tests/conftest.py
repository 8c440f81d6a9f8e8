"""Test configuration: GPU tests skip without CUDA; JAX and TensorFlow do not preallocate GPU
memory; processes the tests start import what the tests do.

Markers (gpu, slow) and warning filters live in pyproject.toml; nothing here overrides them.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest
import torch

# One process runs Triton (the engine's GPU kernels, the interpreter tests, torch's own imports of
# it through transformers) and TensorFlow, whose LLVM command-line options clash with Triton's
# when TensorFlow's are registered first ("LLVM ERROR: inconsistency in registered CommandLine
# options"). ckptzip imports Triton only once a GPU path runs, so the suite loads it here, before
# any test module imports TensorFlow. (A user process that imports TensorFlow and then runs a GPU
# save has the same conflict: docs/INTEGRATIONS.md.)
with contextlib.suppress(ImportError):
    import triton  # noqa: F401
# ZipNN (a baseline of the harness, tests/bench/) segfaults in its first compress when its C core is
# imported after TensorFlow, which test_integration_tf.py imports at collection: it goes first too.
with contextlib.suppress(ImportError):
    import zipnn  # noqa: F401

# JAX and TensorFlow share the test process's GPUs with torch: they take device memory as they
# need it, not most of every GPU when they start (JAX starts at collection, for its skip marks).
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
os.environ.setdefault("TF_FORCE_GPU_ALLOW_GROWTH", "true")

# Test files run as worker scripts (tests/manager/test_manager_crash.py, tests/tier/*) import the
# helpers in tests/ and the harness in bench/, which pyproject's `pythonpath` gives only this process.
_ROOT = Path(__file__).resolve().parent.parent
os.environ["PYTHONPATH"] = os.pathsep.join(
    [str(_ROOT / "tests"), str(_ROOT / "bench"), *filter(None, [os.environ.get("PYTHONPATH")])]
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
