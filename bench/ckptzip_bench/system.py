"""The machine a benchmark ran on: hardware and package versions, the page cache, disk bandwidth."""

from __future__ import annotations

import gc
import importlib.metadata
import os
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ckptzip import __version__

__all__ = ["PageCache", "disk_bandwidth", "filesystem", "hardware", "release_memory"]

_DROP_CACHES = Path("/proc/sys/vm/drop_caches")
_PACKAGES = ("zstandard", "safetensors", "zipnn", "lz4", "numpy")


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _nvcomp_version() -> str | None:
    """Version of the installed ``nvidia-libnvcomp-cu*`` distribution (the library ckptzip calls), if any."""
    for dist in importlib.metadata.distributions():
        name = (dist.metadata["Name"] or "").lower()
        if name.startswith("nvidia-libnvcomp"):
            return f"{name} {dist.version}"
    return None


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_gib() -> float | None:
    try:
        return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        return None


def hardware() -> dict[str, Any]:
    """GPU, CPU, memory, OS and the versions of torch, CUDA, nvCOMP and the baselines' packages."""
    gpu: dict[str, Any] = {"name": None}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        gpu = {
            "name": props.name,
            "count": torch.cuda.device_count(),
            "memory_gib": round(props.total_memory / 2**30, 1),
        }
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    return {
        "gpu": gpu,
        "cpu": {"model": _cpu_model(), "count": os.cpu_count(), "usable": affinity},
        "memory_gib": _memory_gib(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "versions": {
            "ckptzip": __version__,
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "nvcomp": _nvcomp_version(),
            **{name: _version(name) for name in _PACKAGES},
        },
    }


def filesystem(directory: str | Path) -> dict[str, str | None]:
    """Mount point and file system type of ``directory`` (from /proc/mounts, where it exists)."""
    path = os.path.realpath(directory)
    best: tuple[str, str | None] = ("/", None)
    try:
        for line in Path("/proc/mounts").read_text().splitlines():
            fields = line.split()
            mount = fields[1]
            inside = path == mount or path.startswith(mount.rstrip("/") + "/")
            if inside and len(mount) >= len(best[0]):
                best = (mount, fields[2])
    except OSError:
        pass
    return {"path": path, "mount": best[0], "type": best[1]}


class PageCache:
    """Drops the page cache before each timed read when asked and permitted, and says which it was.

    ``cold`` is true only if dropping worked when probed; ``note`` says why reads are warm otherwise.
    """

    def __init__(self, want_cold: bool) -> None:
        self.cold = False
        self.note = "warm: dropping the page cache was not asked for (--cache warm)"
        if want_cold:
            problem = self._drop()
            self.cold = problem is None
            self.note = (
                "cold: page cache dropped (sync; echo 3 > /proc/sys/vm/drop_caches) before each timed read"
                if problem is None
                else f"warm: could not drop the page cache ({problem}), so reads may come from memory"
            )

    @property
    def mode(self) -> str:
        return "cold" if self.cold else "warm"

    def drop(self) -> None:
        """Drop clean pages before a timed read (a no-op when reads are warm)."""
        if self.cold:
            problem = self._drop()
            if problem is not None:
                raise OSError(f"dropping the page cache worked before but now fails: {problem}")

    @staticmethod
    def _drop() -> str | None:
        os.sync()
        try:
            _DROP_CACHES.write_text("3\n")
        except OSError as exc:
            return f"{_DROP_CACHES}: {exc.strerror or exc}"
        return None


def disk_bandwidth(directory: str | Path, nbytes: int, cache: PageCache) -> dict[str, Any]:
    """GB/s of writing ``nbytes`` (random bytes) to a new file in ``directory`` with fsync, and of
    reading it back (after dropping the page cache when ``cache`` is cold)."""
    block = np.random.default_rng(0).integers(0, 256, min(nbytes, 64 << 20), dtype=np.uint8).data
    count = max(1, nbytes // block.nbytes)
    total = count * block.nbytes
    with tempfile.TemporaryDirectory(dir=directory, prefix="ckptzip-disk-") as tmp:
        path = Path(tmp, "bandwidth.bin")
        start = time.perf_counter()
        with open(path, "wb") as f:
            f.writelines(block for _ in range(count))
            f.flush()
            os.fsync(f.fileno())
        write_seconds = time.perf_counter() - start
        cache.drop()
        start = time.perf_counter()
        with open(path, "rb", buffering=0) as f:
            while f.readinto(block):
                pass
        read_seconds = time.perf_counter() - start
    return {
        "bytes": total,
        "write_gbps": total / write_seconds / 1e9,
        "read_gbps": total / read_seconds / 1e9,
        "read_cache": cache.mode,
        "filesystem": filesystem(directory),
    }


def release_memory() -> None:
    """Free what the last method left behind: Python garbage and PyTorch's cached GPU blocks."""
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
