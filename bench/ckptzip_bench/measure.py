"""Helpers shared by the benchmark and the tests: walk a state, time a baseline and compare what it
restored bit for bit (:func:`ckptzip.demo.compare.assert_state_equal`)."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ckptzip.demo.compare import assert_state_equal
from ckptzip.tree import iter_leaves

if TYPE_CHECKING:
    from .baselines import Baseline

__all__ = [
    "BaselineRun",
    "assert_state_equal",
    "flat_tensors",
    "iter_tensors",
    "run_baseline",
    "tensor_nbytes",
]


def iter_tensors(state: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(dotted path, tensor)`` for every tensor in nested dicts, lists and tuples.

    Paths join keys and list indices with ``"."``, e.g. ``"optimizer.state.3.exp_avg"``.
    """
    return ((path, value) for path, value in iter_leaves(state) if isinstance(value, torch.Tensor))


def flat_tensors(state: Any) -> dict[str, torch.Tensor]:
    """``{dotted path: tensor}``; raises ``ValueError`` if two paths collide (keys containing dots)."""
    flat: dict[str, torch.Tensor] = {}
    for path, tensor in iter_tensors(state):
        if path in flat:
            raise ValueError(
                f"two tensors of the state flatten to the same path {path!r}; "
                "rename keys that contain '.' so paths are unique"
            )
        flat[path] = tensor
    return flat


def tensor_nbytes(state: Any) -> int:
    """Total bytes of all tensors in ``state``."""
    return sum(t.numel() * t.element_size() for _, t in iter_tensors(state))


@dataclass(frozen=True)
class BaselineRun:
    """One save + load of a state through a baseline, checked bit for bit."""

    name: str
    raw_bytes: int
    bytes_written: int
    save_seconds: float
    load_seconds: float
    mismatch: str | None  # None when the loaded state equals what the baseline promises

    @property
    def exact(self) -> bool:
        return self.mismatch is None

    @property
    def ratio(self) -> float:
        return self.raw_bytes / self.bytes_written if self.bytes_written else math.inf

    @property
    def save_gbps(self) -> float:
        return self.raw_bytes / self.save_seconds / 1e9 if self.save_seconds else math.inf

    @property
    def load_gbps(self) -> float:
        return self.raw_bytes / self.load_seconds / 1e9 if self.load_seconds else math.inf


def run_baseline(
    baseline: Baseline, state: Any, directory: str | Path, *, device: str | torch.device = "cpu"
) -> BaselineRun:
    """Save ``state`` with ``baseline`` into ``directory``, load it onto ``device`` and compare.

    The ratio and speeds count the tensor bytes the baseline stores (:meth:`Baseline.expected`).
    """
    saved = baseline.save(state, directory)
    loaded, load_seconds = baseline.load(directory, device)
    expected = baseline.expected(state)
    try:
        assert_state_equal(expected, loaded)
        mismatch = None
    except AssertionError as error:
        mismatch = str(error)
    return BaselineRun(
        name=baseline.name,
        raw_bytes=tensor_nbytes(expected),
        bytes_written=saved.bytes_written,
        save_seconds=saved.seconds,
        load_seconds=load_seconds,
        mismatch=mismatch,
    )
