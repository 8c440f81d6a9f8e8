"""The storage floor: where checkpoint bytes live. It owns atomic replacement, fsync and exact
reads for everything above it (``save``/``load``, the manager, the DCP plugin).

- :mod:`.files`: a local file replaced atomically, opened for reading without blocking on special
  files; the one way a ``CheckpointWriteError`` is built.
- :mod:`.ranges`: exact positioned reads of a file or buffer from several threads (``ByteRanges``).
- :mod:`.directory`: one interface (:class:`Directory`) to a directory of files on a local disk
  (:class:`LocalDirectory`) or behind an fsspec URL (:class:`FsspecDirectory`).
- :mod:`.commits`: the manager's committed checkpoints and its one-writer lock.
- :mod:`.private`: a local directory only this user can reach, used through its descriptor
  (:class:`~ckptzip.storage.private.PrivateDirectory`: the memory tier's, in /dev/shm).
"""

from .commits import LOCK_NAME, Listing, Storage, WriterLock, open_storage
from .directory import Directory, FsspecDirectory, LocalDirectory, is_url, local_path, open_directory
from .files import atomic_file, file_url_path, open_for_read, write_error
from .ranges import ByteRanges

__all__ = [
    "LOCK_NAME",
    "ByteRanges",
    "Directory",
    "FsspecDirectory",
    "Listing",
    "LocalDirectory",
    "Storage",
    "WriterLock",
    "atomic_file",
    "file_url_path",
    "is_url",
    "local_path",
    "open_directory",
    "open_for_read",
    "open_storage",
    "write_error",
]
