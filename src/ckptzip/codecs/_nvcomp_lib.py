"""nvCOMP's batched C API (``libnvcomp.so.6``), called through ctypes.

Why not nvCOMP's Python module: it builds Python objects for every chunk of every call (the
arrays it is given, the sizes it returns), and its GDeflate decode holds the calling thread for
about as long as the kernels run; one save of 12 GB has 15 000 GDeflate chunks. The C functions
take device arrays of chunk addresses and sizes, which the codec builds for a whole batch at once,
queue their work on the caller's stream and return; they allocate nothing (their scratch comes
from torch's caching allocator).

Every format's functions have the same signature in nvCOMP 6 (``nvcomp/<format>.h``), with the
format's options passed by value as a 64-byte struct; :class:`Format` carries a format's name and
the bytes of its two option structs. The library is looked for at ``CKPTZIP_NVCOMP_LIB`` (a path),
then in the installed ``nvidia.libnvcomp`` package (``nvidia-libnvcomp-cu12``/``-cu13``), then by
its soname; it needs no CUDA library at load time (the driver is opened when a function runs).
"""

from __future__ import annotations

import ctypes
import functools
import threading
from dataclasses import dataclass
from typing import Any

from .. import settings
from ._nvcomp_wheel import library_candidates

ENV_VAR = settings.NVCOMP_LIB
SONAME = "libnvcomp.so.6"
MIN_MAJOR = 6

_Ptr = ctypes.c_void_p
_Size = ctypes.c_size_t
_STATUS = {0: "success", 10: "invalid value", 11: "not supported", 12: "cannot decompress", 13: "bad checksum",
           14: "cannot verify checksums", 15: "output buffer too small", 16: "wrong header length",
           17: "alignment", 18: "chunk size too large", 19: "cannot compress", 20: "wrong input length",
           21: "batch size too large", 22: "sub-chunk count too large", 23: "sub-chunk count too small",
           24: "output buffer alignment too small", 1000: "CUDA error", 10000: "internal error"}


def status_name(code: int) -> str:
    """nvCOMP's name for a status code."""
    return _STATUS.get(code, f"unknown status {code}")


class _Opts(ctypes.Structure):
    """Any format's option struct: 64 bytes, 8-byte aligned, passed by value."""

    _fields_ = [("words", ctypes.c_uint64 * 8)]


@dataclass(frozen=True)
class Format:
    """One nvCOMP format: the name in its functions (``nvcompBatched<name>CompressAsync``) and the
    bytes of its compression and decompression option structs."""

    name: str
    compress_opts: bytes
    decompress_opts: bytes

    def __post_init__(self) -> None:
        if len(self.compress_opts) != 64 or len(self.decompress_opts) != 64:
            raise ValueError(f"nvCOMP {self.name}: option structs are 64 bytes")


def _opts(raw: bytes) -> _Opts:
    opts = _Opts()
    ctypes.memmove(ctypes.byref(opts), raw, 64)
    return opts


_ARGTYPES: dict[str, list[Any]] = {
    "CompressGetMaxOutputChunkSize": [_Size, _Opts, ctypes.POINTER(_Size)],
    "CompressGetTempSize": [_Size, _Size, _Opts, ctypes.POINTER(_Size), _Size, _Ptr],
    "DecompressGetTempSize": [_Size, _Size, _Opts, ctypes.POINTER(_Size), _Size, _Ptr],
    # ins, in sizes, max chunk, count, temp, temp bytes, outs, out sizes, opts, statuses, stream
    "CompressAsync": [_Ptr, _Ptr, _Size, _Size, _Ptr, _Size, _Ptr, _Ptr, _Opts, _Ptr, _Ptr],
    # ins, in sizes, out capacities, out sizes, count, temp, temp bytes, outs, opts, statuses, stream
    "DecompressAsync": [_Ptr, _Ptr, _Ptr, _Ptr, _Size, _Ptr, _Size, _Ptr, _Opts, _Ptr, _Ptr],
}


class LibraryError(RuntimeError):
    """A call into nvCOMP returned an error status."""


class Library:
    """libnvcomp's batched functions for any :class:`Format` (thread-safe: they keep no state)."""

    def __init__(self, lib: ctypes.CDLL, version: int) -> None:
        self._lib = lib
        major, rest = divmod(version, 1000)
        self.version = f"{major}.{rest // 100}.{rest % 100}"
        self._functions: dict[tuple[str, str], Any] = {}
        self._lock = threading.Lock()

    def _function(self, fmt: Format, what: str) -> Any:
        key = (fmt.name, what)
        function = self._functions.get(key)
        if function is None:
            with self._lock:
                function = getattr(self._lib, f"nvcompBatched{fmt.name}{what}")
                function.restype = ctypes.c_int
                function.argtypes = _ARGTYPES[what]
                self._functions[key] = function
        return function

    def _call(self, fmt: Format, what: str, *args: Any) -> None:
        status = self._function(fmt, what)(*args)
        if status:
            raise LibraryError(f"nvCOMP {fmt.name} {what}: {status_name(status)} (status {status})")

    def max_output_chunk_bytes(self, fmt: Format, max_chunk: int) -> int:
        """The compressed-size bound of a chunk of up to ``max_chunk`` bytes."""
        out = _Size()
        self._call(fmt, "CompressGetMaxOutputChunkSize", max_chunk, _opts(fmt.compress_opts), ctypes.byref(out))
        return out.value

    def temp_bytes(self, fmt: Format, decompress: bool, count: int, max_chunk: int, total: int) -> int:
        """Scratch bytes a (de)compression of ``count`` chunks of up to ``max_chunk`` bytes needs."""
        out = _Size()
        what, raw = ("DecompressGetTempSize", fmt.decompress_opts) if decompress else (
            "CompressGetTempSize", fmt.compress_opts)
        self._call(fmt, what, count, max_chunk, _opts(raw), ctypes.byref(out), total, None)
        return out.value

    def compress(self, fmt: Format, ins: int, in_sizes: int, max_chunk: int, count: int, temp: int, temp_bytes: int,
                 outs: int, out_sizes: int, statuses: int, stream: int) -> None:
        """Queue the compression of ``count`` chunks (device arrays of addresses and sizes) on ``stream``."""
        self._call(fmt, "CompressAsync", ins, in_sizes, max_chunk, count, temp or None, temp_bytes, outs, out_sizes,
                   _opts(fmt.compress_opts), statuses, stream or None)

    def decompress(self, fmt: Format, ins: int, in_sizes: int, capacities: int, out_sizes: int, count: int, temp: int,
                   temp_bytes: int, outs: int, statuses: int, stream: int) -> None:
        """Queue the decompression of ``count`` chunks on ``stream``; each writes at most its capacity."""
        self._call(fmt, "DecompressAsync", ins, in_sizes, capacities, out_sizes, count, temp or None, temp_bytes,
                   outs, _opts(fmt.decompress_opts), statuses, stream or None)


class _Properties(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("cudart_version", ctypes.c_uint32)]


@functools.cache
def load() -> tuple[Library | None, str | None]:
    """(the library, None), or (None, why it cannot be used here); tried once (a race of first calls
    can only load it twice, which dlopen makes one)."""
    return _load()


def _load() -> tuple[Library | None, str | None]:
    errors = []
    for candidate in library_candidates(ENV_VAR, "libnvcomp.so*", SONAME):
        try:
            lib = ctypes.CDLL(candidate)
        except OSError as exc:
            errors.append(str(exc))
            continue
        properties = _Properties()
        if not hasattr(lib, "nvcompGetProperties") or lib.nvcompGetProperties(ctypes.byref(properties)):
            errors.append(f"{candidate} is not nvCOMP's library (it has no nvcompGetProperties)")
            continue
        problem = version_problem(candidate, properties.version)
        if problem is None:
            return Library(lib, properties.version), None
        errors.append(problem)
    return None, f"nvCOMP's library {SONAME} is not usable here ({'; '.join(errors)})"


def version_problem(where: str, version: int) -> str | None:
    """Why nvCOMP of ``version`` (``major * 1000 + minor * 100 + patch``) at ``where`` will not do, or None."""
    major, rest = divmod(version, 1000)
    if major >= MIN_MAJOR:
        return None
    return f"{where} is nvCOMP {major}.{rest // 100}.{rest % 100}, older than the {MIN_MAJOR}.0 ckptzip needs"
