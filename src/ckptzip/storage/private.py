"""Directories only this user can reach, for files ckptzip keeps where other users may write too
(a memory tier in /dev/shm or /tmp).

A directory is *private* when it is a real directory (never a symbolic link) owned by this user
that no one else may enter (0700: one of this user that others could only read is made so; one
that others could write is refused); every directory above it is owned by this user or root and
cannot be written by others unless sticky (as /dev/shm and /tmp are: no one else can rename
what is in them), and a symbolic link above it is owned by this user or root. Anything else is
:class:`~ckptzip.errors.UnsafeLocationError`, before anything is read or written there; missing
directories are created 0700.

Once opened, a private directory is reached through its descriptor alone (``dir_fd`` calls,
``O_NOFOLLOW`` on every name), so nothing at its path or inside it can redirect a read or a
write: a symbolic link inside is neither read nor written through (a write replaces the link),
and only regular files owned by this user count as its files; anything else is ignored.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import threading
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from ..errors import CkptzipError, UnsafeLocationError
from .directory import LocalDirectory
from .files import file_kind, host_hash, is_stale_temporary, temp_name, write_error, write_failure

_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_DIRECTORY = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | _CLOEXEC
_OTHERS = 0o077  # permission bits for group and others
_OTHERS_WRITE = 0o022


def _trusted(st: os.stat_result) -> bool:
    """Owned by this user or root, and (a directory) not writable by others unless sticky."""
    if st.st_uid not in (0, os.geteuid()):
        return False
    return stat.S_ISLNK(st.st_mode) or not st.st_mode & _OTHERS_WRITE or bool(st.st_mode & stat.S_ISVTX)


def _refuse(path: str | os.PathLike[str], why: str) -> UnsafeLocationError:
    return UnsafeLocationError(
        errno.EACCES,
        f"{os.fspath(path)!r} is not a private directory of this user ({why}); another user could read, replace or "
        "redirect the files kept there, so nothing was. Remove it (or choose another path) and retry: ckptzip creates "
        "it owned by this user, mode 0700")


def _describe(st: os.stat_result) -> str:
    kind = "a symbolic link" if stat.S_ISLNK(st.st_mode) else "a directory" if stat.S_ISDIR(st.st_mode) else file_kind(
        st.st_mode)
    return f"{kind} owned by uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o}"


def _check_above(path: Path) -> None:
    """Every existing directory and symbolic link above ``path``, as written and as resolved, is
    one that only this user or root can change."""
    for walked in (path.parent, Path(os.path.realpath(path.parent))):
        at = Path(walked.anchor)
        for part in (walked.parts[1:] if walked.anchor else walked.parts):
            at = at / part
            try:
                st = os.lstat(at)
            except FileNotFoundError:
                break
            if not _trusted(st) or not (stat.S_ISDIR(st.st_mode) or stat.S_ISLNK(st.st_mode)):
                raise _refuse(path, f"{str(at)!r} above it is {_describe(st)}")


def _make_parents(path: Path) -> None:
    """The missing directories above ``path``, each created 0700."""
    missing = []
    for parent in path.parents:
        if os.path.lexists(parent):
            break
        missing.append(parent)
    for parent in reversed(missing):
        with contextlib.suppress(FileExistsError):
            os.mkdir(parent, 0o700)


def _check(fd: int, path: str | os.PathLike[str]) -> int:
    """``fd`` if it is a private directory (made 0700 if others could only read it), else closed
    and refused."""
    st = os.fstat(fd)
    why = None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        why = f"it is {_describe(st)}, this user is uid {os.geteuid()}"
    elif st.st_mode & _OTHERS_WRITE:
        why = f"it is {_describe(st)}: others may write in it"
    if why is not None:
        os.close(fd)
        raise _refuse(path, why)
    if st.st_mode & _OTHERS:
        os.fchmod(fd, 0o700)
    return fd


def _open_dir(name: str | os.PathLike[str], where: str | os.PathLike[str], create: bool, dir_fd: int | None) -> int | None:
    """A descriptor of directory ``name`` (relative to ``dir_fd``), created 0700 if missing and
    ``create``; never through a symbolic link; None if missing."""
    for attempt in range(2):
        try:
            return _check(os.open(name, _DIRECTORY, dir_fd=dir_fd), where)
        except FileNotFoundError:
            if not create or attempt:
                return None
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                st = os.lstat(name, dir_fd=dir_fd)
                raise _refuse(where, f"it is {_describe(st)}") from exc
            raise
        with contextlib.suppress(FileExistsError):
            os.mkdir(name, 0o700, dir_fd=dir_fd)
    return None


class PrivateDirectory(LocalDirectory):
    """A private directory (this module's rules), created on first write; ``parent``: the private
    directory it is a child of (reached through the parent's descriptor)."""

    def __init__(self, location: str | os.PathLike[str], parent: PrivateDirectory | None = None) -> None:
        super().__init__(location)
        self._parent = parent
        self._fd: int | None = None
        self._opening = threading.Lock()

    def _descriptor(self, create: bool) -> int | None:
        """The directory's descriptor, opened (and checked, and created if ``create``) on first
        use; None while it does not exist."""
        with self._opening:
            if self._fd is None:
                fd = self._open(create)
                if fd is not None:
                    self._fd = fd
                    weakref.finalize(self, os.close, fd)
            return self._fd

    def _open(self, create: bool) -> int | None:
        if self._parent is not None:
            parent = self._parent._descriptor(create)
            return None if parent is None else _open_dir(self.root.name, self.root, create, parent)
        _check_above(self.root)
        if create:
            _make_parents(self.root)
            _check_above(self.root)
        return _open_dir(self.root, self.root, create, None)

    def _existing(self) -> int | None:
        return self._descriptor(create=False)

    def makedirs(self) -> None:
        try:
            self._descriptor(create=True)
        except OSError as exc:
            if isinstance(exc, CkptzipError):
                raise
            raise write_error(f"could not create the directory {self.location!r}: {exc.strerror or exc}",
                              exc.errno) from exc

    def stat(self, name: str) -> os.stat_result:
        """The ``stat`` of file ``name`` if it is one of this directory's files (a regular file of
        this user, not followed), else ``FileNotFoundError``."""
        fd = self._existing()
        st = None if fd is None else _own(name, fd)
        if st is None:
            raise FileNotFoundError(errno.ENOENT, f"no file {name!r} of this user in {self.location}")
        return st

    def names(self) -> list[str]:
        fd = self._existing()
        if fd is None:
            return []
        with os.scandir(fd) as entries:
            return [e.name for e in entries if e.is_file(follow_symlinks=False) and
                    e.stat(follow_symlinks=False).st_uid == os.geteuid()]

    def nbytes(self) -> int:
        """Bytes of every file here, temporaries included."""
        fd = self._existing()
        if fd is None:
            return 0
        with os.scandir(fd) as entries:
            sizes = [e.stat(follow_symlinks=False) for e in entries if e.is_file(follow_symlinks=False)]
        return sum(st.st_size for st in sizes if st.st_uid == os.geteuid())

    def statvfs(self) -> os.statvfs_result:
        """The file system's figures (free and total space), from the directory's descriptor."""
        fd = self._descriptor(create=True)
        assert fd is not None
        return os.fstatvfs(fd)

    def exists(self, name: str) -> bool:
        fd = self._existing()
        return fd is not None and _own(name, fd) is not None

    def present(self) -> bool:
        return self._existing() is not None

    def is_dir(self) -> bool:
        return self.present()

    def remove(self, name: str) -> None:
        fd = self._existing()
        if fd is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name, dir_fd=fd)  # a link is removed, never followed

    def open_read(self, name: str) -> BinaryIO:
        fd = self._existing()
        if fd is None:
            raise FileNotFoundError(errno.ENOENT, f"{self.where(name)} does not exist")
        try:
            file = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | _CLOEXEC, dir_fd=fd)
        except OSError as exc:
            if exc.errno == errno.ELOOP:  # a symbolic link: not one of this directory's files
                raise FileNotFoundError(errno.ENOENT, f"{self.where(name)} is a symbolic link, not a file") from exc
            raise
        st = os.fstat(file)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            os.close(file)
            raise FileNotFoundError(errno.ENOENT, f"{self.where(name)} is not a file of this user")
        os.set_blocking(file, True)
        return os.fdopen(file, "rb")

    def read_bytes(self, name: str) -> bytes:
        with self.open_read(name) as f:
            return f.read()

    def atomic_write(self, name: str, *, sync: bool = True) -> contextlib.AbstractContextManager[BinaryIO]:
        return self._atomic(name, sync)

    @contextlib.contextmanager
    def _atomic(self, name: str, sync: bool) -> Iterator[BinaryIO]:
        """As :func:`~ckptzip.storage.files.atomic_file`, inside the directory's descriptor: a
        temporary created exclusively (never through a link), renamed over ``name`` (which
        replaces a link there rather than following it)."""
        self.makedirs()
        fd = self._descriptor(create=True)
        assert fd is not None
        self._remove_stale(fd, name)
        tmp = temp_name(name)
        path = Path(self.where(name))
        renamed = False
        try:
            file = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | _CLOEXEC, 0o600, dir_fd=fd)
            with os.fdopen(file, "wb") as f:
                yield f
                f.flush()
                if sync:
                    os.fsync(f.fileno())
            os.replace(tmp, name, src_dir_fd=fd, dst_dir_fd=fd)
            renamed = True
            if sync:
                os.fsync(fd)
        except BaseException as exc:
            if not renamed:
                with contextlib.suppress(OSError):
                    os.unlink(tmp, dir_fd=fd)
            if isinstance(exc, OSError) and not isinstance(exc, CkptzipError):
                raise write_error(write_failure(path, exc, renamed), exc.errno) from exc
            raise

    @staticmethod
    def _remove_stale(fd: int, name: str) -> None:
        """Temporaries a killed write of ``name`` on this host left (as atomic_file does)."""
        host = host_hash()
        with contextlib.suppress(OSError), os.scandir(fd) as entries:
            for entry in entries:
                if is_stale_temporary(entry.name, host, name):
                    with contextlib.suppress(OSError):
                        os.unlink(entry.name, dir_fd=fd)


def _own(name: str, fd: int) -> os.stat_result | None:
    """The ``stat`` of ``name`` in directory ``fd`` if it is a regular file of this user (not
    followed), else None."""
    try:
        st = os.stat(name, dir_fd=fd, follow_symlinks=False)
    except (FileNotFoundError, NotADirectoryError):
        return None
    return st if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() else None
