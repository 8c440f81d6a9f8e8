"""Failures a user can cause are CkptzipErrors whose message says what to do: an object store
without credentials, the demo's arguments, a device hint naming the caller's own argument."""

from __future__ import annotations

import argparse
import importlib.abc
import importlib.metadata
import os
import subprocess
import sys
import types
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import ckptzip
from ckptzip.cli import main

ROOT = Path(__file__).resolve().parent.parent
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")


def test_object_store_without_credentials(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    pytest.importorskip("s3fs")
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    with pytest.raises(ckptzip.StorageAccessError, match=(
        r"^storage 's3://bucket/run': the object store needs credentials and found none \(NoCredentialsError: .*\); "
        r"set them in the environment \(for S3: AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE\), or "
        r"pass storage_options")):
        ckptzip.CheckpointManager("s3://bucket/run", storage_options={"skip_instance_cache": True})


@no_cuda
def test_decompress_to_a_missing_gpu_names_its_own_argument() -> None:
    ct = ckptzip.compress(torch.ones(3))
    with pytest.raises(ckptzip.DeviceUnavailableError, match=r"CUDA is not available here; pass device='cpu' to load"):
        ckptzip.decompress(ct, device="cuda")


@pytest.mark.parametrize(("args", "message"), [
    (["--steps", "0"], "--steps 0: pass a number of training steps >= 1"),
    (["--preset", "huge"], "--preset 'huge' is not a model preset; pass one of tiny, tiny-moe, small"),
    (["--device", "gpu0"], "--device 'gpu0' is not a device; pass cpu or cuda"),
    pytest.param(["--device", "cuda"], "--device cuda: CUDA is not available here; pass --device cpu", marks=no_cuda),
])
def test_demo_arguments(args: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", *args]) == 1
    assert capsys.readouterr().err.startswith(f"ckptzip: error: {message}")


def test_demo_shows_progress_and_says_its_table_is_the_largest_tensors(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--steps", "2", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "  step 1/2\n  step 2/2\n" in out
    assert "the 12 largest of 266 tensors:\ntensor " in out


class _NoHarness(importlib.abc.MetaPathFinder):
    """An import system on which the benchmark harness is not installed."""

    def find_spec(self, name: str, path: object = None, target: object = None) -> None:
        if name.split(".")[0] == "ckptzip_bench":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)


def _entry_points(*found: importlib.metadata.EntryPoint) -> Callable[..., list[importlib.metadata.EntryPoint]]:
    """``importlib.metadata.entry_points`` on a machine whose only ``ckptzip.bench`` entry points are ``found``."""
    def entry_points(*, group: str) -> list[importlib.metadata.EntryPoint]:
        return [e for e in found if e.group == group]
    return entry_points


def test_bench_without_the_harness_says_how_to_install_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The harness is not in the wheel: an installed ckptzip without it says so."""
    # As where it is not installed: no entry point, not importable (an editable install finds it by
    # a finder of its own, not by sys.path), and not imported already by earlier tests.
    monkeypatch.setattr(importlib.metadata, "entry_points", _entry_points())
    monkeypatch.setattr(sys, "meta_path", [_NoHarness(), *sys.meta_path])
    for name in [m for m in sys.modules if m.split(".")[0] == "ckptzip_bench"]:
        monkeypatch.delitem(sys.modules, name)
    assert main(["bench", "--device", "cpu"]) == 1
    assert capsys.readouterr().err.strip() == (
        "ckptzip: error: `ckptzip bench` needs the benchmark harness, which is not installed: it is not part of the "
        "ckptzip wheel; from a ckptzip checkout, `pip install -e bench` (or put the checkout's bench/ folder on "
        "PYTHONPATH)"
    )


def test_bench_runs_the_module_its_entry_point_names(monkeypatch: pytest.MonkeyPatch) -> None:
    """An installed harness is found through the entry point bench/pyproject.toml declares, wherever it lives."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11
    declared = tomllib.loads((ROOT / "bench" / "pyproject.toml").read_text())["project"]["entry-points"]
    assert declared == {"ckptzip.bench": {"harness": "ckptzip_bench.run"}}
    harness = types.ModuleType("elsewhere_bench")
    ran: list[argparse.Namespace] = []
    harness.configure = lambda p: p.add_argument("--reps")  # type: ignore[attr-defined]
    harness.run = ran.append  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "elsewhere_bench", harness)
    monkeypatch.setattr(importlib.metadata, "entry_points", _entry_points(
        importlib.metadata.EntryPoint("harness", "elsewhere_bench", "ckptzip.bench")))
    assert main(["bench", "--reps", "2"]) == 0
    assert [args.reps for args in ran] == ["2"]


def test_bench_from_a_checkout_imports_the_harness_from_bench_on_the_path() -> None:
    """Uninstalled, ``ckptzip bench`` imports ckptzip_bench by name: a checkout's bench/ on PYTHONPATH."""
    code = "import sys; sys.argv = ['ckptzip', 'bench', '--help']; from ckptzip.cli import main; main()"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = os.pathsep.join(str(ROOT / folder) for folder in ("src", "bench"))
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "--methods" in done.stdout
