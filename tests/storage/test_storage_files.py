"""File handling hardening (issue #13): safe replacement, reads of special files, file URLs,
stale temporaries, step names, the one-writer lock, store errors."""

from __future__ import annotations

import contextlib
import errno
import io
import os
import signal
import socket
import stat
import subprocess
import sys
import textwrap
import threading
import uuid
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import assert_same

import ckptzip
from ckptzip.storage import files
from ckptzip.errors import CheckpointNotFoundError, CheckpointWriteError, UnsupportedObjectError
from ckptzip.manager import CheckpointManager, IgnoredFileWarning
from ckptzip.storage import LOCK_NAME, open_directory, open_storage

STATE = {"w": torch.arange(6, dtype=torch.float32), "step": 1}
SRC = str(Path(__file__).resolve().parents[2] / "src")


def _child(code: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)], stdout=subprocess.PIPE, text=True, env=env
    )


def _kill(proc: subprocess.Popen[str]) -> None:
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)


# --- safe file replacement ---------------------------------------------------------------------


def test_saving_to_a_symlink_replaces_its_target_and_keeps_the_link(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    target = tmp_path / "real" / "ckpt.ckz"
    target.write_bytes(b"old")
    link = tmp_path / "latest.ckz"
    link.symlink_to(target)
    ckptzip.save(STATE, link)
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert_same(ckptzip.load(target), STATE)
    assert sorted(os.listdir(tmp_path / "real")) == ["ckpt.ckz"]  # the temporary was beside the target


@pytest.mark.parametrize("kind", ["fifo", "device", "directory"])
def test_non_regular_targets_are_refused_and_left_alone(tmp_path: Path, kind: str) -> None:
    if kind == "fifo":
        path, what = tmp_path / "pipe", "a FIFO"
        os.mkfifo(path)
    elif kind == "device":
        path, what = Path(os.devnull), "a character device"
    else:
        path, what = tmp_path / "dir", "a directory"
        path.mkdir()
    before = os.stat(path)
    with pytest.raises(CheckpointWriteError, match=rf"could not write checkpoint '{path}': Is {what}; .*regular files"):
        ckptzip.save(STATE, path)
    after = os.stat(path)
    assert (after.st_ino, after.st_mode) == (before.st_ino, before.st_mode)


def test_a_replaced_file_keeps_its_mode_and_a_new_file_gets_the_default(tmp_path: Path) -> None:
    private = tmp_path / "private.ckz"
    private.write_bytes(b"old")
    private.chmod(0o600)
    ckptzip.save(STATE, private)
    assert stat.S_IMODE(private.stat().st_mode) == 0o600
    umask = os.umask(0o022)
    try:
        ckptzip.save(STATE, tmp_path / "new.ckz")
    finally:
        os.umask(umask)
    assert stat.S_IMODE((tmp_path / "new.ckz").stat().st_mode) == 0o644


def test_a_246_character_name_saves(tmp_path: Path) -> None:
    path = tmp_path / ("c" * 242 + ".ckz")
    ckptzip.save(STATE, path)
    assert_same(ckptzip.load(path), STATE)
    assert os.listdir(tmp_path) == [path.name]


def test_failed_cleanup_never_hides_the_first_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def unlink(self: Path, missing_ok: bool = False) -> None:
        raise PermissionError(errno.EACCES, "cleanup refused")

    monkeypatch.setattr(Path, "unlink", unlink)
    with pytest.raises(UnsupportedObjectError, match="at 'bad'"):
        ckptzip.save({"bad": object()}, tmp_path / "x.ckz")


def test_a_failed_directory_sync_after_the_rename_says_the_file_is_there(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def fail(directory: Path) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(files, "fsync_dir", fail)
    path = tmp_path / "x.ckz"
    with pytest.raises(CheckpointWriteError, match="was written and renamed into place, but syncing its directory failed"):
        ckptzip.save(STATE, path)
    monkeypatch.undo()
    assert_same(ckptzip.load(path), STATE)


def test_save_removes_temporaries_a_killed_save_of_the_same_target_left(tmp_path: Path) -> None:
    target = tmp_path / "model.ckz"
    proc = _child(
        f"""
        import time
        from ckptzip.storage import atomic_file
        with atomic_file({str(target)!r}) as f:
            f.write(b"partial")
            print("writing", flush=True)
            time.sleep(120)
        """
    )
    assert proc.stdout is not None and proc.stdout.readline() == "writing\n"
    _kill(proc)
    (leftover,) = os.listdir(tmp_path)
    assert leftover.startswith(".ckz-") and leftover.endswith(f"-{proc.pid}-{leftover[-12:-4]}.tmp")
    other = tmp_path / leftover.replace(files._hash8("model.ckz"), files._hash8("other.ckz"))
    other.write_bytes(b"another target's")
    mine = tmp_path / files.temp_name("model.ckz")  # a live writer: this process
    mine.write_bytes(b"in flight")
    ckptzip.save(STATE, target)
    assert sorted(os.listdir(tmp_path)) == sorted(["model.ckz", other.name, mine.name])


# --- reading special files, file URLs ------------------------------------------------------------


@pytest.mark.parametrize("kind", ["fifo", "device"])
def test_load_refuses_non_regular_files_without_blocking(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "pipe" if kind == "fifo" else Path(os.devnull)
    if kind == "fifo":
        os.mkfifo(path)
    what = "a FIFO" if kind == "fifo" else "a character device"
    result: list[BaseException] = []

    def load() -> None:
        try:
            ckptzip.load(path)
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            result.append(exc)

    thread = threading.Thread(target=load, daemon=True)
    thread.start()
    thread.join(timeout=20)
    assert not thread.is_alive(), "ckptzip.load blocked"
    (error,) = result
    assert isinstance(error, CheckpointNotFoundError)
    assert f"no checkpoint at '{path}': the path is {what}, not a checkpoint file" in str(error)


@pytest.mark.parametrize("prefix", ["file://localhost", "file://"])
def test_file_urls_name_absolute_paths(tmp_path: Path, prefix: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "abs" / "run dir"
    url = prefix + str(run).replace(" ", "%20")
    with CheckpointManager(url) as manager:
        manager.save(1, STATE)
    assert os.listdir(run) == ["step_00000001.ckz"]
    assert sorted(os.listdir(tmp_path)) == ["abs"]  # nothing under the working directory
    assert open_directory(url).exists("step_00000001.ckz")


def test_a_file_url_of_another_host_is_refused() -> None:
    with pytest.raises(ValueError, match="names host 'server'; a file URL is local"):
        open_storage("file://server/share/run")


# --- manager: step names, a file as directory ----------------------------------------------------


def test_only_canonical_step_names_are_checkpoints(tmp_path: Path) -> None:
    ckptzip.save(STATE, tmp_path / "step_00000100.ckz")
    ckptzip.save({"other": 1}, tmp_path / "step_000000100.ckz")
    ckptzip.save(STATE, tmp_path / "step_123456789.ckz")
    with pytest.warns(IgnoredFileWarning, match=r"ignoring 1 file\(s\) in .* named like checkpoints .*: "
                                                r"'step_000000100.ckz'$"):
        manager = CheckpointManager(tmp_path)
    assert manager.all_steps() == [100, 123456789]
    assert_same(manager.restore(100), STATE)


ODD_NAMES = ["step_\u0660\u0660\u0660\u0660\u0660\u0669\u0669\u0669.ckz",  # Arabic-Indic digits: \d takes them
             "step_\uff10\uff10\uff10\uff10\uff10\uff19\uff19\uff19.ckz",  # fullwidth digits
             "step_999.ckz", "step_+0000999.ckz", "step_ 0000999.ckz", "step_0000999 .ckz"]


def test_names_that_are_not_canonical_ascii_steps_are_ignored_and_reported_once(tmp_path: Path) -> None:
    for odd in [*ODD_NAMES, "step_00000999.ckz\n"]:  # the last is not even named like a checkpoint: not reported
        ckptzip.save({"odd": 1}, tmp_path / odd)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        manager = CheckpointManager(tmp_path)
        assert manager.all_steps() == [] and manager.should_save(300, every=100)
        manager.save(300, STATE).result()
        manager.close()
        assert manager.all_steps() == [300]
    assert [(w.category, str(w.message).split(":")[0]) for w in caught] == [
        (IgnoredFileWarning, f"ignoring {len(ODD_NAMES)} file(s) in {tmp_path} named like checkpoints but not as a "
                             "CheckpointManager names them (step_ and 8 or more ASCII digits, no leading zero beyond "
                             "eight, .ckz)")]
    assert set(ODD_NAMES) | {"step_00000999.ckz\n"} <= set(os.listdir(tmp_path))  # ignored, never deleted


def test_a_manager_on_a_file_fails_at_construction(tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(b"x")
    with pytest.raises(CheckpointWriteError, match=r"'.*f' is a file, not a directory; checkpoints are kept in a directory"):
        CheckpointManager(tmp_path / "f")


# --- manager: one writer per directory -----------------------------------------------------------


def test_a_second_writer_in_this_process_is_refused_until_the_first_closes(tmp_path: Path) -> None:
    first, second = CheckpointManager(tmp_path), CheckpointManager(tmp_path)
    first.save(1, STATE).result()
    message = rf"being written by another CheckpointManager \(pid {os.getpid()} on host '{socket.gethostname()}'"
    with pytest.raises(CheckpointWriteError, match=message):
        second.save(2, STATE)
    assert CheckpointManager(tmp_path).all_steps() == [1]  # readers need no lock
    assert_same(CheckpointManager(tmp_path).restore(), STATE)
    first.close()
    assert LOCK_NAME not in os.listdir(tmp_path)  # released and removed
    second.save(2, STATE).result()
    second.close()
    assert second.all_steps() == [1, 2]


def test_a_writer_in_another_process_holds_the_lock_until_it_dies(tmp_path: Path) -> None:
    proc = _child(
        f"""
        import time
        from ckptzip.manager import CheckpointManager, IgnoredFileWarning
        manager = CheckpointManager({str(tmp_path)!r})
        manager.save(1, {{"step": 1}}).result()
        print("saved", flush=True)
        time.sleep(120)
        """
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "saved\n"
        with CheckpointManager(tmp_path) as manager, pytest.raises(CheckpointWriteError, match=f"pid {proc.pid} on host"):
            manager.save(2, STATE)
    finally:
        _kill(proc)
    assert LOCK_NAME in os.listdir(tmp_path)  # a killed writer leaves its file, but not its lock
    with CheckpointManager(tmp_path) as manager:
        manager.save(2, STATE).result()
    assert sorted(os.listdir(tmp_path)) == ["step_00000001.ckz", "step_00000002.ckz"]


# --- S3 (moto): the lock marker, store errors ----------------------------------------------------

s3fs = pytest.importorskip("s3fs")
moto_server = pytest.importorskip("moto.server")


@pytest.fixture
def moto() -> Iterator[tuple[Any, dict[str, Any], str]]:
    """A moto server of its own (some tests stop it), its options and a fresh bucket's URL."""
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    options = {
        "key": "testing",
        "secret": "testing",
        "endpoint_url": f"http://{host}:{port}",
        "config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 2},
    }
    bucket = f"ckptzip-hardening-{uuid.uuid4().hex[:12]}"  # moto's backend is shared by its servers
    s3fs.S3FileSystem(**options).mkdir(bucket)
    yield server, options, f"s3://{bucket}/run"
    with contextlib.suppress(Exception):  # some tests stop it themselves
        server.stop()


def test_s3_lock_marker_refuses_a_second_writer_and_is_removed_on_close(moto: tuple[Any, dict[str, Any], str]) -> None:
    _, options, url = moto
    first = CheckpointManager(url, storage_options=options)
    first.save(1, STATE).result()
    second = CheckpointManager(url, storage_options=options)
    message = rf"pid {os.getpid()} on host .*, last heartbeat \d+ s ago\)\. .*delete {url}/\.ckptzip\.lock and retry"
    with pytest.raises(CheckpointWriteError, match=message):
        second.save(2, STATE)
    assert_same(CheckpointManager(url, storage_options=options).restore(), STATE)
    first.close()
    assert not s3fs.S3FileSystem(**options).exists(f"{url}/{LOCK_NAME}")
    second.save(2, STATE).result()
    second.close()
    assert second.all_steps() == [1, 2]


def test_s3_writer_that_lost_its_lock_stops_writing(moto: tuple[Any, dict[str, Any], str]) -> None:
    _, options, url = moto
    stale = CheckpointManager(url, storage_options=options, async_save=False)
    stale.save(1, STATE)
    s3fs.S3FileSystem(**options).rm_file(f"{url}/{LOCK_NAME}")  # what the docs say to do for a dead writer
    with CheckpointManager(url, storage_options=options) as taker:
        taker.save(2, STATE).result()
        with pytest.raises(CheckpointWriteError, match="no longer holds the lock"):
            stale.save(3, STATE)
    assert taker.all_steps() == [1, 2]


def test_store_failures_are_checkpoint_write_errors_with_the_cause(moto: tuple[Any, dict[str, Any], str]) -> None:
    server, options, url = moto
    manager = CheckpointManager(url, storage_options=options)
    manager.save(1, STATE).result()
    direct = open_storage(url, options)
    server.stop()
    future = manager.save(2, STATE)
    error = future.exception(timeout=120)
    assert isinstance(error, CheckpointWriteError) and "EndpointConnectionError" in str(error)
    assert type(error.__cause__).__name__ == "EndpointConnectionError"
    with pytest.raises(CheckpointWriteError, match=r"could not write checkpoint .*/x\.ckz: storage .* failed: Endpoint") as info:
        direct.write("x.ckz", lambda f: f.write(io.BytesIO(b"data").getvalue()))
    assert type(info.value.__cause__).__name__ == "EndpointConnectionError"
    with pytest.raises(CheckpointWriteError):
        manager.close()


# --- the lock file: a regular file only, never followed --------------------------------------------


def _lock_path(tmp_path: Path) -> Path:
    tmp_path.mkdir(exist_ok=True)
    return tmp_path / LOCK_NAME


@pytest.mark.parametrize("dangling", [False, True])
def test_a_symlinked_lock_file_is_refused_and_its_target_left_alone(tmp_path: Path, dangling: bool) -> None:
    run, outside = tmp_path / "run", tmp_path / "outside.txt"
    if not dangling:
        outside.write_bytes(b"precious")
    _lock_path(run).symlink_to(outside)
    with CheckpointManager(run) as manager, pytest.raises(
        CheckpointWriteError, match=rf"the lock file '{run / LOCK_NAME}' of '{run}' is a symbolic link; a lock file "
                                    "is never followed. Remove the link and retry"):
        manager.save(1, STATE)
    assert (outside.read_bytes() == b"precious") if not dangling else not outside.exists()
    assert os.path.islink(run / LOCK_NAME) and os.listdir(run) == [LOCK_NAME]


@pytest.mark.parametrize("kind", ["fifo", "directory", "socket"])
def test_a_special_file_as_lock_file_is_refused_without_blocking(tmp_path: Path, kind: str) -> None:
    path = _lock_path(tmp_path / "run")
    holder = None
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    else:
        holder = socket.socket(socket.AF_UNIX)
        holder.bind(str(path))
    try:
        with CheckpointManager(path.parent) as manager, pytest.raises(CheckpointWriteError) as caught:
            manager.save(1, STATE)  # a FIFO opened for reading and writing would not block, but is refused
    finally:
        if holder is not None:
            holder.close()
    assert isinstance(caught.value, CheckpointWriteError) and f"the lock file '{path}'" in str(caught.value)
    expected = {"fifo": "is not a regular file (a FIFO); remove it and retry",
                "directory": "cannot be opened: Is a directory",
                "socket": "cannot be opened: No such device or address"}[kind]
    assert expected in str(caught.value)
    assert CheckpointManager(path.parent).all_steps() == []


def test_lock_failures_other_than_a_second_writer_name_the_lock_file(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    import fcntl

    def no_locks(fd: int, operation: int) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    with CheckpointManager(tmp_path) as manager, pytest.raises(
        CheckpointWriteError, match=rf"\[Errno {errno.ENOLCK}\] the lock file '{tmp_path / LOCK_NAME}' of "
                                    rf"'{tmp_path}' cannot be locked: No locks available"):
        manager.save(1, STATE)
