"""The library's floors (docs/ARCHITECTURE.md): every module imports only modules of its own
floor or below, nothing in the library imports the command line, the demo or the benchmark
harness (bench/ckptzip_bench, outside the wheel), the harness imports no private module, and
everything outside the engine reaches it only through its seam (``ckptzip.engine.__all__``)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src" / "ckptzip"
BENCH = ROOT / "bench" / "ckptzip_bench"

# Floor of each top-level module or package of ckptzip, bottom up.
FLOORS = {
    "_version": 0, "_lazy": 0, "_local": 0, "errors": 0, "strictjson": 0, "settings": 0,
    "checksum": 1, "storage": 1, "codecs": 1, "transforms": 1, "memory": 1,
    "kernels": 2, "format": 2,
    "tree": 3, "report": 3,
    "engine": 4, "plain": 4,
    "api": 5, "series": 5,
    "staging": 6,
    "convert": 7, "manager": 7, "dcp": 7, "tier": 7,
    "integrations": 8,
    "cost": 9, "cli": 9, "demo": 9, "testing": 9, "__main__": 9,
    "__init__": 10,
}
HARNESS = {"cli", "cost", "demo", "testing", "__main__"}
def _top(module: Path) -> str:
    return module.relative_to(SRC).with_suffix("").parts[0]


def _imports(path: Path) -> set[str]:
    """Top-level ckptzip modules that ``path`` imports (absolute or relative, any depth); the
    harness package as ``"ckptzip_bench"``."""
    package = path.relative_to(SRC).parent.parts
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                names = [*base, *(node.module.split(".") if node.module else [])]
                if not names:  # "from . import x" at the package root
                    found.update(alias.name for alias in node.names)
                    continue
                found.add(names[0])
            elif node.module and node.module.split(".")[0] == "ckptzip":
                parts = node.module.split(".")
                found.add(parts[1] if len(parts) > 1 else node.names[0].name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "ckptzip" and len(parts) > 1:
                    found.add(parts[1])
        if isinstance(node, (ast.Import, ast.ImportFrom)) and not getattr(node, "level", 0):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
            found.update("ckptzip_bench" for name in names if name.split(".")[0] == "ckptzip_bench")
    return found


MODULES = sorted(p for p in SRC.rglob("*.py"))


def test_every_module_has_a_floor() -> None:
    assert {_top(p) for p in MODULES} <= set(FLOORS)


@pytest.mark.parametrize("path", MODULES, ids=[str(p.relative_to(SRC)) for p in MODULES])
def test_imports_never_run_up_the_floors(path: Path) -> None:
    own = _top(path)
    package = path.relative_to(SRC).parts[0]
    for target in _imports(path) - {own, package}:
        assert target in FLOORS, f"{path.relative_to(SRC)} imports unknown ckptzip module {target!r}"
        assert FLOORS[target] <= FLOORS[own], (
            f"{path.relative_to(SRC)} (floor {FLOORS[own]}) imports ckptzip.{target} (floor {FLOORS[target]})"
        )
        if own not in HARNESS and own != "__init__":
            assert target not in HARNESS, f"{path.relative_to(SRC)} imports the harness ckptzip.{target}"


def test_nothing_in_the_library_imports_the_benchmark_harness() -> None:
    assert [str(p.relative_to(SRC)) for p in MODULES if "ckptzip_bench" in _imports(p)] == []


def _ckptzip_imports(path: Path) -> list[str]:
    """Every ``ckptzip...`` module ``path`` imports, and the names it imports from them, dotted;
    the library's relative imports resolved (``from ..engine import x`` in ckptzip/api.py is
    ``ckptzip.engine.x``)."""
    package = ["ckptzip", *path.relative_to(SRC).parent.parts] if path.is_relative_to(SRC) else []
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                module = ".".join([*package[: len(package) - node.level + 1], *filter(None, [node.module])])
            if module == "ckptzip" or module.startswith("ckptzip."):
                found += [f"{module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            found += [alias.name for alias in node.names if alias.name.startswith("ckptzip.")]
    return found


@pytest.mark.parametrize("path", sorted(BENCH.glob("*.py")), ids=lambda p: p.name)
def test_the_harness_uses_no_private_module_or_name(path: Path) -> None:
    private = [
        name for name in _ckptzip_imports(path)
        if any(part.startswith("_") and not part.endswith("__") for part in name.split(".")[1:])
    ]
    assert private == [], f"bench/ckptzip_bench/{path.name} imports private {private}"


def _engine_seam() -> list[str]:
    tree = ast.parse((SRC / "engine" / "__init__.py").read_text())
    return next(ast.literal_eval(node.value) for node in tree.body
                if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "__all__")


def test_the_engine_seam_names_no_module_of_the_engine() -> None:
    """So ``from ckptzip.engine import stager`` is an import of an internal, not of the seam."""
    modules = {p.stem for p in (SRC / "engine").glob("*.py")}
    assert sorted(modules & set(_engine_seam())) == []


CALLERS = [p for p in MODULES if _top(p) != "engine"] + sorted(BENCH.glob("*.py"))


@pytest.mark.parametrize("path", CALLERS, ids=lambda p: str(p.relative_to(ROOT)))
def test_callers_reach_the_engine_only_through_its_seam(path: Path) -> None:
    """The library outside engine/ and the harness import ``ckptzip.engine``'s own names (its
    ``__all__``), never its modules (``ckptzip.engine.stager``) nor what only they define."""
    seam = _engine_seam()
    inside = [name for name in _ckptzip_imports(path)
              if name.startswith("ckptzip.engine.") and name.removeprefix("ckptzip.engine.") not in seam]
    assert inside == [], f"{path.relative_to(ROOT)} imports engine internals {inside}"


@pytest.mark.parametrize("path", sorted((SRC / "memory").glob("*.py")), ids=lambda p: p.name)
def test_the_memory_package_imports_only_the_floor_below(path: Path) -> None:
    """ckptzip.memory sits on the codecs' floor, which allocate through it: it imports only the
    settings, the errors and what a thread sets (floor 0), never the codecs or storage beside it."""
    above = {target for target in _imports(path) - {"memory"} if FLOORS[target] > 0}
    assert above == set(), f"memory/{path.name} imports {sorted(above)}"
