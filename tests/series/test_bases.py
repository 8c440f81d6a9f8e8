"""A series' one cached answer to "which step is N's base": read once from N's index, checked
(an earlier step of the series, or no base), forgotten when N is deleted or replaced through the
series, and never kept when it was read across such a change."""

from __future__ import annotations

from pathlib import Path
from typing import Any, BinaryIO

import pytest
import torch

import ckptzip
from ckptzip.api import write_checkpoint
from ckptzip.engine.policy import Policy
from ckptzip.engine.sources import DeltaBase
from ckptzip.format import BaseRef
from ckptzip.series import Series, name_of, read_base, step_of
from ckptzip.storage import LocalDirectory
from ckptzip.storage.commits import LocalStorage

POLICY = Policy.parse("portable")


def weights(step: int) -> dict[str, torch.Tensor]:
    """Weights that move a little per step: a save against the previous one stores deltas."""
    w = torch.randn(1 << 14, generator=torch.Generator().manual_seed(0))
    return {"w": w * (1 + 1e-4 * step), "b": torch.arange(64) + step}


class Counting(LocalStorage):
    """A local storage that counts the opens of each name, runs ``on_open`` at each, and lists
    the steps it deletes."""

    def __init__(self, path: Path) -> None:
        super().__init__(LocalDirectory(path))
        self.directory.makedirs()
        self.opens: dict[str, int] = {}
        self.on_open: Any = None
        self.deleted: list[int] = []

    def open(self, name: str) -> BinaryIO:
        self.opens[name] = self.opens.get(name, 0) + 1
        if self.on_open is not None:
            self.on_open()
        return super().open(name)

    def delete(self, name: str) -> None:
        self.deleted.append(step_of(name))
        super().delete(name)


def save(series: Series, step: int, base: int | None = None, *, ref: BaseRef | None = None) -> None:
    """Write ``weights(step)`` as ``step``, as deltas against ``base`` (or against ``ref``)."""
    if base is not None:
        with series.open(base) as f, ckptzip.open(f) as reader:
            ref = BaseRef(base, name_of(base), reader.content_hash)
    delta = None if ref is None else DeltaBase(ref, weights(ref.step or 0))
    series.write(step, lambda f: write_checkpoint(f, weights(step), POLICY, base=delta))


@pytest.fixture
def storage(tmp_path: Path) -> Counting:
    return Counting(tmp_path / "run")


@pytest.fixture
def chain(storage: Counting) -> Series:
    """Steps 1 <- 2 <- 3 (deltas) and 4 (whole)."""
    series = Series(storage)
    save(series, 1)
    save(series, 2, 1)
    save(series, 3, 2)
    save(series, 4)
    storage.opens.clear()
    return Series(storage)  # a fresh series: nothing cached


def test_each_base_is_read_once_from_the_index(chain: Series, storage: Counting) -> None:
    assert [chain.base_of(s) for s in (1, 2, 3, 4)] == [None, 1, 2, None]
    assert [chain.base_of(s) for s in (4, 3, 2, 1)] == [None, 2, 1, None]
    assert storage.opens == {name_of(s): 1 for s in (1, 2, 3, 4)}
    assert chain.chain(3) == [1, 2, 3] and chain.chain(4) == [4]


def test_retire_keeps_the_chains_of_the_newest_and_removes_deltas_first(chain: Series, storage: Counting) -> None:
    chain.retire(2)
    assert chain.steps() == [1, 2, 3, 4] and storage.deleted == []
    chain.retire(1)
    assert chain.steps() == [4] and storage.deleted == [3, 2, 1]


def test_a_deleted_step_is_read_again_when_it_comes_back(chain: Series, storage: Counting) -> None:
    assert chain.base_of(2) == 1
    chain.delete(2)
    assert chain.base_of(2) is None and chain.chain(3) == [3]  # gone: the base of nothing
    save(chain, 2)  # whole now
    assert chain.base_of(2) is None
    assert chain.base_of(3) == 2 and chain.chain(3) == [2, 3]


def test_a_step_replaced_through_the_series_is_read_again(chain: Series, storage: Counting) -> None:
    assert chain.base_of(4) is None
    save(chain, 4, 3)
    assert chain.base_of(4) == 3 and chain.chain(4) == [1, 2, 3, 4]
    assert storage.opens[name_of(4)] == 2


def test_a_step_written_by_other_means_is_read_again_once_the_write_is_over(chain: Series, tmp_path: Path) -> None:
    assert chain.base_of(2) == 1
    with chain.forgetting(2), open(tmp_path / "run" / name_of(2), "wb") as f:
        write_checkpoint(f, weights(2), POLICY)
    assert chain.base_of(2) is None


def test_an_answer_read_while_the_series_changed_is_not_kept(chain: Series, storage: Counting) -> None:
    storage.on_open = lambda: chain.forget(4)  # another thread replaces a step during the read
    assert chain.base_of(3) == 2
    storage.on_open = None
    assert chain.base_of(3) == 2
    assert storage.opens[name_of(3)] == 2  # the first answer was not cached
    assert chain.base_of(3) == 2 and storage.opens[name_of(3)] == 2


def test_a_recorded_base_needs_no_read(chain: Series, storage: Counting) -> None:
    chain.record(3, 2)
    assert chain.base_of(3) == 2 and name_of(3) not in storage.opens


def test_a_missing_step_has_no_base_and_that_is_not_cached(storage: Counting) -> None:
    series = Series(storage)
    assert series.base_of(2) is None
    with pytest.raises(FileNotFoundError):
        read_base(storage, 2)
    other = Series(storage)  # a write this series was not told of
    save(other, 1)
    save(other, 2, 1)
    assert series.base_of(2) == 1


def test_a_damaged_step_has_no_base(chain: Series, storage: Counting) -> None:
    path = storage.root / name_of(3)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF  # the trailer
    path.write_bytes(bytes(data))
    assert chain.base_of(3) is None and chain.chain(3) == [3]


@pytest.mark.parametrize("ref", [BaseRef(1, "foreign.ckz", "0123456789abcdef"),  # not a name of the series
                                 BaseRef(3, name_of(3), "0123456789abcdef")],  # not an earlier step
                         ids=["foreign", "later"])
def test_a_base_that_is_not_an_earlier_step_of_the_series_is_none(storage: Counting, ref: BaseRef) -> None:
    series = Series(storage)
    save(series, 1)
    save(series, 2, ref=ref)
    assert read_base(storage, 2) is None and series.base_of(2) is None
