"""Where nvCOMP's shared libraries are: a path a user names, the ``nvidia.libnvcomp`` package
(wheels ``nvidia-libnvcomp-cu12``/``-cu13``), or the dynamic loader's search by soname."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from .. import settings


def library_candidates(env_var: str, pattern: str, soname: str) -> list[str]:
    """Paths (or the soname) to try, in order: ``$env_var`` alone when it is set, else the files
    matching ``pattern`` in the installed package, then ``soname``."""
    chosen = settings.library(env_var)
    if chosen is not None:
        return [chosen]
    found: list[str] = []
    try:
        spec = importlib.util.find_spec("nvidia.libnvcomp")
    except (ImportError, ValueError):  # no ``nvidia`` namespace package at all
        spec = None
    for root in (spec.submodule_search_locations or []) if spec is not None else []:
        for sub in ("lib64", "lib"):
            found += sorted(str(p) for p in Path(root, sub).glob(pattern))
    return [*found, soname]
