"""Staging for ``dcp.async_save``: the writer is DCP's ``AsyncStager``.

DCP's default stager copies every tensor of the state into host memory in the caller before the
writer sees it, so a GPU state is copied raw (and coded on the CPU later). ckptzip stages as its
manager's host snapshots do: the GPU tensors are coded on their GPU in batches and only their
stored bytes are copied into pinned host memory (:func:`ckptzip.staging.stage_coded`),
on the caller's stream, so training's next kernels run after the coding. Host tensors are
copied; other values are kept as DCP's stager keeps them.

In the staged state dict DCP plans and saves from, each staged GPU tensor is a meta tensor of
its shape and dtype (a DTensor keeps its mesh and placements around one): DCP reads only shapes
and dtypes from it, and it holds nothing of the GPU, so the staged dict may cross to DCP's
checkpoint process (``AsyncCheckpointerType.PROCESS``) as well as stay in the caller. The
writer finds each staged tensor's bytes by the placeholder's storage offset, which is its
position in the staged table plus one: pickling keeps offsets, and DCP hands the placeholder
(or a view of it at the same offset) back when it resolves an item.
"""

from __future__ import annotations

import sys
import threading
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from ..engine import Policy
from ..errors import UsageError
from ..memory.pinned import PinnedPool
from ..staging import HostStaged, stage_coded

_Key = tuple[int, int, tuple[int, ...], tuple[int, ...], torch.dtype, torch.device]
# Pinned host memory for staged bytes, kept for the next save (pinning is what makes a first
# staging slow) and shared by every writer of the process; bounded by the largest staged state.
_POOL = PinnedPool(count=sys.maxsize)
_POOL_LOCK = threading.Lock()


def key_of(tensor: torch.Tensor) -> _Key:
    """What identifies a tensor's data: storage, offset, shape, strides, dtype, device."""
    return (tensor.untyped_storage().data_ptr(), int(tensor.storage_offset()), tuple(tensor.shape),
            tuple(tensor.stride()), tensor.dtype, tensor.device)


def staged_here(tensor: torch.Tensor) -> bool:
    """Whether staging codes ``tensor`` now (a GPU tensor) rather than copying it for later."""
    return tensor.is_cuda


@dataclass
class Staged:
    """One ``stage`` call's result: the coded GPU tensors waiting in pinned memory. ``positions``:
    a ShardedTensor's shards by :func:`key_of` (it stays in the staged dict itself, so it is
    found by its data; a staging with any is for DCP's thread only)."""

    host: HostStaged
    positions: dict[_Key, int] = field(default_factory=dict)

    @property
    def count(self) -> int:
        """Tensors in the staged table."""
        return len(self.host.state.table.all_names)

    def wait(self) -> None:
        self.host.wait()

    def release(self) -> None:
        self.host.release()

    def position(self, tensor: torch.Tensor) -> int | None:
        """Where a resolved item's bytes are in the staged table: a placeholder's, by its storage
        offset (checked against the staged tensor's shape and dtype), a ShardedTensor shard's by
        its data; None for a tensor that was not staged."""
        if not tensor.is_meta:
            return self.positions.get(key_of(tensor))
        k = int(tensor.storage_offset()) - 1
        layouts = self.host.state.table.layouts
        if not 0 <= k < len(layouts) or (layouts[k].dtype, layouts[k].shape) != (tensor.dtype, tuple(tensor.shape)):
            raise UsageError(
                f"a {tensor.dtype} meta tensor of shape {tuple(tensor.shape)} reached the writer that matches "
                "nothing it staged: save meta tensors with no writer, and stage each state with the writer "
                "that saves it"
            )
        return k

    def portable(self) -> Staged:
        """This staging for DCP's checkpoint process (:meth:`~ckptzip.staging.HostStaged.portable`);
        the pinned buffers go back to the pool at once."""
        if self.positions:
            raise UsageError(
                "dcp.async_save(..., async_checkpointer_type=AsyncCheckpointerType.PROCESS) with a ShardedTensor "
                "on a GPU: ckptzip stages its shards on the GPU and finds them by their memory, which the "
                "checkpoint process does not share; use the thread checkpointer, a DTensor, or pass "
                "async_stager=DefaultStager(...) to stage on the host"
            )
        host = self.host.portable()
        self.host.release()
        return Staged(host)


def _local_tensors(value: Any) -> list[torch.Tensor] | None:
    """The local data of a tensor-like value (a DTensor's local tensor, a ShardedTensor's local
    shards, a tensor), or None for other values."""
    if isinstance(value, DTensor):
        return [value._local_tensor]
    if hasattr(value, "local_shards") and callable(value.local_shards):  # ShardedTensor
        return [shard.tensor for shard in value.local_shards()]
    return [value] if isinstance(value, torch.Tensor) else None


def _placeholder(tensor: torch.Tensor, position: int) -> torch.Tensor:
    """A contiguous meta tensor of ``tensor``'s shape and dtype at storage offset ``position + 1``."""
    storage = torch.empty(position + 1 + tensor.numel(), dtype=tensor.dtype, device="meta")
    return storage[position + 1 :].view(tensor.shape)


def stage(state_dict: Any, policy: Policy, gpu_memory: int | None) -> tuple[Any, Staged | None]:
    """The staged state dict DCP saves from, and the coded GPU tensors (None without any)."""
    names: list[str] = []
    tensors: list[torch.Tensor] = []
    seen: dict[_Key, int] = {}
    sharded: dict[_Key, int] = {}

    def add(t: torch.Tensor, name: str) -> int:
        position = seen.setdefault(key_of(t), len(tensors))
        if position == len(tensors):
            names.append(name)
            tensors.append(t.detach())
        return position

    def walk(value: Any, path: str) -> Any:
        locals_ = _local_tensors(value)
        if locals_ is not None:
            staged = [t for t in locals_ if staged_here(t)]
            if staged and len(staged) == len(locals_):
                if not isinstance(value, torch.Tensor):  # a ShardedTensor: found by its shards' data
                    for k, t in enumerate(staged):
                        sharded[key_of(t)] = add(t, f"{path}#{k}")
                    return value
                holder = _placeholder(staged[0], add(staged[0], path))
                if isinstance(value, DTensor):
                    return DTensor.from_local(holder, value.device_mesh, value.placements, run_check=False,
                                              shape=value.shape, stride=value.stride())
                return holder
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
    with _POOL_LOCK:  # one staging at a time owns the shared pool's reservation
        state = stage_coded(names, tensors, policy, _POOL, gpu_memory)
    return staged_dict, Staged(state, sharded)
