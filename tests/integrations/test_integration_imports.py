"""The framework integrations are optional: ``import ckptzip`` (its DCP plugin and
``ckptzip.integrations`` too) imports none of the frameworks, each imported only by its own
module; an integration whose framework is missing says which extra to install."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

FRAMEWORKS = ("jax", "tensorflow", "keras", "orbax", "lightning", "pytorch_lightning", "transformers", "deepspeed",
              "megatron", "torchtitan", "torch_checkpointing")


def test_import_ckptzip_imports_no_framework() -> None:
    code = (
        "import sys, ckptzip, ckptzip.dcp, ckptzip.integrations\n"
        f"print(sorted(m for m in {FRAMEWORKS!r} if m in sys.modules))\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    assert done.stdout.strip() == "[]"


def test_missing_framework_names_the_extra() -> None:
    code = (
        "import sys\n"
        "sys.modules.update(jax=None, tensorflow=None, keras=None)\n"  # as if not installed
        "for name in ('jax', 'tf'):\n"
        "    try:\n"
        "        __import__('ckptzip.integrations.' + name)\n"
        "    except ImportError as exc:\n"
        "        print(exc)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.splitlines() == [
        "ckptzip.integrations.jax needs JAX, which is not installed; install it with: pip install 'ckptzip[jax]'",
        "ckptzip.integrations.tf needs TensorFlow, which is not installed; install it with: pip install 'ckptzip[tf]'",
    ]


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
