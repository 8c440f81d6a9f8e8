"""Shared memory made by ckptzip (ckptzip/memory/shared.py): handed to another process without a
copy, and made without torch's allocation, which holds the interpreter lock while it takes the
pages (a manager's prepare() stalled the training's thread for seconds that way)."""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.multiprocessing
from helpers import shared_rss

from ckptzip.errors import CheckpointWriteError
from ckptzip.memory import shared
from ckptzip.memory.shared import shared_empty

linux_descriptors = pytest.mark.skipif(
    not sys.platform.startswith("linux") or torch.multiprocessing.get_sharing_strategy() != "file_descriptor",
    reason="ckptzip makes shared memory itself where /dev/shm is and torch shares by descriptor (Linux)",
)


def _child_writes(tensor: torch.Tensor) -> None:
    tensor[0] = 9


@linux_descriptors
def test_shared_memory_is_made_without_torchs_allocation(monkeypatch: pytest.MonkeyPatch) -> None:
    def holds_the_lock(nbytes: int) -> torch.UntypedStorage:
        raise AssertionError("torch's _new_shared takes the pages while holding the GIL")

    monkeypatch.setattr(torch.UntypedStorage, "_new_shared", holds_the_lock)
    before = set(os.listdir("/dev/shm"))
    memory = shared_empty(3 << 20)
    assert memory.is_shared() and memory.dtype == torch.uint8 and memory.numel() == 3 << 20
    assert set(os.listdir("/dev/shm")) <= before  # unlinked: only its descriptor names it


@linux_descriptors
def test_shared_memory_goes_to_another_process_without_a_copy() -> None:
    memory = shared_empty(1 << 20)
    memory[:4] = 7
    address = memory.data_ptr()
    fd, size = memory.untyped_storage()._share_fd_cpu_()  # what torch.multiprocessing sends
    assert fd >= 0 and size == 1 << 20 and memory.data_ptr() == address
    child = torch.multiprocessing.get_context("spawn").Process(target=_child_writes, args=(memory,))
    child.start()
    child.join(60)
    assert child.exitcode == 0
    assert memory[:4].tolist() == [9, 7, 7, 7]


@linux_descriptors
def test_a_shared_file_that_cannot_be_made_is_a_write_error(monkeypatch: pytest.MonkeyPatch) -> None:
    def refused(path: str, flags: int, mode: int = 0o777) -> int:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(os, "open", refused)
    with pytest.raises(CheckpointWriteError, match=r"^shared memory \(/dev/shm\) could not be made: Permission denied$"):
        shared_empty(1 << 20)


def test_torchs_shared_memory_where_ckptzip_cannot_make_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shared, "shared_room", lambda: None)  # no /dev/shm to make files in
    memory = shared_empty(1 << 16)
    assert memory.is_shared() and memory.numel() == 1 << 16


def _child_reads(tensor: torch.Tensor, out: torch.Tensor) -> None:
    out[0] = int(tensor.sum())


@linux_descriptors
def test_unmapped_pages_leave_this_process_and_keep_their_bytes_for_the_one_it_was_handed_to() -> None:
    memory = shared.shared_copy(torch.arange(64 << 20, dtype=torch.uint8))  # 64 MiB, every page mapped here
    mapped = shared_rss()
    shared.unmap_pages(memory[1:])  # a view: its storage's pages
    assert mapped - shared_rss() >= 63 << 20
    total = torch.zeros(1, dtype=torch.int64).share_memory_()
    child = torch.multiprocessing.get_context("spawn").Process(target=_child_reads, args=(memory, total))
    child.start()
    child.join(60)
    assert child.exitcode == 0
    assert int(total) == int(torch.arange(64 << 20, dtype=torch.uint8).sum())  # every byte still there
    assert torch.equal(memory[:256], torch.arange(256, dtype=torch.uint8))  # and here, mapped again


def test_private_memory_is_never_unmapped() -> None:
    memory = torch.full((1 << 20,), 5, dtype=torch.uint8)
    shared.unmap_pages(memory)
    assert int(memory.sum()) == 5 << 20
