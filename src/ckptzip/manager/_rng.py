"""Global RNG states saved beside a training state, so a resumed run draws what it would have."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def capture_rng_state() -> dict[str, Any]:
    """The global RNG states of Python ``random``, NumPy, torch (CPU) and, once initialized, CUDA.

    Put the result into the saved state and pass it back to :func:`restore_rng_state` after a
    restore, so random data order, dropout and augmentation continue exactly.
    """
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Set the global RNGs from :func:`capture_rng_state` output (tensors may be on any device).

    The CUDA states are restored when CUDA is available here; without CUDA they are ignored.
    """
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"].cpu())
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([t.cpu() for t in state["cuda"]])
