"""Invertible tensor transforms applied before the codec (see :class:`Transform`)."""

from __future__ import annotations

from typing import Any

from ..errors import CorruptCheckpointError, UnsupportedFormatError
from .base import Transform
from .byteplanes import BytePlanes
from .sparse import Sparse

_TRANSFORMS: dict[str, type[Transform]] = {BytePlanes.transform_id: BytePlanes, Sparse.transform_id: Sparse}


def get_transform(config: Any) -> Transform:
    """Build a transform from its index configuration, validating it."""
    if not isinstance(config, dict) or not isinstance(config.get("id"), str):
        raise CorruptCheckpointError(f"transform configuration {config!r:.80} has no string 'id'")
    cls = _TRANSFORMS.get(config["id"])
    if cls is None:
        raise UnsupportedFormatError(
            f"unknown transform {config['id']!r}; this ckptzip knows {sorted(_TRANSFORMS)}. "
            "Upgrade ckptzip to read this file."
        )
    options = {k: v for k, v in config.items() if k != "id"}
    try:
        return cls(**options)
    except (TypeError, ValueError) as exc:
        raise CorruptCheckpointError(f"transform {config['id']!r} has bad options {options}: {exc}") from exc


__all__ = ["BytePlanes", "Sparse", "Transform", "get_transform"]
