"""The compiled CPU kernels (src/ckptzip/kernels/_cpu.c), the GDeflate decoder and the GDeflate
encoder's shim; everything else is in pyproject.toml.

``optional``: where no C compiler is at hand the install goes on without them, and ckptzip runs
its NumPy kernels instead (ckptzip.kernels.cpu). The decoder (C, src/ckptzip/codecs/_gdeflate.c)
is ckptzip's own: without it the CPU ``gdeflate`` codec reports itself unavailable, so a GPU's
default file needs a GPU to load. The shim (C++, src/ckptzip/codecs/_gdeflate_shim.cpp) loads
nvCOMP's CPU library at run time, so building it needs no nvCOMP; without it the CPU ``gdeflate``
codec decodes but cannot encode (ckptzip.codecs._gdeflate_lib).
"""

import sys

from setuptools import Extension, setup

flags = [] if sys.platform == "win32" else ["-O3", "-pthread"]
shared = ["src/ckptzip/_pybuffers.h"]  # the three C extensions' argument checks
setup(ext_modules=[Extension(
    "ckptzip.kernels._cpu", ["src/ckptzip/kernels/_cpu.c"], extra_compile_args=flags,
    extra_link_args=[] if sys.platform == "win32" else ["-pthread"], depends=shared, optional=True,
), Extension(
    "ckptzip.codecs._gdeflate", ["src/ckptzip/codecs/_gdeflate.c"],
    extra_compile_args=[] if sys.platform == "win32" else ["-O3"], depends=shared, optional=True,
), Extension(
    "ckptzip.codecs._ckzhuff", ["src/ckptzip/codecs/_ckzhuff.c"],
    extra_compile_args=[] if sys.platform == "win32" else ["-O3"], depends=shared, optional=True,
), Extension(
    "ckptzip.codecs._gdeflate_shim", ["src/ckptzip/codecs/_gdeflate_shim.cpp"], language="c++",
    extra_compile_args=[] if sys.platform == "win32" else ["-O2", "-std=c++17"],
    libraries=["dl"] if sys.platform.startswith("linux") else [], optional=True,
)])
