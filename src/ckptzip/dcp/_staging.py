"""Staging for ``dcp.async_save``: the writer is DCP's ``AsyncStager``.

DCP's default stager copies every tensor of the state into host memory in the caller before the
writer sees it, so a GPU state is copied raw (and coded on the CPU later). ckptzip stages as its
manager's host snapshots do: the GPU tensors are coded on their GPU in batches and only their
stored bytes are copied into pinned host memory (:func:`~ckptzip.engine.writer.stage_state`),
on the caller's stream, so training's next kernels run after the coding. Host tensors are
copied; other values are kept as DCP's stager keeps them.

The staged state dict DCP plans and saves from holds the GPU tensors themselves: DCP reads only
their shapes and dtypes from it, and the writer writes the staged bytes of each in their place,
identified by its storage, offset, shape, strides and dtype.
"""

from __future__ import annotations

import sys
import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from ..engine import SAVE_BATCH_BYTES, GpuLimits, PinnedPool, Policy, StagedState, gpu_coded, stage_state

_Key = tuple[int, int, tuple[int, ...], tuple[int, ...], torch.dtype, torch.device]
# Pinned host memory for staged bytes, kept for the next save (pinning is what makes a first
# staging slow) and shared by every writer of the process; bounded by the largest staged state.
_POOL = PinnedPool(count=sys.maxsize)
_POOL_LOCK = threading.Lock()


def key_of(tensor: torch.Tensor) -> _Key:
    """What identifies a tensor's data: storage, offset, shape, strides, dtype, device."""
    return (tensor.untyped_storage().data_ptr(), int(tensor.storage_offset()), tuple(tensor.shape),
            tuple(tensor.stride()), tensor.dtype, tensor.device)


@dataclass
class Staged:
    """One ``stage`` call's result: the coded GPU tensors waiting in pinned memory, by key."""

    state: StagedState
    positions: dict[_Key, int] = field(default_factory=dict)

    def wait(self) -> None:
        """Until the staged bytes are in host memory (nothing reads the GPU tensors after that)."""
        for job in self.state.jobs:
            if job.ready is not None:
                job.ready.synchronize()


def _local_tensors(value: Any) -> list[torch.Tensor] | None:
    """The local data of a tensor-like value (a DTensor's local tensor, a ShardedTensor's local
    shards, a tensor), or None for other values."""
    local = getattr(value, "_local_tensor", None)
    if isinstance(value, torch.Tensor) and isinstance(local, torch.Tensor):  # DTensor
        return [local]
    if hasattr(value, "local_shards") and callable(value.local_shards):  # ShardedTensor
        return [shard.tensor for shard in value.local_shards()]
    return [value] if isinstance(value, torch.Tensor) else None


def stage(state_dict: Any, policy: Policy, gpu_memory: int | None) -> tuple[Any, Staged | None]:
    """The staged state dict DCP saves from, and the coded GPU tensors (None without any)."""
    names: list[str] = []
    tensors: list[torch.Tensor] = []
    seen: dict[_Key, int] = {}

    def walk(value: Any, path: str) -> Any:
        locals_ = _local_tensors(value)
        if locals_ is not None:
            gpu = [t for t in locals_ if t.is_cuda]
            if gpu and len(gpu) == len(locals_):
                for k, t in enumerate(gpu):
                    seen.setdefault(key_of(t), len(tensors))
                    if len(seen) > len(tensors):
                        names.append(path if len(gpu) == 1 else f"{path}#{k}")
                        tensors.append(t.detach())
                return value  # the GPU data is staged; DCP reads the metadata
            if isinstance(value, torch.Tensor) and not value.is_cuda:
                return value.detach().clone()  # host tensors: copied, as DCP's stager does
            return value
        if isinstance(value, dict):
            return type(value)((k, walk(v, f"{path}.{k}" if path else str(k))) for k, v in value.items())
        if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
            return type(value)(walk(v, f"{path}.{i}") for i, v in enumerate(value))
        return value

    staged_dict = walk(state_dict, "")
    if not tensors:
        return staged_dict, None
    # what the GPUs cannot code (no nvCOMP, or over the budget) is copied to the host now and coded there later
    coded = gpu_coded(tensors, policy, GpuLimits.of(tensors, policy, gpu_memory))
    tensors = [t if on_gpu else t.to("cpu") for t, on_gpu in zip(tensors, coded)]
    with _POOL_LOCK:  # one staging at a time owns the shared pool's reservation
        state = stage_state(names, tensors, policy, _POOL, SAVE_BATCH_BYTES["cuda"], gpu_memory=gpu_memory)
    return staged_dict, Staged(state, {key: position for key, position in seen.items()})
