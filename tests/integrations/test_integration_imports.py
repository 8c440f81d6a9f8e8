"""The framework integrations are optional: ``import ckptzip`` imports none of the frameworks, and
an integration whose framework is missing says which extra to install."""

from __future__ import annotations

import subprocess
import sys

FRAMEWORKS = ("jax", "tensorflow", "keras", "orbax", "lightning", "pytorch_lightning", "transformers")


def test_import_ckptzip_imports_no_framework() -> None:
    code = (
        "import sys, ckptzip, ckptzip.integrations\n"
        f"print(sorted(m for m in {FRAMEWORKS!r} if m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
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
