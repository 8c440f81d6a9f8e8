"""Slabs of registered host memory (ckptzip/memory/pinned.py): how they are registered with CUDA,
in pieces, on any machine (a recording stand-in answers for CUDA's runtime)."""

from __future__ import annotations

import pytest
import torch

from ckptzip.memory import pinned

KIB = 1 << 10


class Runtime:
    """CUDA's ``cudaHostRegister`` and ``cudaHostUnregister``, recorded; ``refuse``: the call
    (by its number, from 0) that fails, with CUDA's error 2 (out of memory)."""

    def __init__(self, refuse: int | None = None) -> None:
        self.refuse = refuse
        self.registered: list[tuple[int, int]] = []
        self.unregistered: list[int] = []

    def cudaHostRegister(self, address: int, nbytes: int, flags: int) -> int:
        if len(self.registered) == self.refuse:
            return 2
        self.registered.append((address, nbytes))
        return 0

    def cudaHostUnregister(self, address: int) -> int:
        self.unregistered.append(address)
        return 0


@pytest.fixture
def runtime(monkeypatch: pytest.MonkeyPatch) -> Runtime:
    answer = Runtime()
    monkeypatch.setattr(pinned, "_cudart", lambda: answer)
    monkeypatch.setattr(pinned, "REGISTER_BYTES", 64 * KIB)
    return answer


@pytest.fixture
def rests(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    slept: list[float] = []
    monkeypatch.setattr(pinned.time, "sleep", slept.append)
    return slept


def test_a_slab_is_registered_in_pieces_of_at_most_register_bytes(runtime: Runtime, rests: list[float]) -> None:
    slab = pinned.Slab(200 * KIB)
    start = slab.memory.data_ptr()
    assert runtime.registered == [(start, 64 * KIB), (start + 64 * KIB, 64 * KIB), (start + 128 * KIB, 64 * KIB),
                                  (start + 192 * KIB, 8 * KIB)]
    assert slab.piece_bytes == 64 * KIB and rests == []  # not paced: no rest
    del slab
    assert sorted(runtime.unregistered) == [a for a, _ in runtime.registered]


def test_a_slabs_pieces_are_whole_units_so_that_its_buffers_each_lie_in_one(runtime: Runtime) -> None:
    slab = pinned.Slab(240 * KIB, unit=48 * KIB)
    assert slab.piece_bytes == 96 * KIB
    assert [n for _, n in runtime.registered] == [96 * KIB, 96 * KIB, 48 * KIB]


def test_a_paced_slab_rests_after_each_piece(runtime: Runtime, rests: list[float]) -> None:
    pinned.Slab(200 * KIB, paced=True)
    assert len(rests) == 4 and all(r >= 0 for r in rests)


def test_a_refused_piece_unregisters_the_slabs_other_pieces_and_says_which(
        monkeypatch: pytest.MonkeyPatch, runtime: Runtime) -> None:
    runtime.refuse = 2
    with pytest.raises(RuntimeError) as caught:
        pinned.Slab(200 * KIB)
    assert str(caught.value) == "cudaHostRegister of 65536 bytes (of a slab of 204800) failed with CUDA error 2"
    assert sorted(runtime.unregistered) == [a for a, _ in runtime.registered] and len(runtime.registered) == 2


def test_a_pool_registers_its_buffers_whole_in_pieces_and_paces_a_reservation_while_training_runs(
        runtime: Runtime, rests: list[float]) -> None:
    pool = pinned.PinnedPool(buffer_bytes=48 * KIB, count=8, slab_bytes=192 * KIB)
    pool.reserve(5 * 48 * KIB, paced=True)
    assert pool.reserved == 5 * 48 * KIB
    assert [n for _, n in runtime.registered] == [96 * KIB, 96 * KIB, 48 * KIB]  # slabs of 4 and 1 buffers
    assert len(rests) == 3
    pool.acquire(), pool.acquire()
    assert len(rests) == 3  # taken from the reservation


@pytest.mark.parametrize(("offset", "nbytes", "piece", "expected"), [
    (0, 10, 4, [(0, 4), (4, 8), (8, 10)]),
    (3, 6, 4, [(3, 4), (4, 8), (8, 9)]),
    (4, 4, 4, [(4, 8)]),
    (5, 2, 4, [(5, 7)]),
    (7, 0, 4, []),
])
def test_copies_are_cut_where_a_slabs_pieces_end(offset: int, nbytes: int, piece: int,
                                                expected: list[tuple[int, int]]) -> None:
    assert list(pinned.piece_ends(offset, nbytes, piece)) == expected


def test_every_cut_lies_in_one_piece_and_the_cuts_cover_the_copy() -> None:
    generator = torch.Generator().manual_seed(3)
    for _ in range(200):
        offset, nbytes, piece = (int(v) for v in torch.randint(0, 1000, (3,), generator=generator))
        piece += 1
        cuts = list(pinned.piece_ends(offset, nbytes, piece))
        assert [a for a, _ in cuts[1:]] == [b for _, b in cuts[:-1]]
        assert (cuts[0][0], cuts[-1][1]) == (offset, offset + nbytes) if nbytes else cuts == []
        assert all(a < b and a // piece == (b - 1) // piece for a, b in cuts)


def test_a_slab_whose_memory_cannot_be_had_raises_that_error_alone(
        monkeypatch: pytest.MonkeyPatch, runtime: Runtime) -> None:
    def short(nbytes: int, shared: bool = False) -> torch.Tensor:
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(pinned, "_fresh_memory", short)
    unraisable: list[object] = []
    monkeypatch.setattr("sys.unraisablehook", unraisable.append)
    with pytest.raises(OSError, match="Cannot allocate memory"):
        pinned.Slab(200 * KIB)
    import gc

    gc.collect()
    assert unraisable == [] and runtime.registered == []  # nothing registered, and __del__ had nothing to undo
