"""The tensor bytes a file declares, checked before a load allocates anything for them: against the
caller's cap (``max_bytes``), or by default against what each target has available (free host
memory for the CPU, the device's free memory for a GPU); too many is
:class:`~ckptzip.errors.DecodeBudgetError`. (What a call may use on a GPU for its work, beside the
tensors, is its budget: :mod:`.gpu`.)"""

from __future__ import annotations

import operator
from collections.abc import Mapping

import torch

from ..errors import DecodeBudgetError
from . import gpu
from .host import host_available


def validate_max_bytes(max_bytes: object) -> int | None:
    """``max_bytes`` as an int >= 0, or None (no cap: what the targets have available); anything else is refused."""
    if max_bytes is None:
        return None
    if isinstance(max_bytes, bool) or not hasattr(type(max_bytes), "__index__"):
        raise TypeError(f"max_bytes must be None or an int >= 0 (a number of bytes), got {max_bytes!r}")
    value = operator.index(max_bytes)  # type: ignore[arg-type]  # it has __index__
    if value < 0:
        raise ValueError(f"max_bytes must be None or an int >= 0 (a number of bytes), got {value}")
    return value


def available(device: torch.device) -> int | None:
    """What a target device can hold now; None where that cannot be known (no check)."""
    if device.type == "cpu":
        return host_available()
    if device.type == "cuda":
        return gpu.available(device)
    return None


def check_declared(needs: Mapping[torch.device, int], max_bytes: int | None) -> None:
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

