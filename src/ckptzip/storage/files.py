"""Local files: atomic replacement (temporary file, fsync, rename, fsync of the directory),
reads that never block on special files, and the paths of ``file:`` URLs."""

from __future__ import annotations

import contextlib
import errno
import io
import os
import re
import socket
import stat
import urllib.parse
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

import xxhash

from ..errors import CheckpointNotFoundError, CheckpointWriteError, CkptzipError

# Temporary names of atomic_file: ".ckz-<host>-<target>-<pid>-<random>.tmp", where <host> and
# <target> are 8 hex digits of XXH3-64 of the host name and of the target's file name. Short, so
# a target of any legal name length can be saved; <host>, <target> and <pid> let a later save
# remove leftovers of a killed writer.
_TEMP = re.compile(r"\.ckz-(?P<host>[0-9a-f]{8})-(?P<target>[0-9a-f]{8})-(?P<pid>\d+)-[0-9a-f]{8}\.tmp")
# Temporary names of earlier ckptzip releases: ".<name>.tmp-<pid>-<hex>"; leftovers are still recognised.
LEGACY_TEMP = re.compile(r"\.(?P<target>.+?)\.tmp-\d+-[0-9a-f]+")


def write_error(message: str, code: int | None = None) -> CheckpointWriteError:
    """The one way a ``CheckpointWriteError`` is built: with the ``errno`` of its cause where it
    has one (``str`` then reads ``[Errno N] message``), else with the message alone."""
    return CheckpointWriteError(message) if code is None else CheckpointWriteError(code, message)


def _hash8(text: str) -> str:
    return xxhash.xxh3_64_hexdigest(text.encode("utf-8", "surrogateescape"))[:8]


def host_hash() -> str:
    """8 hex digits naming this host in temporary names."""
    return _hash8(socket.gethostname())


def temp_name(target: str) -> str:
    return f".ckz-{host_hash()}-{_hash8(target)}-{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp"


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: it exists, owned by someone else
        return True
    return True


def is_stale_temporary(name: str, host: str, target: str | None = None) -> bool:
    """Whether ``name`` is a temporary of :func:`atomic_file` left by a dead process on the host
    whose hash is ``host`` (and, given ``target``'s file name, one meant to become it)."""
    temp = _TEMP.fullmatch(name)
    return bool(
        temp
        and temp["host"] == host
        and (target is None or temp["target"] == _hash8(target))
        and not _pid_alive(int(temp["pid"]))
    )


def remove_stale_temporaries(path: str | os.PathLike[str]) -> None:
    """Delete temporaries that a killed :func:`atomic_file` left beside ``path`` (same host, dead
    owner). Errors are ignored: this is tidying."""
    path = Path(path)
    host = host_hash()
    with contextlib.suppress(OSError):
        for entry in os.scandir(path.parent):
            if is_stale_temporary(entry.name, host, path.name):
                with contextlib.suppress(OSError):
                    os.unlink(entry.path)


def fsync_dir(directory: Path) -> None:
    """Make a rename in ``directory`` durable."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def file_kind(mode: int) -> str:
    """What a non-regular file is, completing "the path is ..."."""
    kinds = (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    )
    return next((name for test, name in kinds if test(mode)), "not a regular file")


def _replace_target(path: Path) -> tuple[Path, int | None]:
    """The file a save to ``path`` replaces (a symlink's target) and its permission bits, or
    ``None`` for a new file. Raises ``CheckpointWriteError`` for anything but a regular file."""
    target = Path(os.path.realpath(path)) if path.is_symlink() else path
    try:
        st = os.stat(target)
    except FileNotFoundError:
        return target, None
    except OSError as exc:
        raise write_error(write_failure(path, exc, renamed=False), exc.errno) from exc
    if not stat.S_ISREG(st.st_mode):
        raise write_error(
            f"could not write checkpoint {str(path)!r}: Is {file_kind(st.st_mode)}; ckptzip only creates or replaces "
            "regular files. Nothing was written; choose another path",
            errno.EINVAL,
        )
    return target, stat.S_IMODE(st.st_mode)


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike[str], *, sync: bool = True) -> Iterator[BinaryIO]:
    """Open a short-named temporary file beside ``path``; on success fsync it, rename it over
    ``path``, fsync the directory. On failure remove it, so ``path`` keeps what it held before.

    A symlink is followed: its target file is replaced and the link stays. A replaced file keeps
    its permission bits; a new one gets the default mode. Anything but a regular file (directory,
    FIFO, device) is refused with ``CheckpointWriteError``. Temporaries that a killed save of the
    same target on this host left are removed first. ``sync=False`` skips both fsyncs (the
    replacement is still atomic, but may not survive a power loss).
    """
    path = Path(path)
    target, mode = _replace_target(path)
    remove_stale_temporaries(target)
    tmp = target.with_name(temp_name(target.name))
    renamed = False
    try:
        with io.open(tmp, "xb") as f:  # noqa: UP020 - io.open, which tests patch to fill the disk
            if mode is not None:
                os.fchmod(f.fileno(), mode)
            yield f
            f.flush()
            if sync:
                os.fsync(f.fileno())
        os.replace(tmp, target)
        renamed = True
        if sync:
            fsync_dir(target.parent)
    except BaseException as exc:
        if not renamed:
            with contextlib.suppress(OSError):  # never hide the error that got us here
                tmp.unlink()
        if isinstance(exc, OSError) and not isinstance(exc, CkptzipError):
            raise write_error(write_failure(path, exc, renamed), exc.errno) from exc
        raise


def write_failure(path: Path, exc: OSError, renamed: bool) -> str:
    reason = exc.strerror or str(exc)
    if renamed:
        return (
            f"checkpoint {str(path)!r} was written and renamed into place, but syncing its directory failed: "
            f"{reason}. The new file is there; it may not survive a power loss until the directory is synced"
        )
    return (
        f"could not write checkpoint {str(path)!r}: {reason}. Nothing was written under that name; any previous "
        "file there is untouched"
    )


def open_for_read(path: str | os.PathLike[str]) -> BinaryIO:
    """Open ``path`` for reading if it is a regular file; never blocks on a FIFO or device.

    Raises :class:`~ckptzip.errors.CheckpointNotFoundError` when it is missing or not a regular file.
    """
    name = os.fspath(path)
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except (FileNotFoundError, IsADirectoryError) as exc:
        what = "a directory, not a checkpoint file" if isinstance(exc, IsADirectoryError) else "missing"
        raise CheckpointNotFoundError(f"no checkpoint at {name!r}: the path is {what}") from exc
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise CheckpointNotFoundError(
            f"no checkpoint at {name!r}: the path is {file_kind(mode)}, not a checkpoint file"
        )
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


def read_small(path: str | os.PathLike[str], limit: int) -> bytes:
    """The content of ``path`` if it is a regular file of at most ``limit`` bytes: opened without
    following a symbolic link at the path (``ELOOP``) or blocking on a FIFO or device, and read no
    further than ``limit + 1`` bytes whatever the file claims. Anything else raises ``OSError``."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, f"{os.fspath(path)!r} is {file_kind(st.st_mode)}, not a regular file")
        data = b""
        while len(data) <= limit and (more := os.read(fd, limit + 1 - len(data))):
            data += more
    finally:
        os.close(fd)
    if len(data) > limit:
        raise OSError(errno.EFBIG, f"{os.fspath(path)!r} holds more than {limit} bytes")
    return data


def file_url_path(url: str) -> str:
    """The local path of a ``file:`` URL (host empty or ``localhost``), percent-decoded."""
    parts = urllib.parse.urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise ValueError(
            f"{url!r} names host {parts.netloc!r}; a file URL is local (file:///abs/path or "
            "file://localhost/abs/path). Use a mounted path or an fsspec URL of the remote store"
        )
    return urllib.parse.unquote(parts.path)
