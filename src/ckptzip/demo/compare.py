"""Compare two states bit for bit: the check behind the demo's "restored state is bit-identical"."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from ..tree import join_path

__all__ = ["assert_state_equal"]


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
