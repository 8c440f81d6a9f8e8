"""The files of one checkpoint directory, on a local disk or behind an fsspec URL."""

from __future__ import annotations

import contextlib
import io
import os
import posixpath
import uuid
from collections.abc import Iterator
from typing import IO, Any

from ..errors import CheckpointWriteError, CodecUnavailableError, CorruptCheckpointError
from ..storage import file_url_path


def is_url(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` names a location through an fsspec protocol (``s3://…``, ``memory://…``)."""
    return "://" in os.fspath(path)


def local_path(path: str | os.PathLike[str]) -> str:
    """``path`` with a ``file://`` URL turned into the local path it names (fsspec would read
    ``file://localhost/abs`` as a path relative to the working directory)."""
    text = os.fspath(path)
    return file_url_path(text) if text.startswith("file://") else text


def _url_to_fs(url: str, options: dict[str, Any]) -> tuple[Any, str]:
    try:
        from fsspec.core import url_to_fs
    except ImportError as exc:
        raise CodecUnavailableError(
            f"{url!r} is a URL, and URLs need fsspec: pip install 'ckptzip[s3]' (or fsspec plus the "
            "package of its protocol)."
        ) from exc
    return url_to_fs(url, **options)


class CheckpointDir:
    """A directory of files addressed by plain names: local paths use ``os``, URLs use fsspec.

    Names are single path components chosen by ckptzip; readers check names read from metadata
    with :func:`check_name` before opening them.
    """

    def __init__(self, path: str | os.PathLike[str], storage_options: dict[str, Any] | None = None):
        self.path = os.fspath(path)
        self._fs: Any = None
        self._root = local_path(self.path)
        if is_url(self._root):
            self._fs, self._root = _url_to_fs(self.path, storage_options or {})

    def __repr__(self) -> str:
        return f"CheckpointDir({self.path!r})"

    def location(self, name: str) -> str:
        """The full path or URL of ``name``, for messages."""
        return posixpath.join(self.path, name) if self._fs is not None else os.path.join(self.path, name)

    def _full(self, name: str) -> str:
        return posixpath.join(self._root, name) if self._fs is not None else os.path.join(self._root, name)

    def makedirs(self) -> None:
        """Create the directory (and its parents) if it does not exist."""
        try:
            if self._fs is None:
                os.makedirs(self._root, exist_ok=True)
            else:
                self._fs.makedirs(self._root, exist_ok=True)
        except OSError as exc:
            raise CheckpointWriteError(f"cannot create checkpoint directory {self.path!r}: {exc}") from exc

    def exists(self, name: str) -> bool:
        """Whether file ``name`` exists."""
        full = self._full(name)
        return os.path.exists(full) if self._fs is None else bool(self._fs.exists(full))

    def present(self) -> bool:
        """Whether anything (a file or a directory) is at the path itself."""
        return os.path.lexists(self._root) if self._fs is None else bool(self._fs.exists(self._root))

    def is_dir(self) -> bool:
        """Whether the directory itself exists."""
        return os.path.isdir(self._root) if self._fs is None else bool(self._fs.isdir(self._root))

    def remove(self, name: str) -> None:
        """Delete file ``name``; a missing file is not an error."""
        with contextlib.suppress(FileNotFoundError):
            if self._fs is None:
                os.remove(self._full(name))
            else:
                self._fs.rm_file(self._full(name))

    @contextlib.contextmanager
    def open_write(self, name: str, *, sync: bool) -> Iterator[IO[bytes]]:
        """Write file ``name``; with ``sync`` a local file is fsynced before it is closed.

        On an object store the object appears when the stream closes. On error the file is
        removed and the error (an ``OSError`` for I/O failures) propagates.
        """
        full = self._full(name)
        stream = open(full, "wb") if self._fs is None else self._fs.open(full, "wb")
        try:
            with stream:
                yield stream
                stream.flush()
                if sync and self._fs is None:
                    os.fsync(stream.fileno())
        except BaseException:
            self.remove(name)
            raise

    def write_atomic(self, name: str, data: bytes, *, sync: bool) -> None:
        """Make ``name`` hold ``data`` all at once: readers see the old state or the new one.

        Locally: write a temporary file, fsync it, rename it over ``name``, fsync the directory.
        On an object store a single PUT is already atomic.
        """
        if self._fs is not None:
            self._fs.pipe_file(self._full(name), data)
            return
        tmp = f"{name}.{uuid.uuid4().hex}.tmp"
        try:
            with self.open_write(tmp, sync=sync) as stream:
                stream.write(data)
            os.replace(self._full(tmp), self._full(name))
        except OSError as exc:
            self.remove(tmp)
            raise CheckpointWriteError(f"cannot write {self.location(name)!r}: {exc}") from exc
        if sync and hasattr(os, "O_DIRECTORY"):
            fd = os.open(self._root, os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def read(self, name: str) -> bytes:
        """The whole content of file ``name`` (raises ``FileNotFoundError`` when it is missing)."""
        full = self._full(name)
        if self._fs is None:
            with open(full, "rb") as f:
                return f.read()
        return bytes(self._fs.cat_file(full))

    @contextlib.contextmanager
    def open_read(self, name: str) -> Iterator[IO[bytes]]:
        """A binary stream reading file ``name``."""
        full = self._full(name)
        with open(full, "rb") if self._fs is None else self._fs.open(full, "rb") as stream:
            yield stream


def check_name(name: object, source: str) -> str:
    """``name`` if it is a plain file name (one path component, not hidden, at most 255 bytes),
    else corruption."""
    if (
        not isinstance(name, str)
        or not name
        or len(name.encode("utf-8", "surrogatepass")) > 255
        or name.startswith(".")
        or "/" in name
        or "\\" in name
        or "\x00" in name
    ):
        raise CorruptCheckpointError(
            f"{source}: data file name {name!r} is not a plain file name inside the checkpoint directory; "
            "the metadata is damaged or was not written by ckptzip"
        )
    return name


def read_exact(stream: IO[bytes], offset: int, length: int, what: str) -> bytes:
    """``length`` bytes at ``offset`` of ``stream``; fewer bytes means the file was truncated.

    The range is checked against the file size before anything is read, so a damaged length
    never becomes a huge allocation."""
    size = stream.seek(0, io.SEEK_END)
    if offset + length > size:
        raise CorruptCheckpointError(
            f"{what}: expected {length} bytes at offset {offset}, but the file has {size} bytes; "
            "the data file is truncated or the metadata is damaged"
        )
    stream.seek(offset)
    data = stream.read(length)
    if len(data) != length:
        raise CorruptCheckpointError(
            f"{what}: expected {length} bytes at offset {offset}, the file ends after {len(data)}; "
            "the data file is truncated"
        )
    return data
