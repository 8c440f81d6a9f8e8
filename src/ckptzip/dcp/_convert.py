"""Convert between a ckptzip DCP checkpoint directory and a single ``.ckz`` file.

The DCP side follows DCP's own ``dcp_to_torch_save`` / ``torch_save_to_dcp``: the whole state is
loaded in one process (no process group) with DCP's empty-state-dict planner, which rebuilds the
nested state dict from the checkpoint metadata.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterator
from typing import Any, BinaryIO

from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.checkpoint.storage import StorageReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

from .. import api
from ..errors import CheckpointNotFoundError, CkptzipError, UnsupportedObjectError
from ..format.kinds import PLAIN_DCP_METADATA as PLAIN_METADATA_FILE
from ..storage import is_url, local_path, open_directory
from ..tree import expanded_leaves, is_container, join_path
from ._metadata import METADATA_FILE
from ._reader import CompressedStorageReader
from ._writer import CompressedStorageWriter

# Most items a .ckz's state may become in DCP, which cannot share sub-objects and stores every
# path of a shared container again: a few hundred bytes of aliases can stand for 2**40 of them.
MAX_DCP_ITEMS = 1_000_000


@contextlib.contextmanager
def _ckptzip_errors() -> Iterator[None]:
    """Re-raise the ckptzip error inside DCP's ``CheckpointException`` (single process: one rank)."""
    try:
        yield
    except CheckpointException as exc:
        for error, _trace in exc.failures.values():
            if isinstance(error, CkptzipError):
                raise error from exc
        raise


@contextlib.contextmanager
def _open_file(path: str | os.PathLike[str], mode: str) -> Iterator[BinaryIO | str | os.PathLike[str]]:
    """A local path (or ``file://`` URL) as a path (ckptzip writes it atomically), another URL as
    an fsspec stream."""
    path = local_path(path)
    if not is_url(path):
        yield path
        return
    import fsspec

    with fsspec.open(os.fspath(path), mode) as stream:
        yield stream


def _load_full_state(dcp_dir: str | os.PathLike[str], *, trusted_objects: bool = False) -> dict[str, Any]:
    """The whole state of a DCP checkpoint (ckptzip's, or with ``trusted_objects`` a plain one
    written by ``FileSystemWriter``) as one nested dict of CPU tensors."""
    state: dict[str, Any] = {}
    reader: StorageReader
    if is_plain_dcp_checkpoint(dcp_dir):
        if not trusted_objects:
            raise UnsupportedObjectError(
                f"{os.fspath(dcp_dir)!r} is a plain DCP checkpoint (FileSystemWriter's {PLAIN_METADATA_FILE}), "
                "whose metadata and non-tensor values are pickles, which reading them runs; if you trust it, "
                "pass --trusted-objects (trusted_objects=True)"
            )
        reader = FileSystemReader(os.fspath(dcp_dir))
    else:
        reader = CompressedStorageReader(dcp_dir, trusted_objects=trusted_objects)
        _check_metadata(reader)
    with _ckptzip_errors():
        _load_state_dict(state, storage_reader=reader, planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    return state


def _check_metadata(reader: CompressedStorageReader) -> None:
    """Read the metadata before DCP does: DCP's load catches ``read_metadata``'s error and raises
    an ``AssertionError`` that only quotes it, so a damaged file would not surface as ckptzip's
    error. Like DCP, fall back to rank 0's own file (a save without collectives)."""
    try:
        reader.read_metadata()
    except CheckpointNotFoundError as missing:
        try:
            reader.read_metadata(rank=0)
        except CheckpointNotFoundError:
            raise missing from None


def dcp_to_ckz(
    dcp_dir: str | os.PathLike[str], ckz_path: str | os.PathLike[str], *, codec: str = "auto",
    trusted_objects: bool = False,
) -> None:
    """Convert a checkpoint written by :class:`CompressedStorageWriter` (or, with
    ``trusted_objects``, by DCP's ``FileSystemWriter``) to one ``.ckz`` file.

    Loads the whole state in this process (like DCP's ``dcp_to_torch_save``), so it needs memory
    for all of it. The result loads with ``ckptzip.load``.
    """
    state = _load_full_state(dcp_dir, trusted_objects=trusted_objects)
    doubtful = restore_optimizer_keys(state)
    if doubtful:
        warnings.warn(
            f"DCP stores every dict key as a string, so these dicts, whose keys all read as integers, may have had "
            f"integer keys; they keep string keys in the .ckz: {', '.join(doubtful)}", UserWarning, stacklevel=2)
    with _open_file(ckz_path, "wb") as target:
        api.save(state, target, codec=codec)


def restore_optimizer_keys(state: Any) -> list[str]:
    """Give optimizer states back their integer keys, in place, and return the paths of the
    other dicts whose keys all read as integers.

    DCP flattens a state into dotted paths and stores every dict key as a string, so an
    optimizer's ``state_dict()["state"]``, keyed by parameter index, comes back keyed ``"0"``,
    ``"1"``, ...; ``load_state_dict`` then matches no parameter and attaches no moments, without
    an error. A dict with ``"state"`` and ``"param_groups"`` whose groups' ``"params"`` are
    integers is such a state: its keys that name those integers become integers again."""
    doubtful: list[str] = []

    def walk(obj: Any, path: str) -> None:
        if not is_container(obj):
            return
        if isinstance(obj, dict):
            _restore_state_keys(obj)  # before its "state" is walked
            if obj and all(isinstance(k, str) and _integer(k) is not None for k in obj):
                doubtful.append(path or "<root>")
            items: Any = obj.items()
        else:
            items = enumerate(obj)
        for key, value in items:
            walk(value, join_path(path, key))

    walk(state, "")
    return doubtful


def _restore_state_keys(optimizer: dict[Any, Any]) -> None:
    """Key ``optimizer["state"]`` by the integer parameter indices of its ``param_groups`` where
    its string keys name only those."""
    state, groups = optimizer.get("state"), optimizer.get("param_groups")
    if not (isinstance(state, dict) and state and isinstance(groups, list)):
        return
    params = [g.get("params") for g in groups if isinstance(g, dict)]
    indices = {i for p in params if isinstance(p, list) for i in p if type(i) is int}
    keys = {k: _integer(k) if isinstance(k, str) else None for k in state}
    if all(i is not None and i in indices for i in keys.values()):
        restored = {keys[k]: v for k, v in state.items()}
        state.clear()
        state.update(restored)


def _integer(text: str) -> int | None:
    """The integer ``text`` spells as ``str(int)`` does ("3", "-1"; not "03" or " 3"), else None."""
    try:
        value = int(text)
    except ValueError:
        return None
    return value if str(value) == text else None


def ckz_to_dcp(ckz_path: str | os.PathLike[str], dcp_dir: str | os.PathLike[str], *, codec: str = "auto") -> None:
    """Convert a ``.ckz`` checkpoint to a ckptzip DCP checkpoint directory (one rank's files),
    which ``dcp.load`` with :class:`CompressedStorageReader` reshards onto any number of ranks."""
    with _open_file(ckz_path, "rb") as source:
        state = api.load(source, map_location="cpu")
    if not isinstance(state, dict):
        raise CkptzipError(
            f"{os.fspath(ckz_path)!r} holds a {type(state).__name__}; a DCP checkpoint is made from a dict state"
        )
    items = expanded_leaves(state)
    if items > MAX_DCP_ITEMS:
        raise CkptzipError(
            f"{os.fspath(ckz_path)!r} shares containers so that DCP, which stores every path of a shared "
            f"container again, would write {items} items, more than {MAX_DCP_ITEMS}; nothing was written. "
            "ckptzip.load reads it with the containers shared"
        )
    with _ckptzip_errors():
        dcp_save(state, storage_writer=CompressedStorageWriter(dcp_dir, codec=codec), no_dist=True)


def is_dcp_checkpoint(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a directory holding a ckptzip DCP checkpoint."""
    return open_directory(path).exists(METADATA_FILE)


def is_plain_dcp_checkpoint(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a local directory holding a checkpoint of DCP's own ``FileSystemWriter``."""
    path = local_path(path)
    return not is_url(path) and os.path.isfile(os.path.join(path, PLAIN_METADATA_FILE))
