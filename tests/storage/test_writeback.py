"""Early writeback (storage/writeback.py): a file's bytes are handed to the kernel to write as
they arrive, every WRITEBACK_BYTES, each range once and in order; files that cannot take the
advice (memory, pipes, file systems that refuse it) are written as they are."""

from __future__ import annotations

import io
import os
from pathlib import Path

import pytest

from ckptzip.storage import writeback
from ckptzip.storage.writeback import Writeback, file_descriptor


@pytest.fixture
def advice(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int, int]]:
    """Every posix_fadvise call as (offset, length, advice); ranges of 1 KiB."""
    calls: list[tuple[int, int, int]] = []
    monkeypatch.setattr(writeback, "WRITEBACK_BYTES", 1024)
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, offset, length, how: calls.append((offset, length, how)),
                        raising=False)
    return calls


def test_a_file_is_handed_to_the_kernel_in_order_from_where_its_writer_began(
        tmp_path: Path, advice: list[tuple[int, int, int]]) -> None:
    with open(tmp_path / "f", "wb") as f:
        f.write(b"h" * 100)  # before the writer: not its bytes
        back = Writeback(f)
        for size in (500, 600, 300, 2000, 10):
            f.write(b"x" * size)
            back.wrote()
    assert advice == [(100, 1100, os.POSIX_FADV_DONTNEED), (1200, 2300, os.POSIX_FADV_DONTNEED)]
    assert (tmp_path / "f").read_bytes() == b"h" * 100 + b"x" * 3410


def test_a_buffered_writers_bytes_reach_the_kernel_before_the_advice(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(writeback, "WRITEBACK_BYTES", 1024)
    sizes: list[int] = []
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, *_: sizes.append(os.fstat(fd).st_size), raising=False)
    with open(tmp_path / "f", "wb", buffering=1 << 20) as f:
        back = Writeback(f)
        f.write(b"x" * 2048)
        back.wrote()
    assert sizes == [2048]


def test_memory_and_pipes_take_no_advice(advice: list[tuple[int, int, int]]) -> None:
    memory = io.BytesIO()
    assert file_descriptor(memory) is None
    read, write = os.pipe()
    try:
        with os.fdopen(write, "wb") as pipe:
            assert file_descriptor(pipe) is None
            back = Writeback(pipe)
            pipe.write(b"x" * 2048)
            back.wrote()
            pipe.flush()
            assert os.read(read, 4096) == b"x" * 2048
    finally:
        os.close(read)
    assert advice == []


def test_a_file_system_that_refuses_the_advice_is_written_without_it(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(writeback, "WRITEBACK_BYTES", 1024)
    calls: list[int] = []

    def refuse(fd: int, offset: int, length: int, how: int) -> None:
        calls.append(offset)
        raise OSError(95, "Operation not supported")

    monkeypatch.setattr(os, "posix_fadvise", refuse, raising=False)
    with open(tmp_path / "f", "wb") as f:
        back = Writeback(f)
        for _ in range(4):
            f.write(b"x" * 1024)
            back.wrote()
    assert calls == [0]  # asked once, then never again
    assert (tmp_path / "f").stat().st_size == 4096


def test_a_save_to_a_pipe_is_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    """A pipe has a descriptor but takes no advice (ESPIPE): before writeback asked whether the
    file can seek, a save to a pipe failed once a writeback range had filled."""
    import threading

    import torch
    from helpers import assert_same

    import ckptzip

    monkeypatch.setattr(writeback, "WRITEBACK_BYTES", 1024)
    state = {"w": torch.randn(64, 1024, generator=torch.Generator().manual_seed(3)), "step": 7}
    read, write = os.pipe()
    received: list[bytes] = []

    def drain() -> None:
        with os.fdopen(read, "rb") as r:
            received.append(r.read())

    reader = threading.Thread(target=drain)
    reader.start()
    with os.fdopen(write, "wb") as pipe:
        ckptzip.save(state, pipe)
    reader.join()
    assert_same(ckptzip.load(received[0]), state)
