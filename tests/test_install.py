"""Issue #44: the README's install lines work from a clone, and the Makefile installs the torch
the README says: a CPU build from PyTorch's CPU index on Linux (PyPI's Linux wheel is the CUDA
build), or with ``TORCH=`` the torch the machine has, seen through --system-site-packages.

The Makefile is read with ``make -n`` (what it would run), so no index is asked; ``make demo``
and ``make test`` themselves run in CI (.ci/run)."""

from __future__ import annotations

import platform
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
needs_make = pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")


def _plan(tmp_path: Path, *args: str) -> list[str]:
    """The commands ``make -n ARGS`` would run, with .venv in ``tmp_path`` (which holds none)."""
    done = subprocess.run(["make", "-n", "-s", "-C", str(ROOT), f"VENV={tmp_path / 'venv'}", *args],
                          capture_output=True, text=True, check=True, timeout=60)
    return done.stdout.splitlines()


@needs_make
def test_torch_alone_comes_from_the_cpu_index_before_ckptzip(tmp_path: Path) -> None:
    plan = _plan(tmp_path, "demo")
    (torch,) = [line for line in plan if "pip install" in line and "torch==" in line]
    assert torch.endswith('-m pip install --no-deps --index-url https://download.pytorch.org/whl/cpu --retries 1 '
                          '"torch==2.13.0"') == (platform.system() == "Linux")
    assert " -q" not in torch  # what is downloaded shows
    (ckptzip,) = [i for i, line in enumerate(plan) if line.endswith("pip install -q -e .")]
    assert plan.index(torch) < ckptzip
    assert any(line.endswith(f"-m venv  {tmp_path / 'venv'}") for line in plan)  # not the machine's packages
    (other,) = [line for line in _plan(tmp_path, "torch", "TORCH_INDEX=", "TORCH=torch==2.12.0") if "torch==" in line]
    assert other.endswith('-m pip install --no-deps  "torch==2.12.0"')


@needs_make
def test_an_empty_torch_keeps_the_machines_through_system_site_packages(tmp_path: Path) -> None:
    plan = _plan(tmp_path, "demo", "TORCH=")
    assert not [line for line in plan if "torch==" in line]
    assert any(line.endswith(f"-m venv --system-site-packages {tmp_path / 'venv'}") for line in plan)
    checks = [line for line in plan if 'import torch" 2>/dev/null ||' in line]
    assert len(checks) == 2  # python3 has a torch, and .venv sees it, before ckptzip is installed
    assert "TORCH= keeps the torch of python3, which has none" in checks[0]


@needs_make
def test_an_empty_torch_stops_where_python_has_none(tmp_path: Path) -> None:
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\nexit 1\n")  # as a python without torch answers `-c "import torch"`
    fake.chmod(0o755)
    done = subprocess.run(["make", "-s", "-C", str(ROOT), f"VENV={tmp_path / 'venv'}", f"PYTHON={fake}", "TORCH=", "demo"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert f"TORCH= keeps the torch of {fake}, which has none; leave TORCH out to install a CPU build" in done.stdout
    assert not (tmp_path / "venv").exists()


def test_the_readme_installs_from_a_clone() -> None:
    readme = (ROOT / "README.md").read_text()
    install = readme[readme.index("## Install\n") : readme.index("\n## ", readme.index("## Install\n") + 1)]
    assert "pip install .   " in install and 'pip install ".[gpu]"' in install
    assert not re.search(r"pip install \"?ckptzip", install)  # no such distribution
    extensions = len(re.findall(r"\bExtension\(", (ROOT / "setup.py").read_text()))
    counted = {3: "three", 4: "four", 5: "five"}[extensions]
    assert f"`pip install .` compiles {counted} optional C extensions" in install  # as many as setup.py builds
    assert "make demo TORCH=" in readme and "--system-site-packages" in readme
