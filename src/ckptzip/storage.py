"""Where a :class:`~ckptzip.manager.CheckpointManager` keeps its files: a local directory or an
fsspec URL, each with an atomic way to make a finished file visible and a lock for its one writer.

A local directory commits by rename (:func:`atomic_file`: temporary file, fsync, ``os.replace``,
fsync of the directory). Object stores have no atomic rename, so a file there is committed by a
small JSON *commit marker* ``<name>.commit`` written after the data; a file without its marker is
a leftover of an interrupted write and is never listed as committed.

This module is the bottom floor of ckptzip's file handling: it imports no other ckptzip module
that writes files.
"""

from __future__ import annotations

import abc
import contextlib
import errno
import fcntl
import io
import json
import os
import re
import socket
import stat
import time
import urllib.parse
import uuid
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import xxhash

from .checksum import xxh3_hex
from .errors import (
    CheckpointNotFoundError,
    CheckpointWriteError,
    CkptzipError,
    CorruptCheckpointError,
    StorageUnavailableError,
)

COMMIT_SUFFIX = ".commit"
LOCK_NAME = ".ckptzip.lock"
_MARKER_FORMAT = "ckptzip-commit"
_MARKER_VERSION = 1
# Temporary names of atomic_file: ".ckz-<host>-<target>-<pid>-<random>.tmp", where <host> and
# <target> are 8 hex digits of XXH3-64 of the host name and of the target's file name. Short, so
# a target of any legal name length can be saved; <host>, <target> and <pid> let a later save
# remove leftovers of a killed writer.
_TEMP = re.compile(r"\.ckz-(?P<host>[0-9a-f]{8})-(?P<target>[0-9a-f]{8})-(?P<pid>\d+)-[0-9a-f]{8}\.tmp")
# Temporary names of earlier ckptzip releases: ".<name>.tmp-<pid>-<hex>"; leftovers are still recognised.
_LEGACY_TEMP = re.compile(r"\.(?P<target>.+?)\.tmp-\d+-[0-9a-f]+")
# Protocols whose fsspec implementation ships in an extra of ckptzip.
_EXTRAS = {"s3": "s3", "s3a": "s3"}


def _hash8(text: str) -> str:
    return xxhash.xxh3_64_hexdigest(text.encode("utf-8", "surrogateescape"))[:8]


def _host() -> str:
    return socket.gethostname()


def _temp_name(target: str) -> str:
    return f".ckz-{_hash8(_host())}-{_hash8(target)}-{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp"


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


def _stale_temp(name: str, host: str, target: str | None = None) -> bool:
    """Whether ``name`` is a temporary of :func:`atomic_file` left by a dead process on the host
    whose :func:`_hash8` is ``host`` (and, given ``target``'s hash, one meant to become it)."""
    temp = _TEMP.fullmatch(name)
    return bool(
        temp
        and temp["host"] == host
        and (target is None or temp["target"] == target)
        and not _pid_alive(int(temp["pid"]))
    )


def remove_stale_temporaries(path: str | os.PathLike[str]) -> None:
    """Delete temporaries that a killed :func:`atomic_file` left beside ``path`` (same host, dead
    owner). Errors are ignored: this is tidying."""
    path = Path(path)
    host, target = _hash8(_host()), _hash8(path.name)
    with contextlib.suppress(OSError):
        for entry in os.scandir(path.parent):
            if _stale_temp(entry.name, host, target):
                with contextlib.suppress(OSError):
                    os.unlink(entry.path)


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _kind(mode: int) -> str:
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
        raise CheckpointWriteError(exc.errno, _write_failure(path, exc, renamed=False)) from exc
    if not stat.S_ISREG(st.st_mode):
        raise CheckpointWriteError(
            errno.EINVAL,
            f"could not write checkpoint {str(path)!r}: Is {_kind(st.st_mode)}; ckptzip only creates or replaces "
            "regular files. Nothing was written; choose another path",
        )
    return target, stat.S_IMODE(st.st_mode)


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike[str]) -> Iterator[BinaryIO]:
    """Open a short-named temporary file beside ``path``; on success fsync it, rename it over
    ``path``, fsync the directory. On failure remove it, so ``path`` keeps what it held before.

    A symlink is followed: its target file is replaced and the link stays. A replaced file keeps
    its permission bits; a new one gets the default mode. Anything but a regular file (directory,
    FIFO, device) is refused with ``CheckpointWriteError``. Temporaries that a killed save of the
    same target on this host left are removed first.
    """
    path = Path(path)
    target, mode = _replace_target(path)
    remove_stale_temporaries(target)
    tmp = target.with_name(_temp_name(target.name))
    renamed = False
    try:
        with io.open(tmp, "xb") as f:
            if mode is not None:
                os.fchmod(f.fileno(), mode)
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
        renamed = True
        _fsync_dir(target.parent)
    except BaseException as exc:
        if not renamed:
            with contextlib.suppress(OSError):  # never hide the error that got us here
                tmp.unlink()
        if isinstance(exc, OSError) and not isinstance(exc, CkptzipError):
            raise CheckpointWriteError(exc.errno, _write_failure(path, exc, renamed)) from exc
        raise


def _write_failure(path: Path, exc: OSError, renamed: bool) -> str:
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
        raise CheckpointNotFoundError(f"no checkpoint at {name!r}: the path is {_kind(mode)}, not a checkpoint file")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


def file_url_path(url: str) -> str:
    """The local path of a ``file:`` URL (host empty or ``localhost``), percent-decoded."""
    parts = urllib.parse.urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise ValueError(
            f"{url!r} names host {parts.netloc!r}; a file URL is local (file:///abs/path or "
            "file://localhost/abs/path). Use a mounted path or an fsspec URL of the remote store"
        )
    return urllib.parse.unquote(parts.path)


@dataclass(frozen=True)
class Listing:
    """Names in a storage location that match a pattern, split by state."""

    committed: list[str]
    partial: list[str]  # leftovers of interrupted writes, never committed


class WriterLock(abc.ABC):
    """Held by the one writer of a storage location until :meth:`release`."""

    @abc.abstractmethod
    def heartbeat(self) -> None:
        """Record that the writer is alive; raise ``CheckpointWriteError`` if the lock was lost."""

    @abc.abstractmethod
    def release(self) -> None:
        """Give the lock up (idempotent)."""


def _owner() -> dict[str, Any]:
    return {"pid": os.getpid(), "host": _host(), "since": time.time(), "token": uuid.uuid4().hex}


def _describe_owner(raw: bytes) -> str:
    try:
        owner = json.loads(raw)
        text = f"pid {owner['pid']} on host {owner['host']!r}"
        if "heartbeat" in owner:
            text += f", last heartbeat {time.time() - float(owner['heartbeat']):.0f} s ago"
        return text
    except (ValueError, KeyError, TypeError):
        return "an unknown owner"


class Storage(abc.ABC):
    """A flat directory of files with atomic commits. Names are plain file names, no slashes."""

    location: str

    @abc.abstractmethod
    def list(self, pattern: re.Pattern[str]) -> Listing:
        """Committed files and write leftovers whose (intended) name fully matches ``pattern``."""

    @abc.abstractmethod
    def write(self, name: str, write: Callable[[BinaryIO], Any]) -> None:
        """Run ``write`` on a fresh file, then commit it as ``name``; on failure nothing is committed.

        Raises :class:`~ckptzip.errors.CheckpointWriteError` for I/O failures; errors raised by
        ``write`` itself propagate unchanged.
        """

    @abc.abstractmethod
    def open(self, name: str) -> BinaryIO:
        """A binary file positioned at the start of committed file ``name``.

        Raises ``FileNotFoundError`` if it is gone and
        :class:`~ckptzip.errors.CorruptCheckpointError` if it does not match its commit record.
        """

    @abc.abstractmethod
    def delete(self, name: str) -> None:
        """Remove committed file ``name`` (un-committing it first where commits are markers)."""

    @abc.abstractmethod
    def discard_partial(self, name: str) -> None:
        """Remove leftover ``name`` (from :meth:`list`), unless it has been committed since."""

    @abc.abstractmethod
    def lock(self) -> WriterLock:
        """Become the location's one writer; raise ``CheckpointWriteError`` naming the owner if
        another writer holds it."""


class LocalStorage(Storage):
    """A directory on a local (POSIX-semantics) filesystem; commits by atomic rename."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self.location = str(self.root)
        if self.root.exists() and not self.root.is_dir():
            raise CheckpointWriteError(
                errno.ENOTDIR,
                f"{self.location!r} is a file, not a directory; checkpoints are kept in a directory. Pass the "
                "path of a directory (it is created if missing)",
            )

    def list(self, pattern: re.Pattern[str]) -> Listing:
        """Committed files matching ``pattern``; as partial, earlier releases' temporaries of matching
        names and any temporary of a dead writer on this host (the lock makes this directory's
        writer the only one, and a temporary's name does not record its target)."""
        try:
            entries = list(os.scandir(self.root))
        except FileNotFoundError:
            return Listing([], [])
        committed, partial = [], []
        host = _hash8(_host())
        for entry in entries:
            legacy = _LEGACY_TEMP.fullmatch(entry.name)
            if (legacy and pattern.fullmatch(legacy["target"])) or _stale_temp(entry.name, host):
                partial.append(entry.name)
            elif pattern.fullmatch(entry.name) and entry.is_file():
                committed.append(entry.name)
        return Listing(sorted(committed), sorted(partial))

    def _mkdir(self) -> None:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise CheckpointWriteError(
                exc.errno, f"could not create checkpoint directory {self.location!r}: {exc.strerror or exc}"
            ) from exc

    def write(self, name: str, write: Callable[[BinaryIO], Any]) -> None:
        self._mkdir()
        with atomic_file(self.root / name) as f:
            write(f)

    def lock(self) -> WriterLock:
        self._mkdir()
        return _LocalLock(self.root / LOCK_NAME, self.location)

    def open(self, name: str) -> BinaryIO:
        return open(self.root / name, "rb")

    def delete(self, name: str) -> None:
        (self.root / name).unlink(missing_ok=True)

    def discard_partial(self, name: str) -> None:
        (self.root / name).unlink(missing_ok=True)


class _LocalLock(WriterLock):
    """``fcntl.flock`` on a lock file that records the owner, held while this object lives. The
    kernel drops the lock when the process dies, so a killed writer never leaves the directory
    locked (its file stays, unlocked, and is reused). Release deletes the file while still holding
    the lock; a locker checks it holds the file that is at the path, so two never hold two files."""

    def __init__(self, path: Path, location: str) -> None:
        while True:
            fd = self._open(path, location)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                owner = _describe_owner(os.pread(fd, 4096, 0))
                os.close(fd)
                raise CheckpointWriteError(
                    errno.EBUSY,
                    f"{location!r} is being written by another CheckpointManager ({owner}; lock file "
                    f"{str(path)!r}). One manager writes a directory at a time: close the other one, or use "
                    "another directory. Reading (all_steps, restore) needs no lock",
                ) from exc
            if _is_file_at(fd, path):
                break
            os.close(fd)  # released and deleted by its owner after we opened it: lock the new one
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(_owner()).encode(), 0)
        self._release = weakref.finalize(self, _unlock, path, fd)

    @staticmethod
    def _open(path: Path, location: str) -> int:
        try:
            return os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
        except OSError as exc:
            raise CheckpointWriteError(
                exc.errno, f"cannot create the lock file {str(path)!r} of {location!r}: {exc.strerror or exc}"
            ) from exc

    def heartbeat(self) -> None:
        """Nothing to do: the kernel holds the lock until it is released or the process ends."""

    def release(self) -> None:
        self._release()


def _is_file_at(fd: int, path: Path) -> bool:
    try:
        here = os.stat(path)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (mine.st_dev, mine.st_ino) == (here.st_dev, here.st_ino)


def _unlock(path: Path, fd: int) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)  # while still locked, so no one else holds a lock on this file
    os.close(fd)


class _FsspecLock(WriterLock):
    """An exclusively created marker object holding the owner, a token and a heartbeat time.

    Object stores cannot tell that a writer died, so a marker outlives a killed writer: the error
    names the owner and the age of its heartbeat (updated before every save), and the marker is
    cleared by deleting ``<location>/.ckptzip.lock`` once that writer is known to be gone.
    """

    def __init__(self, storage: FsspecStorage) -> None:
        self._storage = storage
        self._path = storage._path(LOCK_NAME)
        self._owner = _owner()
        self._held = False
        if not _store_call(storage.location, lambda: _create_exclusive(storage.fs, self._path, self._record())):
            owner = _describe_owner(_store_call(storage.location, lambda: storage.fs.cat_file(self._path)))
            raise CheckpointWriteError(
                errno.EBUSY,
                f"{storage.location!r} is being written by another CheckpointManager ({owner}). One manager "
                f"writes a location at a time. If that writer is gone (killed), delete {storage.location}/"
                f"{LOCK_NAME} and retry. Reading (all_steps, restore) needs no lock",
            )
        self._held = True

    def _record(self) -> bytes:
        return json.dumps({**self._owner, "heartbeat": time.time()}).encode()

    def _current_token(self) -> str | None:
        try:
            return json.loads(self._storage.fs.cat_file(self._path)).get("token")
        except (FileNotFoundError, ValueError, AttributeError):
            return None

    def heartbeat(self) -> None:
        token = _store_call(self._storage.location, self._current_token)
        if token != self._owner["token"]:
            self._held = False
            raise CheckpointWriteError(
                errno.EBUSY,
                f"this CheckpointManager no longer holds the lock {self._storage.location}/{LOCK_NAME} (it was "
                "deleted or taken by another writer); stop writing to this location",
            )
        _store_call(self._storage.location, lambda: _put(self._storage.fs, self._path, self._record()))

    def release(self) -> None:
        """Delete the marker if it is still ours; best effort (an unreachable store leaves it, and
        the next writer's error says how to clear it)."""
        with contextlib.suppress(Exception):
            if self._held and self._current_token() == self._owner["token"]:
                self._storage.fs.rm_file(self._path)
        self._held = False


def _create_exclusive(fs: Any, path: str, data: bytes) -> bool:
    """Write ``path`` unless it exists; whether it was written. Mode ``xb``, which s3fs sends as
    a conditional PUT (If-None-Match: *)."""
    try:
        with fs.open(path, "xb") as f:
            f.write(data)
    except FileExistsError:
        return False
    except (TypeError, NotImplementedError, ValueError):  # a filesystem without exclusive create
        if fs.exists(path):
            return False
        _put(fs, path, data)
    except OSError:  # a failed precondition some stores report as a plain OSError
        if fs.exists(path):
            return False
        raise
    return True


def _put(fs: Any, path: str, data: bytes) -> None:
    with fs.open(path, "wb") as f:
        f.write(data)


class _StoreFailure(CheckpointWriteError):
    """A call into an fsspec store failed; ``__cause__`` is the store's own exception."""


def _store_call(location: str, call: Callable[[], Any]) -> Any:
    """Run a call into an fsspec store; any failure (botocore's included) becomes a
    ``CheckpointWriteError`` with the original as its cause."""
    try:
        return call()
    except CkptzipError:
        raise
    except Exception as exc:
        raise _StoreFailure(
            getattr(exc, "errno", None) or errno.EIO, f"storage {location!r} failed: {type(exc).__name__}: {exc}"
        ) from exc


class _DigestWriter:
    """Forwards writes to a store's file while counting bytes and hashing them (XXH3-64); a
    failure of the store is raised as ``CheckpointWriteError``."""

    def __init__(self, f: BinaryIO, location: str) -> None:
        self._f = f
        self._location = location
        self._hash = xxhash.xxh3_64()
        self.size = 0

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self._hash.update(view)
        self.size += view.nbytes
        return _store_call(self._location, lambda: self._f.write(view))

    def hexdigest(self) -> str:
        return f"{self._hash.intdigest():016x}"


class FsspecStorage(Storage):
    """A prefix in an fsspec filesystem (object stores); commits by a marker written after the data."""

    def __init__(self, fs: Any, root: str, location: str) -> None:
        self.fs = fs
        self.root = root.rstrip("/")
        self.location = location

    def _path(self, name: str) -> str:
        return f"{self.root}/{name}"

    def _names(self) -> set[str]:
        self.fs.invalidate_cache(self.root)
        try:
            paths = self.fs.ls(self.root, detail=False)
        except FileNotFoundError:
            return set()
        return {p.rstrip("/").rsplit("/", 1)[-1] for p in paths}

    def list(self, pattern: re.Pattern[str]) -> Listing:
        names = self._names()
        data = sorted(n for n in names if pattern.fullmatch(n))
        return Listing(
            committed=[n for n in data if n + COMMIT_SUFFIX in names],
            partial=[n for n in data if n + COMMIT_SUFFIX not in names],
        )

    def write(self, name: str, write: Callable[[BinaryIO], Any]) -> None:
        path = self._path(name)
        try:
            digest = self._write_data(path, write)
            marker = {
                "format": _MARKER_FORMAT,
                "version": _MARKER_VERSION,
                "name": name,
                "size": digest.size,
                "xxh3_64": digest.hexdigest(),
            }
            _store_call(self.location, lambda: self.fs.pipe_file(path + COMMIT_SUFFIX, json.dumps(marker).encode()))
        except BaseException as exc:
            with contextlib.suppress(Exception):  # an uncommitted leftover is harmless; this is tidying
                self.fs.rm_file(path)
            if isinstance(exc, OSError) and (not isinstance(exc, CkptzipError) or isinstance(exc, _StoreFailure)):
                raise CheckpointWriteError(
                    exc.errno,
                    f"could not write checkpoint {self.location}/{name}: {exc.strerror or exc}. It was not "
                    "committed; committed checkpoints are untouched",
                ) from (exc.__cause__ if isinstance(exc, _StoreFailure) else exc)
            raise

    def _write_data(self, path: str, write: Callable[[BinaryIO], Any]) -> _DigestWriter:
        f = _store_call(self.location, lambda: self.fs.open(path, "wb"))
        try:
            digest = _DigestWriter(f, self.location)
            write(digest)  # type: ignore[arg-type]
        except BaseException:
            with contextlib.suppress(Exception):
                f.close()
            raise
        _store_call(self.location, f.close)
        return digest

    def lock(self) -> WriterLock:
        return _FsspecLock(self)

    def _marker(self, name: str) -> dict[str, Any]:
        raw = self.fs.cat_file(self._path(name) + COMMIT_SUFFIX)
        try:
            marker = json.loads(raw)
        except ValueError as exc:
            raise CorruptCheckpointError(f"commit marker of {self.location}/{name} is not JSON: {exc}") from exc
        expected = {"format": _MARKER_FORMAT, "version": _MARKER_VERSION, "name": name}
        if (
            not isinstance(marker, dict)
            or any(marker.get(k) != v for k, v in expected.items())
            or type(marker.get("size")) is not int
            or not isinstance(marker.get("xxh3_64"), str)
        ):
            raise CorruptCheckpointError(
                f"commit marker of {self.location}/{name} holds {raw[:200]!r}, expected a JSON object with "
                f"{expected} and integer 'size' and string 'xxh3_64'"
            )
        return marker

    def open(self, name: str) -> BinaryIO:
        marker = self._marker(name)
        data = self.fs.cat_file(self._path(name))
        found = (len(data), xxh3_hex(data))
        if found != (marker["size"], marker["xxh3_64"]):
            raise CorruptCheckpointError(
                f"{self.location}/{name} has {found[0]} bytes with XXH3-64 {found[1]}, but its commit marker "
                f"records {marker['size']} bytes with XXH3-64 {marker['xxh3_64']}; the object was changed "
                "or damaged after it was committed"
            )
        return io.BytesIO(data)

    def delete(self, name: str) -> None:
        path = self._path(name)
        for victim in (path + COMMIT_SUFFIX, path):  # un-commit first, so no marker outlives its data
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm_file(victim)

    def discard_partial(self, name: str) -> None:
        if name + COMMIT_SUFFIX not in self._names():
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm_file(self._path(name))


def open_storage(location: str | os.PathLike[str], storage_options: dict[str, Any] | None = None) -> Storage:
    """The storage for a local path, a ``file://`` URL, or any other fsspec URL (``s3://bucket/run``).

    ``storage_options`` are passed to the fsspec filesystem (credentials, ``endpoint_url``, ...).
    """
    text = os.fspath(location)
    protocol, sep, _ = text.partition("://")
    if not sep or protocol == "file":
        if storage_options:
            raise ValueError(
                f"storage_options={storage_options!r} were given for local path {text!r}; they apply only "
                "to fsspec URLs such as 's3://bucket/run'"
            )
        return LocalStorage(file_url_path(text) if sep else text)
    try:
        import fsspec  # type: ignore[import-untyped]

        fs, root = fsspec.core.url_to_fs(text, **(storage_options or {}))
    except ImportError as exc:
        extra = _EXTRAS.get(protocol)
        hint = f'pip install "ckptzip[{extra}]"' if extra else f"install the fsspec implementation for {protocol!r}"
        raise StorageUnavailableError(
            f"cannot open {text!r}: the {protocol!r} protocol needs a package that is not installed ({exc}). "
            f"To fix: {hint}"
        ) from exc
    return FsspecStorage(fs, root, text.rstrip("/"))
