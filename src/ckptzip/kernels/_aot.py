"""The GPU kernels compiled ahead of time: Triton's output for the GPUs most jobs run on, shipped
in ``cubins/`` and launched through the CUDA driver, so that a fresh node's first save and first
restore neither compile a kernel nor import Triton.

``cubins/manifest.json`` (written by ``python -m ckptzip.kernels._build``, ``make kernels``) names,
for each kernel variant the engine launches (a kernel and its compile-time constants) and each
architecture, the file that holds its machine code, its entry point, parameters, warps and shared
memory, and the digest of the Triton sources it was built from. A variant, a GPU or a source that
the manifest does not cover (a changed kernel not yet rebuilt, a GPU newer than the build, a
driver that refuses the code) takes Triton's just-in-time path as before;
``CKPTZIP_AOT_KERNELS=0`` always does.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import os
import sys
import threading
from collections.abc import Mapping, Sequence
from functools import cache
from pathlib import Path
from typing import Any

import torch

_HERE = Path(__file__).parent
FOLDER = _HERE / "cubins"
SOURCES = ("_planes_triton.py", "_segments_triton.py", "_ckzhuff_triton.py")  # what the shipped code is compiled from
ENV = "CKPTZIP_AOT_KERNELS"
_CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
_STATIC_SHARED_LIMIT = 48 * 1024  # bytes of dynamic shared memory a launch may use without opting in
_LOG = logging.getLogger("ckptzip")


def variant_key(kernel: str, constants: Mapping[str, object]) -> str:
    """The manifest's name of ``kernel`` compiled with ``constants``, e.g. ``merge_kernel[E=4096,K=2]``."""
    return f"{kernel}[{','.join(f'{k}={constants[k]}' for k in sorted(constants))}]"


def sources_digest() -> str:
    """The digest of the Triton sources the kernels are compiled from, as the manifest records it."""
    digest = hashlib.sha256()
    for name in SOURCES:
        digest.update(name.encode() + b"\0" + (_HERE / name).read_bytes())
    return digest.hexdigest()


def arch_for(capability: tuple[int, int], archs: Sequence[str]) -> str | None:
    """The shipped architecture whose code runs on a GPU of compute ``capability``: its own, else
    ``sm80``'s on any GPU of major version 8 (code for sm_80 runs on 8.6 and 8.9; from 9.0 on,
    Triton builds for one exact architecture)."""
    major, minor = capability
    for arch in (f"sm{major}{minor}", "sm80" if major == 8 else None):
        if arch in archs:
            return arch
    return None


@cache
def manifest() -> dict[str, Any] | None:
    """The shipped manifest where its sources match this package's and it is not turned off."""
    if os.environ.get(ENV) == "0":
        return None
    try:
        found: dict[str, Any] = json.loads((FOLDER / "manifest.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if found.get("sources") != sources_digest():
        _LOG.debug("the shipped GPU kernels were built from other sources: Triton compiles them")
        return None
    return found


@cache
def _arch(index: int) -> str | None:
    shipped = manifest()
    if shipped is None:
        return None
    return arch_for(torch.cuda.get_device_capability(index), list(shipped["archs"]))


def covers(device: torch.device) -> bool:
    """Whether shipped code exists for ``device`` (a CUDA device): its launches need no Triton,
    unless the driver refuses the code, in which case they fall back to it."""
    return sys.platform.startswith("linux") and device.type == "cuda" and _arch(_index(device)) is not None


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


class _Driver:
    """The few CUDA driver calls a launch needs (``libcuda``, which every CUDA process has loaded)."""

    def __init__(self) -> None:
        lib = ctypes.CDLL("libcuda.so.1")
        self.lib = lib
        p, u, v = ctypes.c_void_p, ctypes.c_uint, ctypes.POINTER(ctypes.c_void_p)
        lib.cuCtxGetCurrent.argtypes = [v]
        lib.cuCtxGetDevice.argtypes = [ctypes.POINTER(ctypes.c_int)]
        lib.cuDeviceGet.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int]
        lib.cuDevicePrimaryCtxRetain.argtypes = [v, ctypes.c_int]
        lib.cuCtxSetCurrent.argtypes = [p]
        lib.cuModuleLoadData.argtypes = [v, ctypes.c_char_p]
        lib.cuModuleGetFunction.argtypes = [v, p, ctypes.c_char_p]
        lib.cuFuncSetAttribute.argtypes = [p, ctypes.c_int, ctypes.c_int]
        lib.cuLaunchKernel.argtypes = [p, u, u, u, u, u, u, u, p, v, v]
        lib.cuGetErrorName.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]

    def check(self, result: int, what: str) -> None:
        if result != 0:
            name = ctypes.c_char_p()
            self.lib.cuGetErrorName(result, ctypes.byref(name))
            raise RuntimeError(f"CUDA driver: {what} failed with {(name.value or b'?').decode()} ({result})")

    def context(self, index: int) -> int:
        """The current context, made the primary context of device ``index`` where it is not
        (as the CUDA runtime, and so torch, does on that device)."""
        ctx, ordinal = ctypes.c_void_p(), ctypes.c_int(-1)
        self.check(self.lib.cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
        if ctx.value and self.lib.cuCtxGetDevice(ctypes.byref(ordinal)) == 0 and ordinal.value == index:
            return ctx.value
        device = ctypes.c_int()
        self.check(self.lib.cuDeviceGet(ctypes.byref(device), index), "cuDeviceGet")
        self.check(self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), device), "cuDevicePrimaryCtxRetain")
        self.check(self.lib.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
        return int(ctx.value or 0)

    def function(self, image: bytes, entry: str, shared: int) -> int:
        module, function = ctypes.c_void_p(), ctypes.c_void_p()
        self.check(self.lib.cuModuleLoadData(ctypes.byref(module), image), "cuModuleLoadData")
        self.check(self.lib.cuModuleGetFunction(ctypes.byref(function), module, entry.encode()), "cuModuleGetFunction")
        if shared > _STATIC_SHARED_LIMIT:
            self.check(self.lib.cuFuncSetAttribute(function, _CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, shared),
                       "cuFuncSetAttribute")
        return int(function.value or 0)


_C_TYPES = {"u64": ctypes.c_uint64, "u32": ctypes.c_uint32, "s64": ctypes.c_int64, "s32": ctypes.c_int32,
            "b64": ctypes.c_uint64, "b32": ctypes.c_uint32}


def pack(params: Sequence[str], args: Sequence[torch.Tensor | int]) -> list[ctypes._SimpleCData[Any]]:
    """The values of a launch's parameters: a tensor's address or an integer for each argument,
    in the width the compiled entry declares, then zeros (the null scratch pointers Triton adds)."""
    if len(args) > len(params):
        raise ValueError(f"{len(args)} arguments for a kernel of {len(params)} parameters")
    values: list[ctypes._SimpleCData[Any]] = []
    for i, kind in enumerate(params):
        arg = args[i] if i < len(args) else 0
        number = arg.data_ptr() if isinstance(arg, torch.Tensor) else int(arg)
        values.append(_C_TYPES[kind](number))
    return values


class _Launcher:
    """Loaded functions per context, loaded on first use; None where the driver refused the code."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._functions: dict[tuple[int, str], int | None] = {}
        self._driver: _Driver | None = None
        self._no_driver = False  # libcuda could not be opened here: Triton launches everything

    def launch(self, entry: Mapping[str, Any], index: int, grid: int, args: Sequence[torch.Tensor | int],
               stream: int) -> bool:
        """Launch ``entry`` on device ``index``; False (nothing launched) where its code cannot be loaded."""
        with self._lock:
            if self._no_driver:
                return False
            if self._driver is None:
                try:
                    self._driver = _Driver()
                except (OSError, AttributeError) as exc:  # no libcuda.so.1 by that name, or an old one
                    _LOG.info("the CUDA driver library did not open (%s): Triton launches the GPU kernels", exc)
                    self._no_driver = True
                    return False
            driver = self._driver
            key = (driver.context(index), entry["file"])
            if key not in self._functions:
                self._functions[key] = self._load(driver, entry)
            function = self._functions[key]
        if function is None:
            return False
        values = pack(entry["params"], args)
        pointers = (ctypes.c_void_p * len(values))(*[ctypes.cast(ctypes.byref(v), ctypes.c_void_p) for v in values])
        driver.check(driver.lib.cuLaunchKernel(function, grid, 1, 1, 32 * entry["warps"], 1, 1, entry["shared"],
                                               stream, pointers, None), f"launching {entry['entry']}")
        return True

    @staticmethod
    def _load(driver: _Driver, entry: Mapping[str, Any]) -> int | None:
        import zstandard

        try:
            image = zstandard.ZstdDecompressor().decompress((FOLDER / entry["file"]).read_bytes())
            return driver.function(image, entry["entry"], entry["shared"])
        except (OSError, RuntimeError, zstandard.ZstdError) as exc:
            _LOG.info("the shipped GPU kernel %s did not load (%s): Triton compiles it", entry["file"], exc)
            return None


_LAUNCHER = _Launcher()


def launch(kernel: str, grid: int, device: torch.device, args: Sequence[torch.Tensor | int],
           constants: Mapping[str, object]) -> bool:
    """Launch the shipped code of ``kernel`` with ``constants`` over ``grid`` programs on
    ``device``'s current stream; False (nothing launched) where none is shipped for it or it does
    not load, and the caller then runs Triton's."""
    shipped = manifest()
    if shipped is None or not covers(device):
        return False
    index = _index(device)
    entry = shipped["kernels"].get(variant_key(kernel, constants), {}).get(_arch(index))
    if entry is None:
        return False
    with torch.cuda.device(index):
        stream = torch.cuda.current_stream(index).cuda_stream
        return _LAUNCHER.launch(entry, index, grid, args, stream)
