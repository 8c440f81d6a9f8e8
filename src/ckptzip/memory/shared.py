"""Shared memory (``/dev/shm`` on Linux, where torch puts it): host tensors that
``torch.multiprocessing`` hands to another process by their file descriptor, without a copy (a
staging's bytes for a checkpoint process, the manager's coding process and its ring), allocated
only where the file system has room for them.
"""

from __future__ import annotations

import os

import torch

from ..errors import CheckpointWriteError

# Shared memory is left this much room by ckptzip's allocations in it (other processes share it).
SHARED_MEMORY_MARGIN = 256 << 20
_SHARED_MEMORY = "/dev/shm"


def shared_room() -> int | None:
    """Bytes that shared memory (the ``/dev/shm`` file system, where torch puts it on Linux) can
    still take, or None where that cannot be known."""
    try:
        stat = os.statvfs(_SHARED_MEMORY)
    except (OSError, AttributeError):
        return None
    return stat.f_bavail * stat.f_frsize


def shared_empty(nbytes: int) -> torch.Tensor:
    """A 1-D uint8 tensor of ``nbytes`` in torch's shared memory (not zeroed): what
    ``torch.multiprocessing`` hands to another process by its file descriptor, without a copy.
    :class:`~ckptzip.errors.CheckpointWriteError` where shared memory has no room for it (a
    container's small ``/dev/shm``): touching pages beyond its size would kill the process."""
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    room = shared_room()
    if room is not None and nbytes + SHARED_MEMORY_MARGIN > room:
        raise CheckpointWriteError(f"shared memory ({_SHARED_MEMORY}) has {room / 2**30:.2f} GiB free; "
                                   f"{nbytes / 2**30:.2f} GiB and a margin of {SHARED_MEMORY_MARGIN / 2**30:.2f} GiB "
                                   "were needed")
    storage = torch.UntypedStorage._new_shared(nbytes)
    _reserve(storage, nbytes)
    return torch.empty(0, dtype=torch.uint8).set_(storage)


def _reserve(storage: torch.UntypedStorage, nbytes: int) -> None:
    """Take the pages of a new shared storage from the file system now, all or none, so that
    processes that allocated at once (ranks of one host) cannot overdraw it between the room
    check and the first touch. Storages not backed by a descriptor (torch's ``file_system``
    sharing strategy) keep only the room check."""
    try:
        fd, _ = storage._share_fd_cpu_()
    except RuntimeError:
        return
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as exc:
        raise CheckpointWriteError(f"shared memory ({_SHARED_MEMORY}) could not take {nbytes / 2**30:.2f} GiB: "
                                   f"{exc.strerror}") from exc


def shared_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of a host tensor in shared memory (contiguous, same dtype and shape)."""
    out = shared_empty(tensor.numel() * tensor.element_size()).view(tensor.dtype).view(tensor.shape)
    return out.copy_(tensor)
