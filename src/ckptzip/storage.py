"""Where a :class:`~ckptzip.manager.CheckpointManager` keeps its files: a local directory or an
fsspec URL, each with an atomic way to make a finished file visible.

A local directory commits by rename (:func:`ckptzip.api.atomic_file`: temporary file, fsync,
``os.replace``, fsync of the directory). Object stores have no atomic rename, so a file there is
committed by a small JSON *commit marker* ``<name>.commit`` written after the data; a file without
its marker is a leftover of an interrupted write and is never listed as committed.
"""

from __future__ import annotations

import abc
import contextlib
import io
import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import xxhash

from .api import atomic_file
from .checksum import xxh3_hex
from .errors import CheckpointWriteError, CkptzipError, CorruptCheckpointError, StorageUnavailableError

COMMIT_SUFFIX = ".commit"
_MARKER_FORMAT = "ckptzip-commit"
_MARKER_VERSION = 1
# Temporary names of ckptzip.api.atomic_file: ".<name>.tmp-<pid>-<hex>".
_LOCAL_TEMP = re.compile(r"\.(?P<target>.+?)\.tmp-\d+-[0-9a-f]+")
# Protocols whose fsspec implementation ships in an extra of ckptzip.
_EXTRAS = {"s3": "s3", "s3a": "s3"}


@dataclass(frozen=True)
class Listing:
    """Names in a storage location that match a pattern, split by state."""

    committed: list[str]
    partial: list[str]  # leftovers of interrupted writes, never committed


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


class LocalStorage(Storage):
    """A directory on a local (POSIX-semantics) filesystem; commits by atomic rename."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self.location = str(self.root)

    def list(self, pattern: re.Pattern[str]) -> Listing:
        try:
            entries = list(os.scandir(self.root))
        except FileNotFoundError:
            return Listing([], [])
        committed, partial = [], []
        for entry in entries:
            temp = _LOCAL_TEMP.fullmatch(entry.name)
            if temp and pattern.fullmatch(temp["target"]):
                partial.append(entry.name)
            elif pattern.fullmatch(entry.name) and entry.is_file():
                committed.append(entry.name)
        return Listing(sorted(committed), sorted(partial))

    def write(self, name: str, write: Callable[[BinaryIO], Any]) -> None:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise CheckpointWriteError(
                exc.errno, f"could not create checkpoint directory {self.location!r}: {exc.strerror or exc}"
            ) from exc
        with atomic_file(self.root / name) as f:
            write(f)

    def open(self, name: str) -> BinaryIO:
        return open(self.root / name, "rb")

    def delete(self, name: str) -> None:
        (self.root / name).unlink(missing_ok=True)

    def discard_partial(self, name: str) -> None:
        (self.root / name).unlink(missing_ok=True)


class _DigestWriter:
    """Forwards writes to a file while counting bytes and hashing them (XXH3-64)."""

    def __init__(self, f: BinaryIO) -> None:
        self._f = f
        self._hash = xxhash.xxh3_64()
        self.size = 0

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self._hash.update(view)
        self.size += view.nbytes
        return self._f.write(view)

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
            with self.fs.open(path, "wb") as f:
                digest = _DigestWriter(f)
                write(digest)  # type: ignore[arg-type]
            marker = {
                "format": _MARKER_FORMAT,
                "version": _MARKER_VERSION,
                "name": name,
                "size": digest.size,
                "xxh3_64": digest.hexdigest(),
            }
            self.fs.pipe_file(path + COMMIT_SUFFIX, json.dumps(marker).encode())
        except BaseException as exc:
            with contextlib.suppress(OSError):  # an uncommitted leftover is harmless; this is tidying
                self.fs.rm_file(path)
            if isinstance(exc, OSError) and not isinstance(exc, CkptzipError):
                raise CheckpointWriteError(
                    exc.errno,
                    f"could not write checkpoint {self.location}/{name}: {exc}. It was not committed; "
                    "committed checkpoints are untouched",
                ) from exc
            raise

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
    protocol, sep, rest = text.partition("://")
    if not sep or protocol == "file":
        if storage_options:
            raise ValueError(
                f"storage_options={storage_options!r} were given for local path {text!r}; they apply only "
                "to fsspec URLs such as 's3://bucket/run'"
            )
        return LocalStorage(rest if sep else text)
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
