"""One interface to a directory of checkpoint files, on a local disk or behind an fsspec URL.

:class:`Directory` is what ``save``'s callers above this floor (the manager's stores, the DCP
plugin) use, in the spirit of DCP's ``FileSystemBase``: files are addressed by plain names, a
write is all or nothing (locally a temporary file, fsync, rename, fsync of the directory; on an
object store the object appears when its upload completes), and every I/O failure of a write is
a :class:`~ckptzip.errors.CheckpointWriteError` whose cause is the original exception.
"""

from __future__ import annotations

import abc
import contextlib
import errno
import io
import os
import posixpath
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, TypeVar

from ..errors import CheckpointWriteError, CkptzipError, StorageAccessError, StorageUnavailableError
from .files import atomic_file, file_url_path, write_error

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer

T = TypeVar("T")

# Protocols whose fsspec implementation ships in an extra of ckptzip.
_EXTRAS = {"s3": "s3", "s3a": "s3"}


def is_url(location: str | os.PathLike[str]) -> bool:
    """Whether ``location`` names a place through a protocol (``s3://…``, ``file://…``)."""
    return "://" in os.fspath(location)


def local_path(location: str | os.PathLike[str]) -> str:
    """``location`` with a ``file://`` URL turned into the local path it names (fsspec would read
    ``file://localhost/abs`` as a path relative to the working directory)."""
    text = os.fspath(location)
    return file_url_path(text) if text.startswith("file://") else text


class Directory(abc.ABC):
    """A flat directory of files addressed by plain names (one path component, no slashes)."""

    def __init__(self, location: str) -> None:
        self.location = location  # as the caller named it, for messages

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.location!r})"

    def where(self, name: str) -> str:
        """The full path or URL of ``name``, for messages."""
        return posixpath.join(self.location, name) if is_url(self.location) else os.path.join(self.location, name)

    @abc.abstractmethod
    def makedirs(self) -> None:
        """Create the directory (and its parents) if missing; ``CheckpointWriteError`` if that fails."""

    @abc.abstractmethod
    def names(self) -> list[str]:
        """The names of the files in the directory (none when it does not exist)."""

    @abc.abstractmethod
    def exists(self, name: str) -> bool:
        """Whether file ``name`` exists."""

    @abc.abstractmethod
    def present(self) -> bool:
        """Whether anything (a file or a directory) is at the directory's own path."""

    @abc.abstractmethod
    def is_dir(self) -> bool:
        """Whether the directory itself exists."""

    @abc.abstractmethod
    def remove(self, name: str) -> None:
        """Delete file ``name``; a missing file is not an error."""

    @abc.abstractmethod
    def atomic_write(self, name: str, *, sync: bool = True) -> contextlib.AbstractContextManager[BinaryIO]:
        """A stream whose bytes become file ``name`` all at once when the block ends without error;
        on error nothing is left under ``name`` that was not there before. ``sync`` makes a local
        file durable (fsync of the file and its directory) before the block ends."""

    def write_bytes(self, name: str, data: bytes, *, sync: bool = True) -> None:
        """Replace file ``name`` with ``data``, all at once."""
        with self.atomic_write(name, sync=sync) as stream:
            stream.write(data)

    @abc.abstractmethod
    def read_bytes(self, name: str) -> bytes:
        """The whole content of file ``name`` (``FileNotFoundError`` when it is missing)."""

    @abc.abstractmethod
    def open_read(self, name: str) -> BinaryIO:
        """A binary stream reading file ``name`` from its start (``FileNotFoundError`` when missing)."""


class LocalDirectory(Directory):
    """A directory on a local (POSIX-semantics) file system."""

    def __init__(self, location: str | os.PathLike[str]) -> None:
        super().__init__(os.fspath(location))
        self.root = Path(local_path(location))

    def makedirs(self) -> None:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise write_error(
                f"could not create checkpoint directory {self.location!r}: {exc.strerror or exc}", exc.errno
            ) from exc

    def names(self) -> list[str]:
        try:
            return [entry.name for entry in os.scandir(self.root) if entry.is_file()]
        except FileNotFoundError:
            return []

    def exists(self, name: str) -> bool:
        return (self.root / name).exists()

    def present(self) -> bool:
        return os.path.lexists(self.root)

    def is_dir(self) -> bool:
        return self.root.is_dir()

    def remove(self, name: str) -> None:
        (self.root / name).unlink(missing_ok=True)

    def atomic_write(self, name: str, *, sync: bool = True) -> contextlib.AbstractContextManager[BinaryIO]:
        return atomic_file(self.root / name, sync=sync)

    def read_bytes(self, name: str) -> bytes:
        return (self.root / name).read_bytes()

    def open_read(self, name: str) -> BinaryIO:
        return open(self.root / name, "rb")


class StoreFailure(CheckpointWriteError):
    """A call into an fsspec store failed; ``__cause__`` is the store's own exception."""


# botocore's and google-auth's exceptions for credentials that are missing or incomplete
_NO_CREDENTIALS = {"NoCredentialsError", "PartialCredentialsError", "DefaultCredentialsError"}


def _raise_if_no_access(exc: Exception, location: str) -> None:
    """Raise :class:`StorageAccessError`, saying how to give credentials, if ``exc`` says the
    store had none."""
    if type(exc).__name__ in _NO_CREDENTIALS:
        raise StorageAccessError(
            f"storage {location!r}: the object store needs credentials and found none ({type(exc).__name__}: "
            f"{exc}); set them in the environment (for S3: AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or "
            "AWS_PROFILE), or pass storage_options (for S3: {'key': ..., 'secret': ...}, or {'anon': True} "
            "for a public bucket)"
        ) from exc


class FsspecDirectory(Directory):
    """A prefix in an fsspec file system (object stores)."""

    def __init__(self, location: str, fs: Any, root: str) -> None:
        super().__init__(location.rstrip("/"))
        self.fs = fs
        self.root = root.rstrip("/")

    def path(self, name: str) -> str:
        """The store's path of file ``name``."""
        return f"{self.root}/{name}"

    def call(self, call: Callable[[], T]) -> T:
        """Run a call into the store; any failure but ckptzip's own (botocore's included) becomes
        :class:`StoreFailure`, an ``OSError`` whose cause is the original."""
        try:
            return call()
        except CkptzipError:
            raise
        except Exception as exc:
            _raise_if_no_access(exc, self.location)
            raise StoreFailure(
                getattr(exc, "errno", None) or errno.EIO, f"storage {self.location!r} failed: {type(exc).__name__}: {exc}"
            ) from exc

    def makedirs(self) -> None:
        try:
            self.call(lambda: self.fs.makedirs(self.root, exist_ok=True))
        except StoreFailure as exc:
            raise write_error(f"could not create checkpoint directory {self.location!r}: {exc.strerror}", exc.errno) from exc.__cause__

    def names(self) -> list[str]:
        self.fs.invalidate_cache(self.root)
        try:
            paths = self.fs.ls(self.root, detail=False)
        except FileNotFoundError:
            return []
        except Exception as exc:
            _raise_if_no_access(exc, self.location)
            raise
        return [p.rstrip("/").rsplit("/", 1)[-1] for p in paths]

    def exists(self, name: str) -> bool:
        return bool(self.fs.exists(self.path(name)))

    def present(self) -> bool:
        return bool(self.fs.exists(self.root))

    def is_dir(self) -> bool:
        return bool(self.fs.isdir(self.root))

    def remove(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(self.path(name))

    @contextlib.contextmanager
    def transaction(self, name: str) -> Iterator[None]:
        """On a failure inside, remove file ``name`` if it was not there before (what a store may
        have left of it; a file that was there is the previous version, which a failed write must
        not take away) and raise an I/O failure as ``CheckpointWriteError`` naming it, caused by
        the store's own exception."""
        existed = self.call(lambda: self.fs.exists(self.path(name)))
        try:
            yield
        except BaseException as exc:
            if not existed:
                with contextlib.suppress(Exception):  # tidying: never hide the error that got us here
                    self.fs.rm_file(self.path(name))
            failure = exc if isinstance(exc, StoreFailure) or not isinstance(exc, CkptzipError) else None
            if isinstance(failure, OSError):  # the store's, or the file system's
                raise write_error(
                    f"could not write checkpoint {self.where(name)}: {failure.strerror or failure}. It was not "
                    "committed; committed checkpoints are untouched",
                    failure.errno,
                ) from (failure.__cause__ if isinstance(failure, StoreFailure) else failure)
            raise

    @contextlib.contextmanager
    def atomic_write(self, name: str, *, sync: bool = True) -> Iterator[BinaryIO]:
        """The object appears when the stream closes (an object store's upload is all or nothing)."""
        with self.transaction(name):
            stream = self.call(lambda: self.fs.open(self.path(name), "wb"))
            raw = _StoreStream(self, stream)
            try:
                buffered = io.BufferedWriter(raw)
                yield buffered
                buffered.flush()
            except BaseException:
                raw.discard()  # what is still buffered goes nowhere, even when collected later
                _abandon(stream)
                raise
            self.call(stream.close)

    def write_bytes(self, name: str, data: bytes, *, sync: bool = True) -> None:
        """One PUT; a failure leaves no file ``name`` and is a ``CheckpointWriteError``."""
        with self.transaction(name):
            self.put(name, data)

    def put(self, name: str, data: bytes) -> None:
        """One PUT of file ``name`` (``pipe_file``); a failure is :class:`StoreFailure`, and what is there stays."""
        self.call(lambda: self.fs.pipe_file(self.path(name), data))

    def overwrite(self, name: str, data: bytes) -> None:
        """Replace file ``name`` through a file of the store (``open(..., "wb")``); failures as :meth:`put`."""
        self.call(lambda: self._overwrite(self.path(name), data))

    def _overwrite(self, path: str, data: bytes) -> None:
        with self.fs.open(path, "wb") as f:
            f.write(data)

    def create_exclusive(self, name: str, data: bytes) -> bool:
        """Write file ``name`` unless it exists; whether it was written. Mode ``xb``, which s3fs sends
        as a conditional PUT (If-None-Match: *); a failure is :class:`StoreFailure`."""
        return self.call(lambda: self._create_exclusive(self.path(name), data))

    def _create_exclusive(self, path: str, data: bytes) -> bool:
        try:
            with self.fs.open(path, "xb") as f:
                f.write(data)
        except FileExistsError:
            return False
        except (TypeError, NotImplementedError, ValueError):  # a file system without exclusive create
            if self.fs.exists(path):
                return False
            self._overwrite(path, data)
        except OSError:  # a failed precondition some stores report as a plain OSError
            if self.fs.exists(path):
                return False
            raise
        return True

    def read_bytes(self, name: str) -> bytes:
        return bytes(self.fs.cat_file(self.path(name)))

    def open_read(self, name: str) -> BinaryIO:
        stream: BinaryIO = self.fs.open(self.path(name), "rb")
        return stream


def _abandon(stream: Any) -> None:
    """Give up a store's file without completing it. Closing an fsspec buffered file (s3fs, gcsfs,
    adlfs) completes its upload with what it holds, which over an existing object replaced the
    previous version with a partial one; it is discarded (the upload aborted) and marked closed,
    so its finaliser sends nothing either. Other files are closed."""
    from fsspec.spec import AbstractBufferedFile

    if isinstance(stream, AbstractBufferedFile):
        with contextlib.suppress(Exception):  # never hide the error that got us here
            stream.discard()
        stream.closed = True
        return
    with contextlib.suppress(Exception):
        stream.close()


class _StoreStream(io.RawIOBase):
    """Forwards writes to a store's file; a failure of the store is a :class:`StoreFailure`."""

    def __init__(self, directory: FsspecDirectory, stream: Any) -> None:
        super().__init__()
        self._directory = directory
        self._stream: Any = stream

    def discard(self) -> None:
        """Drop every later write: the object is being abandoned."""
        self._stream = None

    def writable(self) -> bool:
        return True

    def write(self, data: ReadableBuffer, /) -> int:
        view = memoryview(data).cast("B")
        stream = self._stream
        if stream is not None:
            self._directory.call(lambda: stream.write(view))
        return view.nbytes


def open_directory(location: str | os.PathLike[str], storage_options: dict[str, Any] | None = None) -> Directory:
    """The directory at a local path, a ``file://`` URL, or any other fsspec URL (``s3://bucket/run``).

    ``storage_options`` go to the fsspec file system (credentials, ``endpoint_url``, ...). A URL
    whose protocol needs a package that is not installed raises ``StorageUnavailableError``
    saying what to install.
    """
    text = os.fspath(location)
    protocol, sep, _ = text.partition("://")
    if not sep or protocol == "file":
        if storage_options:
            raise ValueError(
                f"storage_options={storage_options!r} were given for local path {text!r}; they apply only "
                "to fsspec URLs such as 's3://bucket/run'"
            )
        return LocalDirectory(text)
    try:
        import fsspec

        fs, root = fsspec.core.url_to_fs(text, **(storage_options or {}))
    except ImportError as exc:
        extra = _EXTRAS.get(protocol)
        hint = f'pip install "ckptzip[{extra}]"' if extra else f"install the fsspec implementation for {protocol!r}"
        raise StorageUnavailableError(
            f"cannot open {text!r}: the {protocol!r} protocol needs a package that is not installed ({exc}). "
            f"To fix: {hint}"
        ) from exc
    return FsspecDirectory(text, fs, root)
