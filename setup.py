"""The compiled CPU kernels (src/ckptzip/kernels/_cpu.c); everything else is in pyproject.toml.

``optional``: where no C compiler is at hand the install goes on without them, and ckptzip runs
its NumPy kernels instead (ckptzip.kernels.cpu).
"""

import sys

from setuptools import Extension, setup

flags = [] if sys.platform == "win32" else ["-O3", "-pthread"]
setup(ext_modules=[Extension(
    "ckptzip.kernels._cpu", ["src/ckptzip/kernels/_cpu.c"], extra_compile_args=flags,
    extra_link_args=[] if sys.platform == "win32" else ["-pthread"], optional=True,
)])
