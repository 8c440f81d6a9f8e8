"""Streams between ring neighbours (two gloo ranks on loopback): files of any size, in pieces,
both ways at once; committed all together or not at all when a read or a write fails, and the
ranks still in step for the next exchange."""

from __future__ import annotations

import contextlib
import io
import os
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

import pytest
import torch.distributed as dist
from ckptzip_bench.launch import launch

from ckptzip.storage.files import atomic_file
from ckptzip.tier import ring as ring_module
from ckptzip.tier.ring import ReplicationError, Ring

PIECE = 1000  # small pieces, so that files span several and pieces span files
SIZES = {0: [0, 1, 999, 1000, 2500, 0, 7], 1: [3001]}  # each rank's files, by step 10, 11, ...


def _content(rank: int, step: int, size: int) -> bytes:
    return bytes((rank * 31 + step * 7 + i) % 251 for i in range(size))


def _files(rank: int, root: Path) -> Iterator[tuple[int, BinaryIO]]:
    for i, size in enumerate(SIZES[rank]):
        path = root / f"src{rank}-{i}"
        path.write_bytes(_content(rank, 10 + i, size))
        yield 10 + i, path.open("rb")


class _FailingWriter(io.BytesIO):
    def write(self, data: object) -> int:
        raise OSError(28, "No space left on device")


class _ShortReader(io.BytesIO):
    """Claims 2500 bytes but its reads fail after the first 1200."""

    def readinto(self, buffer: object) -> int:
        if self.tell() >= 1200:
            raise OSError(5, "Input/output error")
        return super().readinto(memoryview(buffer)[: 1200 - self.tell()])  # type: ignore[arg-type]


def _accept_into(root: Path, drop: int | None = None):  # noqa: ANN202
    def accept(step: int, size: int):  # noqa: ANN202
        assert size >= 0
        return None if step == drop else atomic_file(root / f"got-{step}")
    return accept


def _worker(rank: int, world: int, tmp: str) -> None:
    ring_module.PIECE_BYTES = PIECE
    root = Path(tmp) / f"rank{rank}"
    root.mkdir()
    ring = Ring(dist.new_group(backend="gloo"))
    other = 1 - rank

    # both ways at once; rank 1 drops step 12 of rank 0's files
    files = list(_files(rank, root))
    got = ring.stream(files, forward=True, send=True, expect=True, accept=_accept_into(root, 12 if rank == 1 else None))
    expected = [10 + i for i in range(len(SIZES[other])) if not (rank == 1 and i == 2)]
    assert got == expected
    for step in expected:
        assert (root / f"got-{step}").read_bytes() == _content(other, step, SIZES[other][step - 10])
    assert rank == 0 or not (root / "got-12").exists()
    for _, f in files:
        f.close()

    # a write that fails on rank 1: it raises, keeps none of the stream's files, the ranks stay in step
    (root / "fail").mkdir()

    def failing(step: int, size: int):  # noqa: ANN202
        writer = contextlib.nullcontext(_FailingWriter())
        return writer if step == 13 else atomic_file(root / "fail" / f"got-{step}")

    if rank == 1:
        with pytest.raises(OSError, match="No space left"):
            ring.stream(None, forward=False, send=False, expect=True, accept=failing)
        assert os.listdir(root / "fail") == []  # not the files before or after the failed one
    else:
        files = list(_files(0, root))
        assert ring.stream(files, forward=False, send=True, expect=False, accept=failing) == []
        for _, f in files:
            f.close()

    # a read that fails on rank 0: it raises, rank 1 is told and keeps nothing
    if rank == 0:
        short = _ShortReader(bytes(2500))
        with pytest.raises(OSError, match="Input/output error"):
            ring.stream([(20, io.BytesIO(b"x" * 10)), (21, short)], forward=True, send=True, expect=False,
                        accept=_accept_into(root))
    else:
        with pytest.raises(ReplicationError, match="rank 0 could not read the files it sent; none was kept"):
            ring.stream(None, forward=True, send=False, expect=True, accept=_accept_into(root))
        assert not (root / "got-20").exists() and not (root / "got-21").exists()

    # and the next exchange works: nothing sent one way, one file the other
    got = ring.stream([(30, io.BytesIO(b"abc"))] if rank == 0 else None, forward=True, send=True, expect=True,
                      accept=_accept_into(root))
    assert got == ([30] if rank == 1 else [])
    if rank == 1:
        assert (root / "got-30").read_bytes() == b"abc"


def test_streams_between_neighbours_commit_whole_or_not_at_all(tmp_path: Path) -> None:
    launch(_worker, 2, str(tmp_path))
