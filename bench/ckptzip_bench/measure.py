"""Helpers shared by the benchmark, the demo and the tests: walk a state, compare it bit for bit, time a baseline."""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ckptzip.tree import iter_leaves, join_path

if TYPE_CHECKING:
    from ckptzip.bench.baselines import Baseline

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


def _raw_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def _same_scalar(a: object, b: object) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return bool(a == b)


def assert_state_equal(expected: Any, actual: Any, path: str = "") -> None:
    """Raise ``AssertionError`` naming the first path where ``actual`` differs from ``expected``.

    Tensors must match in dtype, shape and every byte (``torch.equal`` on ``uint8`` views; the
    device may differ). Mappings must have the same keys (any ``Mapping`` subclass; key order is
    not compared); lists and tuples the same type and length; other leaves the same type and value
    (NaN equals NaN).
    """
    where = path or "<root>"
    if isinstance(expected, torch.Tensor):
        if not isinstance(actual, torch.Tensor):
            raise AssertionError(f"{where}: expected a tensor, found {type(actual).__name__}")
        if expected.dtype != actual.dtype or expected.shape != actual.shape:
            raise AssertionError(
                f"{where}: expected {expected.dtype} {tuple(expected.shape)}, "
                f"found {actual.dtype} {tuple(actual.shape)}"
            )
        if not torch.equal(_raw_bytes(expected), _raw_bytes(actual).to(expected.device)):
            raise AssertionError(f"{where}: tensor bytes differ")
    elif isinstance(expected, Mapping):
        if not isinstance(actual, Mapping):
            raise AssertionError(f"{where}: expected a mapping, found {type(actual).__name__}")
        missing = [k for k in expected if k not in actual]
        extra = [k for k in actual if k not in expected]
        if missing or extra:
            raise AssertionError(f"{where}: keys differ; missing {missing!r}, unexpected {extra!r}")
        for key, value in expected.items():
            assert_state_equal(value, actual[key], join_path(path, key))
    elif isinstance(expected, (list, tuple)):
        if type(actual) is not type(expected) or len(actual) != len(expected):
            raise AssertionError(
                f"{where}: expected {type(expected).__name__} of length {len(expected)}, found "
                f"{type(actual).__name__}"
                + (f" of length {len(actual)}" if isinstance(actual, (list, tuple)) else "")
            )
        for index, (a, b) in enumerate(zip(expected, actual, strict=True)):
            assert_state_equal(a, b, join_path(path, index))
    elif type(actual) is not type(expected) or not _same_scalar(expected, actual):
        raise AssertionError(f"{where}: expected {expected!r}, found {actual!r}")


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
