"""Triton's cache key remembered across processes (kernels/_triton_key.py), against a stand-in
Triton: computed once and kept, found again by the next process, recomputed when the install
changes or the kept file is not a key, and never in the way when nothing can be written."""

from __future__ import annotations

import os
import threading
import types
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers import STAND_IN_TRITON_KEY, stand_in_triton

from ckptzip import settings
from ckptzip.kernels import _triton_key


@pytest.fixture
def triton(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> types.SimpleNamespace:
    monkeypatch.setenv(_triton_key.ENV, str(tmp_path / "cache"))
    return stand_in_triton(tmp_path / "triton", monkeypatch)


def _next_process(triton: types.SimpleNamespace) -> None:
    triton.cache.triton_key = triton.compute  # a new process's Triton, before ckptzip hands it the key


def test_the_key_is_computed_once_and_found_again_by_the_next_process(triton: types.SimpleNamespace) -> None:
    kept = _triton_key.install()
    assert kept is not None and kept.read_text() == STAND_IN_TRITON_KEY
    assert triton.calls == [1]
    assert triton.cache.triton_key() == STAND_IN_TRITON_KEY
    _next_process(triton)
    assert _triton_key.install() == kept
    assert triton.calls == [1]  # read back, not hashed again
    assert triton.cache.triton_key() == STAND_IN_TRITON_KEY


def test_a_changed_install_gets_its_key_computed_again(triton: types.SimpleNamespace) -> None:
    _triton_key.install()
    library = triton.root / "_C" / "libtriton.so"
    library.write_bytes(b"\1" * 65)  # reinstalled: another size and time
    _next_process(triton)
    _triton_key.install()
    assert triton.calls == [1, 1]


def test_a_kept_file_that_is_not_a_key_of_this_version_is_replaced(triton: types.SimpleNamespace) -> None:
    _triton_key.install()
    (kept,) = (Path(os.environ[_triton_key.ENV])).iterdir()
    kept.write_text("garbage")
    _next_process(triton)
    _triton_key.install()
    assert triton.calls == [1, 1]
    assert kept.read_text() == STAND_IN_TRITON_KEY


def test_nothing_is_remembered_where_it_is_turned_off_or_cannot_be_written(
        triton: types.SimpleNamespace, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(_triton_key.ENV, "")
    assert _triton_key.install() is None
    assert triton.calls == [1] and triton.cache.triton_key is triton.compute  # Triton's own, already run
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv(_triton_key.ENV, str(blocker / "cache"))  # under a file: mkdir fails
    assert _triton_key.install() is None
    assert triton.calls == [1, 1]
    assert triton.cache.triton_key() == STAND_IN_TRITON_KEY


def test_the_cache_folder_follows_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(_triton_key.ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert settings.cache_dir() == tmp_path / "ckptzip"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert settings.cache_dir() == Path(os.path.expanduser("~")) / ".cache" / "ckptzip"
    monkeypatch.setenv(_triton_key.ENV, "  ")
    assert settings.cache_dir() is None


def _in_thread(call: Callable[[], object]) -> object:
    """``call()`` on a thread; a call that would block for good fails the test instead of hanging it."""
    result: list[object] = []
    worker = threading.Thread(target=lambda: result.append(call()), daemon=True)
    worker.start()
    worker.join(60)
    assert not worker.is_alive(), "blocked"
    return result[0]


@pytest.mark.parametrize("kind", ["fifo", "symlink to /dev/zero", "symlink to a key", "too large", "directory"])
def test_a_kept_file_that_is_not_a_small_regular_file_is_never_read(
        triton: types.SimpleNamespace, tmp_path: Path, kind: str) -> None:
    """A FIFO in CKPTZIP_CACHE_DIR made ``ckptzip warmup`` hang, and a key file that was /dev/zero
    was read without bound (MemoryError): the key file is opened without following a link or
    blocking, and read only if it is a regular file of a key's size."""
    kept = _triton_key.install()
    assert kept is not None
    kept.unlink()
    if kind == "fifo":
        os.mkfifo(kept)
    elif kind == "symlink to /dev/zero":
        kept.symlink_to("/dev/zero")
    elif kind == "symlink to a key":
        (tmp_path / "elsewhere").write_text(STAND_IN_TRITON_KEY)
        kept.symlink_to(tmp_path / "elsewhere")
    elif kind == "too large":
        kept.write_text(STAND_IN_TRITON_KEY + "x" * (1 << 20))
    else:
        kept.mkdir()
    _next_process(triton)
    result = _in_thread(_triton_key.install)
    assert triton.calls == [1, 1]  # computed again, as where no key was kept
    assert triton.cache.triton_key() == STAND_IN_TRITON_KEY
    if kind != "directory":  # a directory cannot be replaced by a file
        assert result == kept and not kept.is_symlink() and kept.read_text() == STAND_IN_TRITON_KEY
