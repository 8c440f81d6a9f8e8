"""The container recipe without a container engine: the files the Dockerfile copies are enough for
docker/install.sh to install ckptzip with its GPU extra into a fresh virtual environment (with a
CPU torch here), and the image's default command, the demo, runs there."""

from __future__ import annotations

import os
import pathlib
import re
import shlex
import shutil
import subprocess
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCKERFILE = (ROOT / "Dockerfile").read_text()


def instructions(name: str) -> list[str]:
    """Arguments of every ``name`` instruction of the Dockerfile (continuation lines joined)."""
    joined = DOCKERFILE.replace("\\\n", " ")
    return [m.group(1).strip() for m in re.finditer(rf"^{name}\s+(.+)$", joined, re.MULTILINE)]


def test_dockerfile_runs_the_install_script_and_defaults_to_the_demo() -> None:
    assert instructions("FROM") == ["${CUDA_IMAGE}"]
    assert any(arg.startswith("CUDA_IMAGE=nvidia/cuda:") and "-runtime-" in arg for arg in instructions("ARG"))
    runs = instructions("RUN")
    install = next(i for i, run in enumerate(runs) if "docker/install.sh /opt/ckptzip" in run)
    assert runs[install + 1:] == ["ckptzip warmup"]  # Triton's key kept in the image, after the install
    assert "CKPTZIP_CACHE_DIR=/opt/ckptzip-cache" in instructions("ENV")
    assert instructions("CMD") == ['["ckptzip", "demo"]']


def torch_spec() -> str:
    """pip arguments for the torch that runs these tests, which must be a CPU build: CI never
    downloads a CUDA torch (set CKPTZIP_TEST_TORCH_SPEC to choose another)."""
    if "CKPTZIP_TEST_TORCH_SPEC" in os.environ:
        return os.environ["CKPTZIP_TEST_TORCH_SPEC"]
    if torch.version.cuda is not None:
        pytest.skip("the running torch is a CUDA build; set CKPTZIP_TEST_TORCH_SPEC to a CPU build's pip arguments")
    return f"torch=={torch.__version__}"


@pytest.mark.slow
def test_install_script_in_a_fresh_venv_then_the_demo(tmp_path: pathlib.Path) -> None:
    context = tmp_path / "context"  # what `COPY` puts into the image, and nothing else
    for copy in instructions("COPY"):
        *sources, destination = shlex.split(copy)
        for source in sources:
            assert destination in ("./", source), f"COPY {copy}: the test mirrors sources to their own paths"
            target = context / source
            target.parent.mkdir(parents=True, exist_ok=True)
            if (ROOT / source).is_dir():
                shutil.copytree(ROOT / source, target, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
            else:
                shutil.copy2(ROOT / source, target)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(PYTHON=str(python), TORCH_SPEC=torch_spec(), CKPTZIP_EXTRAS="gpu-cu13")
    done = subprocess.run(["bash", str(context / "docker" / "install.sh"), str(context)], env=env, cwd=tmp_path,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert re.search(r"^ckptzip \S+, torch \S+ \(CUDA None\), nvCOMP: \['nvidia-libnvcomp-cu13'\]$", done.stdout,
                     re.MULTILINE), done.stdout[-2000:]
    warm = subprocess.run([str(venv / "bin" / "ckptzip"), "warmup"], env={**env, "CKPTZIP_CACHE_DIR": str(tmp_path / "c")},
                          cwd=tmp_path, capture_output=True, text=True)
    assert warm.returncode == 0 and "no CUDA device here" in warm.stdout, warm.stdout[-2000:] + warm.stderr[-2000:]
    demo = subprocess.run([str(venv / "bin" / "ckptzip"), "demo", "--steps", "2"], env=env, cwd=tmp_path,
                          capture_output=True, text=True)
    assert demo.returncode == 0, demo.stdout[-3000:] + demo.stderr[-3000:]
    assert "restored state is bit-identical" in demo.stdout
