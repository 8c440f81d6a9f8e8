"""Attributes of a package loaded on first access (PEP 562), so importing it stays cheap."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Collection, Mapping
from typing import Any


def lazy_attributes(package: str, table: Mapping[str, str], namespace: dict[str, Any],
                    submodules: Collection[str] = ()) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of ``package``: name ``n`` of ``table`` comes from its
    module ``table[n]`` (relative to ``package``), and name ``n`` of ``submodules`` is the
    submodule ``package.n`` (``ckptzip.dcp.CompressedStorageWriter`` after ``import ckptzip``),
    each imported the first time it is asked for and then kept in ``namespace`` (the package's
    globals)."""

    def getattr_(name: str) -> Any:
        if name in submodules:
            value = importlib.import_module(f".{name}", package)
        elif name in table:
            value = getattr(importlib.import_module(table[name], package), name)
        else:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        namespace[name] = value
        return value

    def dir_() -> list[str]:
        return sorted({*namespace, *table, *submodules})

    return getattr_, dir_
