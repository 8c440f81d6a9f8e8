"""Where a DCP reader or writer works: a checkpoint directory (or URL), reopened by ``reset``."""

from __future__ import annotations

import os
from typing import Any

from ..storage import Directory, open_directory


class CheckpointDirectory:
    """The directory a storage reader or writer reads or writes (``_dir``), opened with the
    fsspec options it was given, which a ``reset`` to another checkpoint keeps."""

    _dir: Directory
    _storage_options: dict[str, Any] | None

    def _open_directory(self, path: str | os.PathLike[str], storage_options: dict[str, Any] | None) -> None:
        self._storage_options = storage_options
        self._dir = open_directory(path, storage_options)

    def _reopen(self, checkpoint_id: str | os.PathLike[str] | None) -> None:
        """Move to ``checkpoint_id`` where one is given (DCP's ``reset``)."""
        if checkpoint_id:
            self._dir = open_directory(checkpoint_id, self._storage_options)

    @property
    def checkpoint_id(self) -> str:
        """The checkpoint directory or URL."""
        return self._dir.location
