"""Batched data-parallel kernels of the engine: byte-plane split/merge with checksums
(:mod:`.planes`) and checksummed gathers of many byte segments (:mod:`.segments`).

Each runs as Triton kernels on a CUDA device (one launch for a whole batch, programs find their
data through small address tables) and as NumPy on the CPU, which releases the GIL so the CPU
backend runs batches on several threads. ``TRITON_INTERPRET=1`` runs the Triton versions on CPU
tensors (tests).
"""

from __future__ import annotations

import os

import numpy as np
import torch

try:
    import triton
except ImportError:  # pragma: no cover - depends on the environment
    triton = None

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# Triton's interpreter keeps global state: under it, batches run on one thread.
THREAD_SAFE = not INTERPRET


def use_triton(device: torch.device) -> bool:
    """Whether the Triton versions run for data on ``device``."""
    return triton is not None and (device.type == "cuda" or INTERPRET)


def to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array on ``device`` without waiting for the device: staged through pinned memory
    (a copy from pageable memory would wait for all work queued before it)."""
    host = torch.from_numpy(np.ascontiguousarray(array))
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)
