"""``import ckptzip`` (and its DCP plugin) imports no framework integration: each is an optional
extra, imported only by its own module."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

FRAMEWORKS = ("deepspeed", "megatron", "lightning", "pytorch_lightning", "transformers", "torchtitan")


def test_import_ckptzip_imports_no_framework() -> None:
    code = (
        "import sys, ckptzip, ckptzip.dcp, ckptzip.integrations; "
        f"loaded = [m for m in {FRAMEWORKS!r} if m in sys.modules]; "
        "assert not loaded, loaded"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


def test_import_ckptzip_after_tensorflow_imports_no_gpu_library() -> None:
    """TensorFlow first, then ckptzip (the order that aborted the process while ckptzip imported
    Triton, whose LLVM clashes with TensorFlow's); a save and load on the CPU load neither Triton
    nor nvCOMP either."""
    pytest.importorskip("tensorflow")
    code = (
        "import sys, io, tensorflow, torch, ckptzip; "
        "gpu = lambda: [m for m in ('triton', 'nvidia.nvcomp') if m in sys.modules]; "
        "assert not gpu(), gpu(); "
        "b = io.BytesIO(); ckptzip.save({'w': torch.randn(5000)}, b); ckptzip.load(b.getvalue()); "
        "assert not gpu(), gpu()"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "TF_CPP_MIN_LOG_LEVEL": "3"}
    env.pop("TRITON_INTERPRET", None)
    subprocess.run([sys.executable, "-c", code], check=True, env=env)
