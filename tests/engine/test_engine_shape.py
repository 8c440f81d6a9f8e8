"""The engine's shape, and staging's (ckptzip.staging, built on it, keeps its rules): functions take
records, not parallel lists (at most six arguments, ``self``/``cls`` not counted), and each module
holds one concept (at most 400 lines)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src" / "ckptzip"
MODULES = sorted([*(SRC / "engine").glob("*.py"), *(SRC / "staging").glob("*.py")])
MAX_ARGUMENTS = 6
MAX_LINES = 400


def _arguments(node: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    a = node.args
    names = [x.arg for x in [*a.posonlyargs, *a.args, *a.kwonlyargs]]
    names += [x.arg for x in (a.vararg, a.kwarg) if x is not None]
    return [n for n in names if n not in ("self", "cls")]


@pytest.mark.parametrize("path", MODULES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_no_engine_function_takes_more_than_six_arguments(path: Path) -> None:
    tree = ast.parse(path.read_text())
    wide = [(node.name, len(_arguments(node))) for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and len(_arguments(node)) > MAX_ARGUMENTS]
    assert wide == [], f"{path.parent.name}/{path.name}: group these functions' arguments into records"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_no_engine_module_is_longer_than_400_lines(path: Path) -> None:
    assert len(path.read_text().splitlines()) <= MAX_LINES, f"{path.parent.name}/{path.name}: split it by concept"
