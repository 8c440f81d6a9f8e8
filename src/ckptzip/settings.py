"""Every environment variable ckptzip reads (:data:`VARIABLES`; docs/ENVIRONMENT.md is their
table; :data:`INTERNAL`: those ckptzip sets for its own child processes), read and validated here alone: each is looked up when the call that uses it runs, and a
value ckptzip cannot act on raises :class:`~ckptzip.errors.UsageError` saying what was expected,
never a raw ``ValueError`` and never a silent default. An unset or empty variable means its
default.
"""

from __future__ import annotations

import os
from pathlib import Path

from .errors import UsageError

GPU_MEMORY_MB = "CKPTZIP_GPU_MEMORY_MB"
THREADS = "CKPTZIP_THREADS"
PINNED_MB = "CKPTZIP_PINNED_MB"
CACHE_DIR = "CKPTZIP_CACHE_DIR"
AOT_KERNELS = "CKPTZIP_AOT_KERNELS"
NUMPY_KERNELS = "CKPTZIP_NUMPY_KERNELS"
NVCOMP_LIB = "CKPTZIP_NVCOMP_LIB"
NVCOMP_CPU_LIB = "CKPTZIP_NVCOMP_CPU_LIB"
VARIABLES = (GPU_MEMORY_MB, THREADS, PINNED_MB, CACHE_DIR, AOT_KERNELS, NUMPY_KERNELS, NVCOMP_LIB, NVCOMP_CPU_LIB)
# Set by ckptzip for the processes it starts, never by a user (so not in VARIABLES' table).
CODING_AUTHKEY = "CKPTZIP_CODING_AUTHKEY"
INTERNAL = (CODING_AUTHKEY,)

_MIB = 1 << 20
_MAX_MIB = 1 << 30  # a PiB: larger is a typo, and would overflow the byte counts it becomes
_MAX_THREADS = 1 << 12
_SHOWN = 40  # characters of a bad value quoted in its error


def _shown(text: str) -> str:
    """``text`` quoted for an error message, cut short if long (a value of 5000 digits)."""
    return repr(text) if len(text) <= _SHOWN else f"{text[:_SHOWN]!r}... ({len(text)} characters)"


def _text(name: str) -> str | None:
    """The variable's value, stripped; ``None`` when it is unset or empty."""
    text = os.environ.get(name, "").strip()
    return text or None


def _whole(name: str, low: int, high: int, what: str) -> int | None:
    """A whole number in ``[low, high]`` of ``what`` (ASCII digits, so 5000 of them are refused
    before ``int`` would parse them), or ``None`` when unset."""
    text = _text(name)
    if text is None:
        return None
    if not (text.isascii() and text.isdigit() and len(text) <= len(str(high)) and low <= int(text) <= high):
        raise UsageError(f"{name}={_shown(text)}: expected a whole number of {what} from {low} to {high}")
    return int(text)


def _switch(name: str, default: bool) -> bool:
    text = _text(name)
    if text is None:
        return default
    if text not in ("0", "1"):
        raise UsageError(f"{name}={_shown(text)}: expected 0 or 1 (or unset: {int(default)})")
    return text == "1"


def gpu_memory(argument: object) -> int | None:
    """The GPU memory cap of a call, in bytes: its ``gpu_memory=`` argument (an int above 0, or
    ``None``), else ``CKPTZIP_GPU_MEMORY_MB``, else ``None`` (no cap)."""
    if argument is None:
        mib = _whole(GPU_MEMORY_MB, 1, _MAX_MIB, "MiB above 0")
        return None if mib is None else mib * _MIB
    if type(argument) is not int or argument <= 0:
        raise UsageError(f"gpu_memory must be a number of bytes above 0 (an int) or None, got {argument!r}")
    return argument


def threads() -> int | None:
    """``CKPTZIP_THREADS``: the threads CPU codecs and batches use, or ``None`` (every usable core)."""
    return _whole(THREADS, 1, _MAX_THREADS, "threads")


def pinned_bytes() -> int:
    """``CKPTZIP_PINNED_MB`` in bytes: the pinned host memory of the copy pool (default 1024 MiB)."""
    mib = _whole(PINNED_MB, 1, _MAX_MIB, "MiB")
    return (1024 if mib is None else mib) * _MIB


def cache_dir() -> Path | None:
    """Where ckptzip keeps what it remembers across processes: ``CKPTZIP_CACHE_DIR`` (set but
    empty: nowhere, ``None``), else ``$XDG_CACHE_HOME/ckptzip``, else ``~/.cache/ckptzip``."""
    chosen = os.environ.get(CACHE_DIR)
    if chosen is not None:
        return Path(chosen) if chosen.strip() else None
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "ckptzip"


def aot_kernels() -> bool:
    """``CKPTZIP_AOT_KERNELS``: whether the shipped GPU machine code may run (default 1)."""
    return _switch(AOT_KERNELS, True)


def numpy_kernels() -> bool:
    """``CKPTZIP_NUMPY_KERNELS``: whether the CPU kernels run in NumPy rather than compiled C (default 0)."""
    return _switch(NUMPY_KERNELS, False)


def library(name: str) -> str | None:
    """The library path ``name`` (:data:`NVCOMP_LIB` or :data:`NVCOMP_CPU_LIB`) names, or ``None``
    (look in the installed wheel, then by soname)."""
    if name not in (NVCOMP_LIB, NVCOMP_CPU_LIB):
        raise ValueError(f"{name} is not a library variable of ckptzip")
    return _text(name)


def coding_environment(authkey: bytes) -> dict[str, str]:
    """This process's environment with ``CKPTZIP_CODING_AUTHKEY`` set to ``authkey``: what a
    coding process (:mod:`ckptzip.manager._coding`) is started with."""
    return {**os.environ, CODING_AUTHKEY: authkey.hex()}


def pop_coding_authkey() -> bytes:
    """``CKPTZIP_CODING_AUTHKEY``, taken out of the environment (the child's own children do not
    inherit it): the authentication key the coding process's parent handed it."""
    return bytes.fromhex(os.environ.pop(CODING_AUTHKEY))
