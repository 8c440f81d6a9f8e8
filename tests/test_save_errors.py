"""Saving to a path is atomic: a failed save leaves no file behind and the previous one intact."""

from __future__ import annotations

import errno
import io
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import assert_same, mixed_state, save_bytes

import ckptzip
from ckptzip import CheckpointWriteError, UnsupportedObjectError, api


class _FullDiskFile(io.FileIO):
    """A file on a disk that fills up after ``quota`` bytes (each write lands whole or not at all)."""

    def __init__(self, path: str | os.PathLike, mode: str, quota: int, exc: type[BaseException] | None) -> None:
        super().__init__(path, mode)
        self.quota = quota
        self.exc = exc

    def write(self, data: Any) -> int:
        size = memoryview(data).nbytes
        if self.tell() + size > self.quota:
            if self.exc is not None:
                raise self.exc()
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self.name)
        return super().write(data)


def _fill_disk(monkeypatch: pytest.MonkeyPatch, quota: int, exc: type[BaseException] | None = None) -> None:
    """Make the files ckptzip.api opens for writing run out of space after ``quota`` bytes."""
    real_open = io.open

    def open_(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        if "r" in mode:
            return real_open(file, mode, *args, **kwargs)
        return io.BufferedWriter(_FullDiskFile(file, mode.replace("b", ""), quota, exc))

    monkeypatch.setattr(api.io, "open", open_)


@pytest.fixture
def previous(tmp_path: Path) -> tuple[Path, Any, bytes]:
    """A checkpoint already at the path the next save will fail to replace."""
    path = tmp_path / "ckpt.ckz"
    obj = {"step": 1, "w": torch.arange(10.0)}
    ckptzip.save(obj, path)
    return path, obj, path.read_bytes()


def _assert_untouched(path: Path, obj: Any, data: bytes) -> None:
    assert [p.name for p in path.parent.iterdir()] == [path.name], "a temporary file was left behind"
    assert path.read_bytes() == data
    assert_same(ckptzip.load(path), obj)


@pytest.fixture(scope="module")
def new_state() -> tuple[Any, int]:
    """The object the failing saves write, and the size of its file."""
    obj = mixed_state()
    return obj, len(save_bytes(obj))


# Where the disk fills up, as a function of the file size: at once, inside the preamble, right
# after it, in the data, in the middle, inside the trailer, at the last byte.
QUOTAS = {
    "empty": lambda size: 0,
    "preamble": lambda size: 15,
    "after preamble": lambda size: 16,
    "data": lambda size: 5000,
    "half": lambda size: size // 2,
    "trailer": lambda size: size - 20,
    "last byte": lambda size: size - 1,
}


@pytest.mark.parametrize("quota", list(QUOTAS.values()), ids=list(QUOTAS))
def test_full_disk_raises_write_error_and_keeps_the_previous_checkpoint(
    monkeypatch: pytest.MonkeyPatch,
    previous: tuple[Path, Any, bytes],
    new_state: tuple[Any, int],
    quota: Callable[[int], int],
) -> None:
    path, obj, data = previous
    _fill_disk(monkeypatch, quota(new_state[1]))
    with pytest.raises(CheckpointWriteError) as info:
        ckptzip.save(new_state[0], path)
    exc = info.value
    assert isinstance(exc, OSError) and exc.errno == errno.ENOSPC
    message = str(exc)
    assert f"could not write checkpoint {str(path)!r}: No space left on device" in message
    assert "Nothing was written under that name; any previous file there is untouched" in message
    assert isinstance(exc.__cause__, OSError) and exc.__cause__.errno == errno.ENOSPC
    monkeypatch.undo()
    _assert_untouched(path, obj, data)


def test_full_disk_on_a_fresh_path_leaves_nothing(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, new_state: tuple[Any, int]
) -> None:
    _fill_disk(monkeypatch, new_state[1] // 3)
    with pytest.raises(CheckpointWriteError):
        ckptzip.save(new_state[0], tmp_path / "new.ckz")
    assert list(tmp_path.iterdir()) == []


def test_a_save_that_fits_exactly_succeeds(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, new_state: tuple[Any, int]
) -> None:
    _fill_disk(monkeypatch, new_state[1])
    ckptzip.save(new_state[0], tmp_path / "fits.ckz")
    monkeypatch.undo()
    assert_same(ckptzip.load(tmp_path / "fits.ckz"), new_state[0])


def test_interrupted_save_removes_its_temporary_file(
    monkeypatch: pytest.MonkeyPatch, previous: tuple[Path, Any, bytes], new_state: tuple[Any, int]
) -> None:
    path, obj, data = previous
    _fill_disk(monkeypatch, 100, exc=KeyboardInterrupt)
    with pytest.raises(KeyboardInterrupt):
        ckptzip.save(new_state[0], path)
    monkeypatch.undo()
    _assert_untouched(path, obj, data)


@pytest.mark.parametrize(
    ("target", "error"),
    [("replace", errno.EXDEV), ("fsync", errno.EIO)],
)
def test_failed_sync_or_rename_is_a_write_error(
    monkeypatch: pytest.MonkeyPatch,
    previous: tuple[Path, Any, bytes],
    new_state: tuple[Any, int],
    target: str,
    error: int,
) -> None:
    path, obj, data = previous

    def fail(*args: Any) -> None:
        raise OSError(error, os.strerror(error))

    monkeypatch.setattr(api.os, target, fail)
    with pytest.raises(CheckpointWriteError) as info:
        ckptzip.save(new_state[0], path)
    assert info.value.errno == error and os.strerror(error) in str(info.value)
    monkeypatch.undo()
    _assert_untouched(path, obj, data)


def test_unsupported_object_leaves_the_previous_checkpoint(previous: tuple[Path, Any, bytes]) -> None:
    path, obj, data = previous
    with pytest.raises(UnsupportedObjectError, match=r"'model\.act'"):
        ckptzip.save({"model": {"w": torch.ones(2), "act": torch.nn.GELU()}}, path)
    _assert_untouched(path, obj, data)


def test_missing_directory_is_a_write_error(tmp_path: Path) -> None:
    with pytest.raises(CheckpointWriteError) as info:
        ckptzip.save({"a": 1}, tmp_path / "absent" / "ckpt.ckz")
    assert info.value.errno == errno.ENOENT
    assert "absent" in str(info.value)


def test_save_into_a_directory_path_is_a_write_error(tmp_path: Path) -> None:
    (tmp_path / "dir").mkdir()
    with pytest.raises(CheckpointWriteError):
        ckptzip.save({"a": 1}, tmp_path / "dir")
    assert [p.name for p in tmp_path.iterdir()] == ["dir"]
    assert list((tmp_path / "dir").iterdir()) == []


class _FullFile(io.RawIOBase):
    """A writable file object whose device is full after a few bytes."""

    def __init__(self) -> None:
        self.written = 0

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:  # noqa: ANN001
        if self.written > 100:
            raise OSError(errno.ENOSPC, "No space left on device")
        self.written += len(data)
        return len(data)


def test_full_device_behind_a_file_object_is_a_checkpoint_write_error() -> None:
    with pytest.raises(ckptzip.CheckpointWriteError, match=r"No space left on device; what was written is incomplete") as info:
        ckptzip.save({"w": torch.randn(1000)}, _FullFile())
    assert info.value.errno == errno.ENOSPC
