"""Shared memory (``/dev/shm`` on Linux): host tensors that
``torch.multiprocessing`` hands to another process by their file descriptor, without a copy (a
staging's bytes for a checkpoint process, the manager's coding process and its ring), allocated
only where the file system has room for them.
"""

from __future__ import annotations

import mmap
import os
import secrets

import torch
import torch.multiprocessing

from ..errors import CheckpointWriteError
from .pages import libc_madvise

MADV_DONTNEED = 4  # Linux's value on every architecture torch runs on
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
    """A 1-D uint8 tensor of ``nbytes`` in shared memory (not zeroed): what
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
    # a /dev/shm to make files in (its room is known), and torch hands storages over by descriptor
    by_descriptor = room is not None and torch.multiprocessing.get_sharing_strategy() == "file_descriptor"
    storage = _descriptor_storage(nbytes) if by_descriptor else _torch_storage(nbytes)
    return torch.empty(0, dtype=torch.uint8).set_(storage)


def _descriptor_storage(nbytes: int) -> torch.UntypedStorage:
    """Shared memory made here rather than by torch, whose ``_new_shared`` takes the pages while
    it holds the interpreter lock (GIL): for the gigabytes of a manager's staging, seconds in
    which every other thread of the process, the training's included, waits. A file of
    ``/dev/shm``, unlinked at once (only its descriptor names it), takes its pages all or none
    in ``posix_fallocate``, which releases the lock; torch then maps it as a storage that it
    hands over by that descriptor."""
    path = os.path.join(_SHARED_MEMORY, f"ckptzip-{os.getpid()}-{secrets.token_hex(8)}")
    try:  # a new file, never one that is there (a link included: O_EXCL)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise CheckpointWriteError(f"shared memory ({_SHARED_MEMORY}) could not be made: {exc.strerror}") from exc
    try:
        os.unlink(path)
        _allocate(fd, nbytes)
        storage: torch.UntypedStorage = torch.UntypedStorage._new_shared_fd_cpu(fd, nbytes)  # type: ignore[attr-defined]
        return storage  # it maps a duplicate of fd
    finally:
        os.close(fd)


def _torch_storage(nbytes: int) -> torch.UntypedStorage:
    """Torch's own shared memory, where ckptzip cannot make it (no ``/dev/shm``, or torch shares
    by file name): its pages taken from the file system now, where it is backed by a descriptor,
    so that processes that allocated at once (ranks of one host) cannot overdraw it between the
    room check and the first touch."""
    storage: torch.UntypedStorage = torch.UntypedStorage._new_shared(nbytes)
    try:
        fd, _ = storage._share_fd_cpu_()
    except RuntimeError:  # torch's ``file_system`` sharing strategy: the room check alone
        return storage
    _allocate(fd, nbytes)
    return storage


def _allocate(fd: int, nbytes: int) -> None:
    """Give the shared file ``fd`` its ``nbytes`` of pages now, all or none."""
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as exc:
        raise CheckpointWriteError(f"shared memory ({_SHARED_MEMORY}) could not take {nbytes / 2**30:.2f} GiB: "
                                   f"{exc.strerror}") from exc


def shared_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of a host tensor in shared memory (contiguous, same dtype and shape)."""
    out = shared_empty(tensor.numel() * tensor.element_size()).view(tensor.dtype).view(tensor.shape)
    return out.copy_(tensor)


def unmap_pages(tensor: torch.Tensor) -> None:
    """Drop this process's mappings of the pages of a tensor :func:`shared_empty` or
    :func:`shared_copy` made, which another process now reads (a staging handed over): the bytes
    stay in shared memory, for that process, and a later touch here maps them again. Without it,
    freeing the storage unmaps them while holding the interpreter lock (tens of ms a GiB, in which
    the training's thread waits); ``madvise`` here releases it. Only whole pages inside the
    storage, and nothing where those functions gave private memory. Never for other tensors:
    torch calls a private mapping of a file shared too, and this would discard its bytes."""
    madvise = libc_madvise()
    if tensor.device.type != "cpu" or not tensor.is_shared() or madvise is None:
        return
    storage = tensor.untyped_storage()
    page = mmap.PAGESIZE
    start = -(-storage.data_ptr() // page) * page
    end = (storage.data_ptr() + storage.nbytes()) // page * page
    if end > start:
        madvise(start, end - start, MADV_DONTNEED)
