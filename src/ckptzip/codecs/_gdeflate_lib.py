"""nvCOMP's CPU GDeflate encoder (``libnvcomp_cpu``), reached through ckptzip's C++ shim.

ckptzip decodes GDeflate with its own decoder (``_gdeflate.c``); nvCOMP's library only encodes.

Why a shim and not plain ctypes: nvCOMP declares these functions only in C++
(``nvcomp/native/gdeflate_cpu.h``, namespace ``nvcomp::gdeflate``) and reports every error by
throwing ``nvcomp::NVCompException``. A C++ exception cannot unwind through ctypes' (C) frames:
the process aborts. The shim (``_gdeflate_shim.cpp``, an
optional extension of the package's build, with no link-time dependency on nvCOMP) opens the
library with dlopen, calls it inside ``try``/``catch (...)`` and returns an error code and message;
ctypes calls the shim's ``extern "C"`` functions (the GIL released, as for any ctypes call).
The library also exports C functions of its embedded libdeflate (``libdeflate_gdeflate_*``), but
no header declares them, so their ABI is not NVIDIA's to keep. What no ``catch`` stops: an empty
chunk makes the compressor divide by zero (SIGFPE); the codec never passes one.

The library is looked for at ``CKPTZIP_NVCOMP_CPU_LIB`` (a path), then in the installed
``nvidia.libnvcomp`` package (wheels ``nvidia-libnvcomp-cu12``/``-cu13``, Linux x86-64 and
aarch64), then by its soname through the dynamic loader. Nothing is loaded before a GDeflate
chunk is encoded on the CPU.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util

import numpy as np

from .. import settings
from ._nvcomp_wheel import library_candidates

ENV_VAR = settings.NVCOMP_CPU_LIB
SONAME = "libnvcomp_cpu.so.6"
INSTALL_HINT = (
    "on Linux x86-64 or aarch64: pip install ckptzip[gdeflate] (nvidia-libnvcomp-cu12; ckptzip[gpu] has it too), "
    f"or point {ENV_VAR} at a libnvcomp_cpu.so; elsewhere, code with a CPU codec "
    '(codec="auto", "portable" or "zstd") or on a CUDA GPU'
)
_ERR_BYTES = 512
_Ptr = ctypes.c_void_p
_Size = ctypes.c_size_t


class LibraryError(Exception):
    """nvCOMP reported an error (its message), or the shim did."""


def _shim_path() -> str | None:
    """Where the package's build put the shim, or None (built without a C++ compiler)."""
    try:
        spec = importlib.util.find_spec(f"{__package__}._gdeflate_shim")
    except (ImportError, ValueError):
        return None
    return spec.origin if spec is not None and spec.origin else None


def _library_candidates() -> list[str]:
    """Paths (or the soname) to try, in order."""
    return library_candidates(ENV_VAR, "libnvcomp_cpu.so*", SONAME)


class _Library:
    """The loaded shim, bound to one libnvcomp_cpu."""

    def __init__(self, shim: ctypes.CDLL) -> None:
        self._shim = shim
        shim.ckz_gdeflate_max_output.argtypes = [_Size, ctypes.POINTER(_Size), ctypes.c_char_p, _Size]
        shim.ckz_gdeflate_compress.argtypes = [_Ptr, _Ptr, _Size, _Size, _Ptr, _Ptr, ctypes.c_int, ctypes.c_char_p, _Size]

    def _check(self, rc: int, err: ctypes.Array[ctypes.c_char]) -> None:
        if rc != 0:
            raise LibraryError(err.value.decode(errors="replace") or f"error code {rc}")

    def max_output(self, chunk_bytes: int) -> int:
        """The compressed-size bound of a chunk of at most ``chunk_bytes`` bytes."""
        bound, err = _Size(), ctypes.create_string_buffer(_ERR_BYTES)
        self._check(self._shim.ckz_gdeflate_max_output(chunk_bytes, ctypes.byref(bound), err, _ERR_BYTES), err)
        return bound.value

    def compress(self, in_ptrs: np.ndarray, in_bytes: np.ndarray, max_chunk: int, out_ptrs: np.ndarray,
                 level: int) -> np.ndarray:
        """nvcomp::gdeflate::compressCPU over chunks at the addresses ``in_ptrs`` into room of at
        least :meth:`max_output` at ``out_ptrs``; returns the compressed sizes."""
        ins, counts, outs = _u64(in_ptrs), _u64(in_bytes), _u64(out_ptrs)
        sizes, err = np.zeros(ins.size, np.uint64), ctypes.create_string_buffer(_ERR_BYTES)
        self._check(self._shim.ckz_gdeflate_compress(ins.ctypes.data, counts.ctypes.data, max_chunk, ins.size,
                                                     outs.ctypes.data, sizes.ctypes.data, level, err, _ERR_BYTES), err)
        return sizes


def _u64(values: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(values, dtype=np.uint64)


@functools.cache
def load() -> tuple[_Library | None, str | None]:
    """(the library, None), or (None, why it cannot load here, with the fix); tried once (a race of first calls
    can only load it twice, which dlopen makes one)."""
    return _load()


def _load() -> tuple[_Library | None, str | None]:
    shim_path = _shim_path()
    if shim_path is None:
        return None, ("ckptzip was installed without its GDeflate shim (it is built with a C++ compiler when "
                      "ckptzip is installed from source); reinstall ckptzip where g++ or clang++ is at hand")
    try:
        shim = ctypes.CDLL(shim_path)
    except OSError as exc:
        return None, f"ckptzip's GDeflate shim does not load ({exc})"
    errors = []
    for candidate in _library_candidates():
        err = ctypes.create_string_buffer(_ERR_BYTES)
        if shim.ckz_gdeflate_load(candidate.encode(), err, _ERR_BYTES) == 0:
            return _Library(shim), None
        errors.append(err.value.decode(errors="replace"))
    return None, f"nvCOMP's CPU library libnvcomp_cpu is not found ({'; '.join(errors)}); {INSTALL_HINT}"
