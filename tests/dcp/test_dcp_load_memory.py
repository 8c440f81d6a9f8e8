"""The DCP reader on a GPU that training fills: a data file's GPU items decode in groups that fit
beside the targets they are copied into."""

from __future__ import annotations

import pytest
import torch

from ckptzip.dcp import _reader
from ckptzip.engine import memory

GPU = torch.device("cuda", 0)
CPU = torch.device("cpu")


def test_items_decode_together_when_they_fit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(memory, "available", lambda device: 1000)
    assert _reader._groups([100, 200, 200], [GPU, GPU, CPU]) == [[0, 1, 2]]
    assert _reader._groups([1 << 40, 5], [CPU, CPU]) == [[0, 1]]  # host items: no GPU limit


def test_items_that_do_not_fit_decode_in_groups_of_half_what_can_be_had(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(memory, "available", lambda device: 1000)
    assert _reader._groups([300, 300, 7, 400, 600, 100], [GPU, GPU, CPU, GPU, GPU, GPU]) == [
        [0], [1, 2], [3], [4], [5]]  # a host item rides along; an item over the limit goes alone
