"""Compile the engine's GPU kernels and create its codecs before the first save or load needs them.

The kernels ship compiled for the common GPUs (kernels/_aot.py); elsewhere a fresh node has an
empty Triton cache, and the first save of a process would compile every kernel (seconds) — a
restore after a failure is exactly that case. Either way the first call makes nvCOMP's codecs.
:func:`warm_up` saves and loads a small state that takes every kernel the engine launches
(byte planes of 2, 4 and 8 bytes, whole tensors, references) on a background thread, once per
device and policy; the manager and the DCP plugin start it when they are made, and a save or load
that comes before it is done just compiles what it needs itself, as it would have.
"""

from __future__ import annotations

import io
import logging
import threading

import torch

from ..format import ContainerReader
from .policy import Policy
from .reader import read_tensors
from .writer import SaveOptions, write_state

_STARTED: dict[tuple[torch.device, str], threading.Thread] = {}
_LOCK = threading.Lock()


def _sample(device: torch.device) -> list[torch.Tensor]:
    """Small tensors that take every kernel variant a save and a load launch (random data, so
    every plane is coded)."""
    g = torch.Generator(device=device).manual_seed(0)
    weights = torch.randn(1 << 18, generator=g, device=device) * 0.02
    return [
        weights,
        weights.bfloat16(),  # a cast of an fp32 tensor: stored as a reference
        torch.randn(1 << 17, generator=g, device=device, dtype=torch.float64),
        torch.randint(0, 255, (1 << 20,), generator=g, device=device, dtype=torch.uint8),
        torch.randn(1 << 18, generator=g, device=device).half(),
        torch.arange(100, device=device, dtype=torch.int32),
        weights.clone(),  # a duplicate
    ]


def compile_kernels(device: torch.device, policy: Policy) -> None:
    """Save and load the sample on ``device`` with ``policy`` now, in the calling thread: every
    kernel compiled (or loaded from Triton's disk cache) and every codec made."""
    with torch.cuda.device(device):
        tensors = _sample(device)
        names = [f"t{i}" for i in range(len(tensors))]
        buffer = io.BytesIO()
        write_state(buffer, names, tensors, [{"tensor": i} for i in range(len(tensors))], SaveOptions(policy))
        reader = ContainerReader(buffer.getvalue())
        read_tensors(reader, list(range(len(tensors))), [device] * len(tensors))
        torch.cuda.current_stream(device).synchronize()


def warm_up(device: torch.device | None = None, policy: Policy | None = None, *, wait: bool = False) -> None:
    """Compile the kernels and create the codecs a save and a load with ``policy`` (default
    ``"auto"``) use on ``device`` (default: the current CUDA device), on a background thread
    started once per device and policy; ``wait`` blocks until it is done. Nothing happens
    without CUDA. A warm-up that fails (the GPU is full, say) leaves the first real call to
    compile, as it would have."""
    if not torch.cuda.is_available():
        return
    if device is None or str(device) == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    policy = policy or Policy.parse("auto")
    with _LOCK:
        thread = _STARTED.get((device, policy.name))
        if thread is None:
            thread = _STARTED[device, policy.name] = threading.Thread(
                target=_quietly, args=(device, policy), name="ckptzip-warmup", daemon=True)
            thread.start()
    if wait:
        thread.join()


def _quietly(device: torch.device, policy: Policy) -> None:
    try:
        compile_kernels(device, policy)
    except Exception as exc:  # a warm-up is an optimisation: the real call compiles what it needs
        logging.getLogger("ckptzip").info("kernel warm-up on %s did not finish (%s: %s); the first save or "
                                          "load compiles what it needs", device, type(exc).__name__, exc)
