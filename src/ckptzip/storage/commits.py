"""Where a :class:`~ckptzip.manager.CheckpointManager` keeps its files: committed checkpoints in a
:class:`~ckptzip.storage.directory.Directory`, and a lock for its one writer.

A local directory commits by atomic rename (:func:`~ckptzip.storage.files.atomic_file`). Object
stores have no atomic rename, so a file there is committed by a small JSON *commit marker*
``<name>.commit`` written after the data; a file without its marker is a leftover of an
interrupted write and is never listed as committed.
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
import uuid
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

import xxhash

from .. import strictjson
from ..checksum import xxh3_hex
from ..errors import CheckpointWriteError, CorruptCheckpointError
from .directory import FsspecDirectory, LocalDirectory, open_directory
from .files import LEGACY_TEMP, host_hash, is_stale_temporary, write_error

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer

COMMIT_SUFFIX = ".commit"
LOCK_NAME = ".ckptzip.lock"
_MARKER_FORMAT = "ckptzip-commit"
_MARKER_VERSION = 1


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
    return {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time(), "token": uuid.uuid4().hex}


def _read_owner(raw: bytes) -> dict[str, Any]:
    """The owner record of a lock file; an empty dict when it is not one."""
    try:
        owner = strictjson.loads(raw, "the lock file")
    except CorruptCheckpointError:
        return {}
    return owner if isinstance(owner, dict) else {}


def _describe_owner(raw: bytes) -> str:
    owner = _read_owner(raw)
    try:
        text = f"pid {owner['pid']} on host {owner['host']!r}"
        if "heartbeat" in owner:
            text += f", last heartbeat {time.time() - float(owner['heartbeat']):.0f} s ago"
        return text
    except (ValueError, KeyError, TypeError):
        return "an unknown owner"


class Storage(abc.ABC):
    """Committed files of one directory, with atomic commits. Names are plain file names."""

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
    """A directory on a local (POSIX-semantics) file system; commits by atomic rename."""

    def __init__(self, directory: LocalDirectory) -> None:
        self.directory = directory
        self.root = directory.root
        self.location = str(self.root)
        if self.root.exists() and not self.root.is_dir():
            raise write_error(
                f"{self.location!r} is a file, not a directory; checkpoints are kept in a directory. Pass the "
                "path of a directory (it is created if missing)",
                errno.ENOTDIR,
            )

    def list(self, pattern: re.Pattern[str]) -> Listing:
        """Committed files matching ``pattern``; as partial, earlier releases' temporaries of matching
        names and any temporary of a dead writer on this host (the lock makes this directory's
        writer the only one, and a temporary's name does not record its target)."""
        committed, partial = [], []
        host = host_hash()
        for name in self.directory.names():
            legacy = LEGACY_TEMP.fullmatch(name)
            if (legacy and pattern.fullmatch(legacy["target"])) or is_stale_temporary(name, host):
                partial.append(name)
            elif pattern.fullmatch(name):
                committed.append(name)
        return Listing(sorted(committed), sorted(partial))

    def write(self, name: str, write: Callable[[BinaryIO], Any]) -> None:
        self.directory.makedirs()
        with self.directory.atomic_write(name) as f:
            write(f)

    def lock(self) -> WriterLock:
        self.directory.makedirs()
        return _LocalLock(self.root / LOCK_NAME, self.location)

    def open(self, name: str) -> BinaryIO:
        return self.directory.open_read(name)

    def delete(self, name: str) -> None:
        self.directory.remove(name)

    def discard_partial(self, name: str) -> None:
        self.directory.remove(name)


class _LocalLock(WriterLock):
    """``fcntl.flock`` on a lock file that records the owner, held while this object lives. The
    kernel drops the lock when the process dies, so a killed writer never leaves the directory
    locked (its file stays, unlocked, and is reused). Release deletes the file while still holding
    the lock; a locker checks it holds the file that is at the path, so two never hold two files.
    Only a regular file is a lock: a symlink (even a dangling one), a FIFO or anything else at the
    path is refused, never followed, truncated or waited on. Every failure is a
    ``CheckpointWriteError`` naming the lock file."""

    def __init__(self, path: Path, location: str) -> None:
        while True:
            fd = _open_lock_file(path, location)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                busy = exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN)
                owner = _describe_owner(os.pread(fd, 4096, 0)) if busy else ""
                os.close(fd)
                if not busy:
                    raise _lock_error(path, location, "cannot be locked", exc) from exc
                raise write_error(
                    f"{location!r} is being written by another CheckpointManager ({owner}; lock file "
                    f"{str(path)!r}). One manager writes a directory at a time: close the other one, or use "
                    "another directory. Reading (all_steps, restore) needs no lock",
                    errno.EBUSY,
                ) from exc
            if _is_file_at(fd, path):
                break
            os.close(fd)  # released and deleted by its owner after we opened it: lock the new one
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(_owner()).encode(), 0)
        except OSError as exc:
            _unlock(path, fd)
            raise _lock_error(path, location, "cannot record its owner", exc) from exc
        self._release = weakref.finalize(self, _unlock, path, fd)

    def heartbeat(self) -> None:
        """Nothing to do: the kernel holds the lock until it is released or the process ends."""

    def release(self) -> None:
        self._release()


def _lock_error(path: Path, location: str, what: str, exc: OSError) -> CheckpointWriteError:
    return write_error(f"the lock file {str(path)!r} of {location!r} {what}: {exc.strerror or exc}", exc.errno)


def _open_lock_file(path: Path, location: str) -> int:
    """A descriptor of the regular file at ``path``, created if missing; never through a symlink,
    never blocking (a FIFO opens at once and is then refused)."""
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise write_error(
                f"the lock file {str(path)!r} of {location!r} is a symbolic link; a lock file is never "
                "followed. Remove the link and retry",
                exc.errno,
            ) from exc
        raise _lock_error(path, location, "cannot be opened", exc) from exc
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise write_error(
            f"the lock file {str(path)!r} of {location!r} is not a regular file (a "
            f"{_file_kind(mode)}); remove it and retry",
            errno.EEXIST,
        )
    return fd


def _file_kind(mode: int) -> str:
    kinds = {stat.S_ISFIFO: "FIFO", stat.S_ISDIR: "directory", stat.S_ISSOCK: "socket", stat.S_ISCHR: "character device",
             stat.S_ISBLK: "block device"}
    return next((name for test, name in kinds.items() if test(mode)), "special file")


def _is_file_at(fd: int, path: Path) -> bool:
    try:
        here = os.lstat(path)
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

    def __init__(self, directory: FsspecDirectory) -> None:
        self._directory = directory
        self._owner = _owner()
        self._held = False
        if not directory.create_exclusive(LOCK_NAME, self._record()):
            owner = _describe_owner(directory.call(lambda: directory.read_bytes(LOCK_NAME)))
            raise write_error(
                f"{directory.location!r} is being written by another CheckpointManager ({owner}). One manager "
                f"writes a location at a time. If that writer is gone (killed), delete {directory.location}/"
                f"{LOCK_NAME} and retry. Reading (all_steps, restore) needs no lock",
                errno.EBUSY,
            )
        self._held = True

    def _record(self) -> bytes:
        return json.dumps({**self._owner, "heartbeat": time.time()}).encode()

    def _current_token(self) -> Any:
        try:
            return _read_owner(self._directory.read_bytes(LOCK_NAME)).get("token")
        except FileNotFoundError:
            return None

    def heartbeat(self) -> None:
        token = self._directory.call(self._current_token)
        if token != self._owner["token"]:
            self._held = False
            raise write_error(
                f"this CheckpointManager no longer holds the lock {self._directory.location}/{LOCK_NAME} (it was "
                "deleted or taken by another writer); stop writing to this location",
                errno.EBUSY,
            )
        self._directory.overwrite(LOCK_NAME, self._record())

    def release(self) -> None:
        """Delete the marker if it is still ours; best effort (an unreachable store leaves it, and
        the next writer's error says how to clear it)."""
        with contextlib.suppress(Exception):
            if self._held and self._current_token() == self._owner["token"]:
                self._directory.remove(LOCK_NAME)
        self._held = False


class _Digest(io.RawIOBase):
    """Forwards writes to ``f`` while counting bytes and hashing them (XXH3-64)."""

    def __init__(self, f: BinaryIO) -> None:
        super().__init__()
        self._f = f
        self._hash = xxhash.xxh3_64()
        self.size = 0

    def writable(self) -> bool:
        return True

    def write(self, data: ReadableBuffer, /) -> int:
        view = memoryview(data).cast("B")
        self._f.write(view)
        self._hash.update(view)
        self.size += view.nbytes
        return view.nbytes

    def hexdigest(self) -> str:
        return f"{self._hash.intdigest():016x}"


class FsspecStorage(Storage):
    """A prefix in an fsspec file system (object stores); commits by a marker written after the data."""

    def __init__(self, directory: FsspecDirectory) -> None:
        self.directory = directory
        self.location = directory.location

    def list(self, pattern: re.Pattern[str]) -> Listing:
        names = set(self.directory.names())
        data = sorted(n for n in names if pattern.fullmatch(n))
        return Listing(
            committed=[n for n in data if n + COMMIT_SUFFIX in names],
            partial=[n for n in data if n + COMMIT_SUFFIX not in names],
        )

    def write(self, name: str, write: Callable[[BinaryIO], Any]) -> None:
        directory = self.directory
        with directory.transaction(name):  # a failure anywhere leaves no data object behind
            with directory.atomic_write(name) as f:
                digest = _Digest(f)
                with io.BufferedWriter(digest) as buffered:
                    write(buffered)
            marker = {
                "format": _MARKER_FORMAT,
                "version": _MARKER_VERSION,
                "name": name,
                "size": digest.size,
                "xxh3_64": digest.hexdigest(),
            }
            directory.put(name + COMMIT_SUFFIX, json.dumps(marker).encode())

    def lock(self) -> WriterLock:
        return _FsspecLock(self.directory)

    def _marker(self, name: str) -> dict[str, Any]:
        raw = self.directory.read_bytes(name + COMMIT_SUFFIX)
        marker = strictjson.loads(raw, f"commit marker of {self.location}/{name}", advice="it is damaged")
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
        data = self.directory.read_bytes(name)
        found = (len(data), xxh3_hex(data))
        if found != (marker["size"], marker["xxh3_64"]):
            raise CorruptCheckpointError(
                f"{self.location}/{name} has {found[0]} bytes with XXH3-64 {found[1]}, but its commit marker "
                f"records {marker['size']} bytes with XXH3-64 {marker['xxh3_64']}; the object was changed "
                "or damaged after it was committed"
            )
        return io.BytesIO(data)

    def delete(self, name: str) -> None:
        for victim in (name + COMMIT_SUFFIX, name):  # un-commit first, so no marker outlives its data
            self.directory.remove(victim)

    def discard_partial(self, name: str) -> None:
        if name + COMMIT_SUFFIX not in self.directory.names():
            self.directory.remove(name)


def open_storage(location: str | os.PathLike[str], storage_options: dict[str, Any] | None = None) -> Storage:
    """The manager's storage at a local path, a ``file://`` URL, or any other fsspec URL
    (``s3://bucket/run``); ``storage_options`` go to the fsspec file system."""
    directory = open_directory(location, storage_options)
    if isinstance(directory, LocalDirectory):
        return LocalStorage(directory)
    assert isinstance(directory, FsspecDirectory)
    return FsspecStorage(directory)
