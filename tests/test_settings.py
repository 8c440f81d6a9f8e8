"""Every environment variable and the ``gpu_memory=`` argument, validated where the call that uses
them runs (issue 45): a value ckptzip cannot act on is a ``UsageError`` saying what was expected,
on a CPU-only run too; the variables are read in ckptzip.settings alone and documented in one
table (docs/ENVIRONMENT.md)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import save_bytes

import ckptzip
from ckptzip import settings
from ckptzip.codecs import cpu_threads
from ckptzip.errors import UsageError

ROOT = Path(__file__).resolve().parents[1]
MIB = 1 << 20


@pytest.fixture(autouse=True)
def _clean(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in settings.VARIABLES:
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize("bad", [-1, 0, float("nan"), 1.5, "abc", True, False, [1 << 30]])
def test_a_bad_gpu_memory_is_refused_by_save_and_load_on_any_machine(bad: Any, tmp_path: Path) -> None:
    """The manager and the DCP writer refused these; ``save``, ``load`` and ``open`` took them
    silently where no GPU runs."""
    message = rf"gpu_memory must be a number of bytes above 0 \(an int\) or None, got {re.escape(repr(bad))}$"
    blob = save_bytes({"w": torch.ones(4)})
    with pytest.raises(UsageError, match=message):
        ckptzip.save({"w": torch.ones(4)}, tmp_path / "x.ckz", gpu_memory=bad)
    assert not (tmp_path / "x.ckz").exists()
    with pytest.raises(UsageError, match=message):
        ckptzip.load(blob, gpu_memory=bad)
    with pytest.raises(UsageError, match=message):
        ckptzip.open(blob, gpu_memory=bad)


def test_gpu_memory_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    assert settings.gpu_memory(None) is None
    assert settings.gpu_memory(5 << 30) == 5 << 30
    monkeypatch.setenv(settings.GPU_MEMORY_MB, " 300 ")
    assert settings.gpu_memory(None) == 300 * MIB
    assert settings.gpu_memory(1 << 30) == 1 << 30  # the argument wins
    monkeypatch.setenv(settings.GPU_MEMORY_MB, "")
    assert settings.gpu_memory(None) is None


@pytest.mark.parametrize(("name", "value", "expected"), [
    (settings.GPU_MEMORY_MB, "5" * 5000, "a whole number of MiB above 0 from 1 to 1073741824"),
    (settings.GPU_MEMORY_MB, "0", "a whole number of MiB above 0 from 1 to 1073741824"),
    (settings.GPU_MEMORY_MB, "-5", "a whole number of MiB above 0 from 1 to 1073741824"),
    (settings.GPU_MEMORY_MB, "1.5", "a whole number of MiB above 0 from 1 to 1073741824"),
    (settings.GPU_MEMORY_MB, "١٢", "a whole number of MiB above 0 from 1 to 1073741824"),  # not ASCII digits
    (settings.THREADS, "abc", "a whole number of threads from 1 to 4096"),
    (settings.THREADS, "0", "a whole number of threads from 1 to 4096"),
    (settings.THREADS, "9" * 5000, "a whole number of threads from 1 to 4096"),
    (settings.PINNED_MB, "lots", "a whole number of MiB from 1 to 1073741824"),
    (settings.AOT_KERNELS, "no", "0 or 1 \\(or unset: 1\\)"),
    (settings.NUMPY_KERNELS, "yes", "0 or 1 \\(or unset: 0\\)"),
])
def test_a_bad_variable_says_what_was_expected(monkeypatch: pytest.MonkeyPatch, name: str, value: str,
                                               expected: str) -> None:
    monkeypatch.setenv(name, value)
    read = {settings.GPU_MEMORY_MB: lambda: settings.gpu_memory(None), settings.THREADS: settings.threads,
            settings.PINNED_MB: settings.pinned_bytes, settings.AOT_KERNELS: settings.aot_kernels,
            settings.NUMPY_KERNELS: settings.numpy_kernels}[name]
    shown = re.escape(repr(value) if len(value) <= 40 else f"{value[:40]!r}... ({len(value)} characters)")
    with pytest.raises(UsageError, match=rf"^{name}={shown}: expected {expected}$"):
        read()


def test_the_users_of_the_variables_raise_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    """``CKPTZIP_THREADS=abc`` and 5000 digits of ``CKPTZIP_GPU_MEMORY_MB`` raised raw ValueErrors."""
    from ckptzip.memory import gpu, pinned

    monkeypatch.setenv(settings.THREADS, "abc")
    with pytest.raises(UsageError, match="CKPTZIP_THREADS='abc': expected a whole number of threads"):
        cpu_threads()
    with pytest.raises(UsageError, match="CKPTZIP_THREADS='abc'"):
        ckptzip.save({"w": torch.ones(4)}, __import__("io").BytesIO())
    monkeypatch.setenv(settings.THREADS, "3")
    assert cpu_threads() == 3
    monkeypatch.setenv(settings.GPU_MEMORY_MB, "5" * 5000)
    with pytest.raises(UsageError, match="CKPTZIP_GPU_MEMORY_MB='5555"):
        gpu.cap(None)
    with pytest.raises(UsageError, match="CKPTZIP_GPU_MEMORY_MB='5555"):
        ckptzip.load(save_bytes({"w": torch.ones(4)}))
    monkeypatch.setenv(settings.PINNED_MB, "lots")
    with pytest.raises(UsageError, match="CKPTZIP_PINNED_MB='lots'"):
        pinned.PinnedPool()
    monkeypatch.setenv(settings.PINNED_MB, "256")
    assert pinned.PinnedPool().count == 4  # 64 MiB buffers


def test_switches_and_paths(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert settings.aot_kernels() and not settings.numpy_kernels()
    monkeypatch.setenv(settings.AOT_KERNELS, "0")
    monkeypatch.setenv(settings.NUMPY_KERNELS, "1")
    assert not settings.aot_kernels() and settings.numpy_kernels()
    assert settings.library(settings.NVCOMP_LIB) is None
    monkeypatch.setenv(settings.NVCOMP_LIB, str(tmp_path / "libnvcomp.so.6"))
    assert settings.library(settings.NVCOMP_LIB) == str(tmp_path / "libnvcomp.so.6")
    monkeypatch.setenv(settings.CACHE_DIR, "")
    assert settings.cache_dir() is None
    monkeypatch.setenv(settings.CACHE_DIR, str(tmp_path))
    assert settings.cache_dir() == tmp_path
    monkeypatch.delenv(settings.CACHE_DIR)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert settings.cache_dir() == tmp_path / "xdg" / "ckptzip"


# Other programs' variables the library reads or sets: Triton's (its interpreter; no line information,
# which would put the build's absolute path in the shipped kernels), the XDG cache root, and
# the launchers' counts of the ranks on this host (torchrun's, Open MPI's, MPICH's, Slurm's: each
# rank's coding process takes its share of the cores, and its snapshots of the host's memory).
OTHER_PROGRAMS = ("TRITON_INTERPRET", "TRITON_DISABLE_LINE_INFO", "XDG_CACHE_HOME", "LOCAL_WORLD_SIZE",
                  "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "SLURM_NTASKS_PER_NODE")


def test_only_the_settings_module_reads_ckptzips_variables() -> None:
    """One reader: every ``CKPTZIP_`` name in the library is in ckptzip/settings.py's code (others
    may name them in docstrings and messages), and every ``os.environ`` read elsewhere is of another
    program's variable."""
    reads = re.compile(r"(?:os\.environ(?:\.get)?[\[(]|os\.getenv\()\s*(\"[^\"]*\"|'[^']*'|\w+)")
    for path in sorted((ROOT / "src" / "ckptzip").rglob("*.py")):
        if path.name == "settings.py":
            continue
        for match in reads.finditer(path.read_text()):
            assert match.group(1).strip("'\"") in OTHER_PROGRAMS, (path, match.group(0))
        for line in path.read_text().splitlines():
            code = line.split("#")[0]
            if re.search(r"=\s*[\"']CKPTZIP_", code):
                pytest.fail(f"{path.relative_to(ROOT)} names a variable of its own: {line.strip()}")


def test_every_variable_is_in_the_table_of_docs_environment() -> None:
    text = (ROOT / "docs" / "ENVIRONMENT.md").read_text()
    rows = re.findall(r"^\| `(CKPTZIP_\w+)` \|", text, re.MULTILINE)
    assert rows == list(settings.VARIABLES)
