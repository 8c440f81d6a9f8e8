"""What a load may allocate for tensors: the caller's ``max_bytes``, or by default what the target
can hold (free host memory for the CPU, the device's free memory for a GPU), checked against the
sizes the file declares before anything is allocated for them."""

from __future__ import annotations

import contextlib
import operator
import os
from collections.abc import Mapping

import torch

from .engine import memory
from .errors import DecodeBudgetError


def validate_max_bytes(max_bytes: object) -> int | None:
    """``max_bytes`` as an int >= 0, or None (the default budget); anything else is refused."""
    if max_bytes is None:
        return None
    if isinstance(max_bytes, bool) or not hasattr(type(max_bytes), "__index__"):
        raise TypeError(f"max_bytes must be None or an int >= 0 (a number of bytes), got {max_bytes!r}")
    value = operator.index(max_bytes)  # type: ignore[arg-type]  # it has __index__
    if value < 0:
        raise ValueError(f"max_bytes must be None or an int >= 0 (a number of bytes), got {value}")
    return value


def host_available() -> int | None:
    """Bytes the host can still give this process: ``MemAvailable`` (else the free physical
    pages), within a cgroup v2 memory limit if one is set; None where neither can be read."""
    available = None
    try:
        with open("/proc/meminfo", "rb") as f:
            available = next(int(line.split()[1]) * 1024 for line in f if line.startswith(b"MemAvailable:"))
    except (OSError, ValueError, IndexError, StopIteration):
        with contextlib.suppress(OSError, ValueError, AttributeError):
            available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    try:
        with open("/sys/fs/cgroup/memory.max", "rb") as f, open("/sys/fs/cgroup/memory.current", "rb") as g:
            limit, used = f.read().strip(), int(g.read())
        if limit != b"max":
            room = max(0, int(limit) - used)
            available = room if available is None else min(available, room)
    except (OSError, ValueError):
        pass
    return available


def available(device: torch.device) -> int | None:
    """What a target device can hold now; None where that cannot be known (no check)."""
    if device.type == "cpu":
        return host_available()
    if device.type == "cuda":
        return memory.available(device)
    return None


def check_budget(needs: Mapping[torch.device, int], max_bytes: int | None) -> None:
    """Refuse, with :class:`~ckptzip.errors.DecodeBudgetError` and the numbers, a read whose
    declared tensor bytes (by target device) exceed ``max_bytes``, or without it what a target
    can hold."""
    if max_bytes is not None:
        total = sum(needs.values())
        if total > max_bytes:
            raise DecodeBudgetError(
                f"the checkpoint declares {total} bytes of tensors, more than max_bytes={max_bytes}; nothing was "
                "decoded. Raise max_bytes if you trust the file (`ckptzip inspect` lists the declared sizes)"
            )
        return
    for device, nbytes in needs.items():
        have = available(device) if nbytes and device.type != "meta" else None
        if have is not None and nbytes > have:
            raise DecodeBudgetError(
                f"the checkpoint declares {nbytes} bytes ({nbytes / 2**30:.1f} GiB) of tensors for {device}, which "
                f"has {have} bytes ({have / 2**30:.1f} GiB) free; nothing was decoded. Load it where there is "
                "room (map_location), or pass max_bytes to set the budget yourself"
            )

