"""Plain states from the files users have, and for the tools they use.

:func:`storable` makes what ``torch.load(weights_only=False)`` returned (a trusted Lightning or HF
checkpoint) into what ckptzip stores, saying what it converted and what it left out;
:func:`weights_only_loadable` makes a loaded state into what ``torch.load(weights_only=True)``
reads. Every change is reported by the dotted path of the entry.
"""

from __future__ import annotations

import argparse
import collections
import pickle
import re
from dataclasses import dataclass, field
from pathlib import PurePath
from typing import Any

import numpy as np
import torch

from .errors import UnsupportedObjectError
from .tree import DROP, is_container, is_storable, map_tree


@dataclass
class Plain:
    """A state made plain, and by ``"path: type"`` lines: what was converted (``-> kind``) and what
    has no plain form (left out by :func:`storable`, kept by :func:`weights_only_loadable`)."""

    state: Any
    converted: list[str] = field(default_factory=list)
    unsupported: list[str] = field(default_factory=list)


def type_name(obj: Any) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}".removeprefix("builtins.")


_SHOWN = 10  # objects an error names; --skip-unsupported reports every one


def listing(lines: list[str]) -> str:
    """The first few of ``lines`` joined for an error message, with how many more there are."""
    more = len(lines) - _SHOWN
    return "; ".join(lines[:_SHOWN]) + (f"; and {more} more" if more > 0 else "")


def _where(path: str) -> str:
    return path or "<root>"


def _stand_in(obj: Any) -> tuple[Any, str] | None:
    """A value ckptzip stores in place of ``obj`` and its kind, for the objects that have one."""
    if isinstance(obj, argparse.Namespace):
        return dict(vars(obj)), "dict"
    if isinstance(obj, PurePath):
        return str(obj), "str"
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a namedtuple: its fields by name
        return dict(zip(obj._fields, obj)), "dict"
    if isinstance(obj, collections.OrderedDict):  # a subclass: its items, in order
        return collections.OrderedDict(obj), "collections.OrderedDict"
    if isinstance(obj, dict):  # a subclass (AttributeDict, defaultdict, ...): its items
        return dict(obj), "dict"
    if isinstance(obj, tuple):
        return tuple(obj), "tuple"
    return None


SKIP_ADVICE = ("Pass --skip-unsupported (skip_unsupported=True) to leave them out (each is reported), or convert them "
               "to tensors and plain values before saving")


def storable(obj: Any, *, skip_unsupported: bool = False, advice: str = SKIP_ADVICE) -> Plain:
    """``obj`` with every leaf ckptzip cannot store replaced by a stand-in (a Namespace, dict
    subclass or namedtuple by a dict, a path by its string) or, with ``skip_unsupported``, left out
    (a dict entry is dropped, a list or tuple item becomes ``None``); without it, such a leaf is an
    :class:`UnsupportedObjectError` naming every one by its path, then ``advice``."""
    plain = Plain(None)

    def value(leaf: Any, path: str) -> Any:
        if is_storable(leaf):
            return leaf
        stand_in = _stand_in(leaf)
        if stand_in is None:
            plain.unsupported.append(f"{_where(path)}: {type_name(leaf)}")
            return DROP
        new, kind = stand_in
        plain.converted.append(f"{_where(path)}: {type_name(leaf)} -> {kind}")
        return map_tree(new, value, key, path) if is_container(new) else new

    def key(k: Any, path: str) -> Any:
        if is_storable(k):
            return k
        if isinstance(k, PurePath):
            plain.converted.append(f"{path}: {type_name(k)} -> str")
            return str(k)
        plain.unsupported.append(f"{path}: {type_name(k)}")
        return DROP

    try:
        plain.state = map_tree(obj, value, key)
    except RecursionError:
        raise UnsupportedObjectError("the state is nested too deeply or holds a reference cycle") from None
    if plain.state is DROP:
        raise UnsupportedObjectError(f"the state is a {type_name(obj)}, which ckptzip cannot store")
    if plain.unsupported and not skip_unsupported:
        raise UnsupportedObjectError(
            f"ckptzip cannot store {len(plain.unsupported)} object(s) of this state: {listing(plain.unsupported)}. "
            f"{advice}"
        )
    return plain


def weights_only_loadable(obj: Any) -> Plain:
    """``obj`` with its NumPy arrays and numeric NumPy scalars as tensors of the same dtype and
    bits (``torch.load(weights_only=True)`` refuses NumPy objects); NumPy scalars torch cannot
    hold (strings, dates) stay, listed in ``unsupported`` as what keeps the file from loading so."""
    plain = Plain(None)

    def value(leaf: Any, path: str) -> Any:
        if not isinstance(leaf, (np.ndarray, np.generic)):
            return leaf
        try:
            tensor = torch.from_numpy(np.asarray(leaf))
        except (TypeError, ValueError):  # a dtype torch has no equivalent of
            plain.unsupported.append(f"{_where(path)}: {type_name(leaf)}")
            return leaf
        plain.converted.append(f"{_where(path)}: {type_name(leaf)} -> torch.Tensor")
        return tensor

    plain.state = map_tree(obj, value)
    return plain


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def weights_only_refusal(exc: BaseException) -> str:
    """The reason in torch's long weights_only message ("Unsupported global: GLOBAL m.C was not an
    allowed global by default"), or the message itself without terminal colour codes."""
    text = _ANSI.sub("", str(exc))
    if isinstance(exc, pickle.UnpicklingError):
        for line in text.splitlines():
            _, marker, reason = line.partition("WeightsUnpickler error: ")
            if marker:
                return reason.split(" Please use")[0].rstrip(". ")
    return text.strip() or type(exc).__name__

