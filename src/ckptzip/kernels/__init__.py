"""Batched data-parallel kernels of the engine: byte-plane split/merge with checksums
(:mod:`.planes`) and checksummed gathers of many byte segments (:mod:`.segments`).

Each runs as Triton kernels on a CUDA device (one launch for a whole batch, programs find their
data through small address tables) and, on the CPU, as compiled C (``_cpu.c``, built by the
package's build; the same kind of tables, split between threads by bytes) or, where no compiled
build exists or ``CKPTZIP_NUMPY_KERNELS=1``, as NumPy. Both release the GIL, so the CPU backend
runs batches on several threads. ``TRITON_INTERPRET=1`` runs the Triton versions on CPU
tensors (tests). Triton is imported on the first launch of a Triton kernel, never by importing
ckptzip (after TensorFlow, its LLVM would abort the process; and it costs import time).
"""

from __future__ import annotations

import importlib.util
import os
import threading
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import torch

from ..codecs import MIN_PARALLEL_BYTES, codec_thread_count
from . import _aot

__all__ = ["COMPILED", "CPU_PIECE_BYTES", "INTERPRET", "THREAD_SAFE", "NoCompiledKernelsWarning", "compiled_threads",
           "distinct", "load_triton", "pieces", "prepare_triton", "remember_triton_key", "run_gpu", "use_triton"]

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# Triton's interpreter keeps global state: under it, batches run on one thread.
THREAD_SAFE = not INTERPRET
CPU_PIECE_BYTES = 1 << 20  # most bytes of a row of the compiled kernels, whose threads split rows by bytes


class NoCompiledKernelsWarning(UserWarning):
    """ckptzip's C extensions were not built where it was installed: its CPU path runs slower."""


def _compiled() -> ModuleType | None:
    """The compiled CPU kernels, or None (not built here, or ``CKPTZIP_NUMPY_KERNELS=1``). Where
    they were not built, a warning says so, once per process: pip hides a failed optional build
    (no C compiler at install) unless run with -v, and nothing else would tell."""
    if os.environ.get("CKPTZIP_NUMPY_KERNELS") == "1":
        return None
    try:
        return importlib.import_module(f"{__name__}._cpu")
    except ImportError:
        pass
    try:
        importlib.import_module("..codecs._gdeflate", __name__)  # the other C extension the build makes
        decoder = True
    except ImportError:
        decoder = False
    warnings.warn(
        "ckptzip's compiled CPU kernels are not built here (its C extensions failed to build when it was installed, "
        "most likely for want of a C compiler): CPU saves and loads run NumPy kernels, several times slower"
        + ("" if decoder else ", and files a GPU wrote with codec='auto' (gdeflate) cannot be decoded on the CPU")
        + ". Reinstall ckptzip from its source where gcc or clang is at hand (`pip install .` in a clone "
        "builds them); CKPTZIP_NUMPY_KERNELS=1 chooses the NumPy kernels without this warning",
        NoCompiledKernelsWarning, stacklevel=2)
    return None


COMPILED: Any = _compiled()  # the module's functions take tables of addresses (see _cpu.c)
_HAS_TRITON: bool | None = None
_PREPARING = threading.Lock()
_prepared = False
_READY = threading.Event()  # set when the background preparation (prepare_triton) has ended


def use_triton(device: torch.device) -> bool:
    """Whether the Triton versions run for data on ``device`` (looks Triton up, imports nothing)."""
    global _HAS_TRITON
    if device.type != "cuda" and not INTERPRET:
        return False
    if _HAS_TRITON is None:
        _HAS_TRITON = importlib.util.find_spec("triton") is not None
    return _HAS_TRITON


def load_triton(name: str) -> ModuleType:
    """The Triton kernels module ``name`` of this package, imported (with Triton) on first use,
    after the background preparation where one runs (so Triton's key is computed once)."""
    if _prepared:
        _READY.wait()
    return importlib.import_module(f"{__name__}.{name}")


def run_gpu(module: str, kernel: str, grid: int, device: torch.device, args: Sequence[torch.Tensor | int],
            constants: Mapping[str, object], warps: int | None = None) -> None:
    """Launch ``kernel`` of the Triton module ``module`` over ``grid`` programs on ``device``: its
    code shipped compiled (:mod:`._aot`) where there is one for this GPU, else Triton's. ``warps``:
    the warps of a program where not Triton's default (the shipped code was compiled with them)."""
    if not _aot.launch(kernel, grid, device, args, constants):
        options = {} if warps is None else {"num_warps": warps}
        getattr(load_triton(module), kernel)[(grid,)](*args, **constants, **options)


def prepare_triton(device: torch.device) -> None:
    """Where a GPU path on ``device`` begins, unless its kernels are shipped compiled: import the
    Triton kernels and give Triton its once-per-process cache key (remembered across processes,
    :mod:`._triton_key`; else Triton's hash of its own compiler, which reads its files) on a background
    thread, once, while the caller plans its work (pure host work, no CUDA call); the first
    launch waits for it."""
    global _prepared
    with _PREPARING:
        if _prepared or INTERPRET or not use_triton(device) or _aot.covers(device):
            return
        _prepared = True
    threading.Thread(target=_prepare, name="ckptzip-triton-key", daemon=True).start()


def remember_triton_key() -> Path | None:
    """Give this process's Triton its cache key, remembered for the processes after it
    (:mod:`._triton_key`); the file that holds it, or None where nothing was remembered."""
    from . import _triton_key

    return _triton_key.install()


def _prepare() -> None:
    try:
        remember_triton_key()
        for name in ("_planes_triton", "_segments_triton", "_ckzhuff_triton"):
            importlib.import_module(f"{__name__}.{name}")
    finally:
        _READY.set()


def compiled_threads(nbytes: int) -> int:
    """Threads a compiled kernel call over ``nbytes`` bytes uses: the calling thread's codec share
    (:func:`~ckptzip.codecs.codec_thread_count`), at least MIN_PARALLEL_BYTES each."""
    return max(1, min(codec_thread_count(), nbytes // MIN_PARALLEL_BYTES))


def pieces(sizes: np.ndarray, span: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``sizes`` cut into pieces of at most ``span``: each piece's owner, start and size (an empty
    owner has none)."""
    counts = -(-sizes // span)
    owner = np.repeat(np.arange(sizes.size, dtype=np.int64), counts)
    start = (np.arange(owner.size, dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)) * span
    return owner, start, np.minimum(span, sizes[owner] - start)


def distinct(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct values of a 1-D integer array, ascending, and where each first occurs: what
    ``np.unique(values, return_index=True)`` gives, without the import of ``numpy.ma`` that
    NumPy's first ``unique`` call of a process costs."""
    order = np.argsort(values, kind="stable")
    ordered = values[order]
    head = np.ones(ordered.size, dtype=bool)
    head[1:] = ordered[1:] != ordered[:-1]
    return ordered[head], order[head]


# The GPU's ckz-huff codec (its kernels are this package's): declared here, loaded when first asked for.
importlib.import_module(f"{__name__}.ckzhuff")
