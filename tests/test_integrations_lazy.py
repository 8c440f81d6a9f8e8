"""``import ckptzip`` (and its DCP plugin) imports no framework integration: each is an optional
extra, imported only by its own module."""

from __future__ import annotations

import os
import subprocess
import sys

FRAMEWORKS = ("deepspeed", "megatron", "lightning", "pytorch_lightning", "transformers", "torchtitan")


def test_import_ckptzip_imports_no_framework() -> None:
    code = (
        "import sys, ckptzip, ckptzip.dcp, ckptzip.integrations; "
        f"loaded = [m for m in {FRAMEWORKS!r} if m in sys.modules]; "
        "assert not loaded, loaded"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    subprocess.run([sys.executable, "-c", code], check=True, env=env)
