"""DCP's checkpoint ``Metadata`` as a checksummed ``.ckz`` file, so reading it never unpickles.

DCP's own ``FileSystemWriter`` pickles ``Metadata``. ckptzip writes the same object graph as a
plain tree (dicts, lists, strings, integers) in a ``.ckz`` container, whose index hash covers every
byte, and rebuilds ``Metadata`` on load, validating every field (docs/DCP.md, "Metadata file").
"""

from __future__ import annotations

import io
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from ..api import load, save
from ..format.kinds import DCP_METADATA
from ..errors import CorruptCheckpointError, UnsupportedFormatError, UnsupportedObjectError
from ..format import TORCH_DTYPES

METADATA_FILE = DCP_METADATA
FORMAT = "ckptzip-dcp"
FORMAT_VERSION = 2  # 2: one container per rank's data file; 1: one container per item (still read)

_TOP_KEYS = {"format", "version", "dcp_version", "state_dict", "planner_data", "storage_meta", "items"}
# Positions a list may have beyond the keys stored under it: list elements that hold nothing
# (an empty dict) have no key of their own. Bounds what DCP allocates to rebuild lists.
_EMPTY_LIST_ELEMENTS = 64


def metadata_file(rank: int | None) -> str:
    """Name of the metadata file: one per checkpoint, or one per rank when DCP saves without
    collectives (``use_collectives=False``)."""
    return METADATA_FILE if rank is None else f"__{rank}{METADATA_FILE}"


@dataclass(frozen=True)
class StoredItem:
    """Where one DCP item is stored and how. Version 2: tensor ``tensor`` of the data file, a
    ``.ckz`` container holding all of a rank's items (``length``: its stored bytes). Version 1:
    ``length`` bytes at ``offset`` of the data file, one complete one-tensor ``.ckz`` container.
    ``pipeline`` (the tensor's transforms and stream codecs) and ``checksum`` copy what the
    container records, binding each stored tensor to its item, so one swapped with another
    item's is detected."""

    file: str
    offset: int
    length: int
    pipeline: dict[str, Any]
    checksum: str
    tensor: int | None = None


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


def check_planner_data(planner_data: Any) -> None:
    """Raise ``UnsupportedObjectError`` unless ``planner_data`` can be stored without pickling.

    DCP's default planners store ``None`` or a mapping from flattened keys to the key path in the
    original state dict (``dict[str, tuple[str | int, ...]]``); that is what ckptzip stores.
    """
    if planner_data is None:
        return
    if isinstance(planner_data, dict) and all(
        isinstance(k, str)
        and isinstance(v, (tuple, list))
        and all(isinstance(p, (str, int)) and not isinstance(p, bool) for p in v)
        for k, v in planner_data.items()
    ):
        return
    raise UnsupportedObjectError(
        f"the save planner produced planner_data of type {type(planner_data).__name__} that is not "
        "DCP's key mapping (dict[str, tuple[str | int, ...]]); ckptzip stores checkpoint metadata "
        "as plain data and does not pickle it. Use DCP's DefaultSavePlanner, or a planner whose "
        "planner_data is such a mapping."
    )


def encode_metadata(metadata: Metadata, items: dict[MetadataIndex, StoredItem]) -> bytes:
    """The metadata file for ``metadata`` with ``items`` as its storage data."""
    check_planner_data(metadata.planner_data)
    state_dict: dict[str, Any] = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            state_dict[fqn] = {
                "type": "tensor",
                "dtype": str(md.properties.dtype).removeprefix("torch."),
                "size": list(md.size),
                "chunks": [{"offsets": list(c.offsets), "sizes": list(c.sizes)} for c in md.chunks],
            }
        elif isinstance(md, BytesStorageMetadata):
            state_dict[fqn] = {"type": "bytes"}
        else:
            raise UnsupportedObjectError(
                f"state dict entry {fqn!r} has DCP storage metadata of type {type(md).__name__}, "
                "which this ckptzip does not know; expected tensor or bytes metadata"
            )
    storage_meta = getattr(metadata, "storage_meta", None)
    document = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "dcp_version": getattr(metadata, "version", None),
        "state_dict": state_dict,
        "planner_data": None
        if metadata.planner_data is None
        else {k: list(v) for k, v in metadata.planner_data.items()},
        "storage_meta": None
        if storage_meta is None
        else {
            "checkpoint_id": None if storage_meta.checkpoint_id is None else os.fspath(storage_meta.checkpoint_id),
            "save_id": storage_meta.save_id,
            "modules": list(getattr(storage_meta, "modules", [])),
        },
        "items": [
            {
                "fqn": index.fqn,
                "offset": None if index.offset is None else list(index.offset),
                "index": index.index,
                "file": item.file,
                "start": item.offset,
                "length": item.length,
                "pipeline": item.pipeline,
                "checksum": item.checksum,
                **({} if item.tensor is None else {"tensor": item.tensor}),
            }
            for index, item in items.items()
        ],
    }
    buffer = io.BytesIO()
    save(document, buffer)
    return buffer.getvalue()


class _Checker:
    """Typed access to the loaded metadata tree; every failure names the field and the file."""

    def __init__(self, file: str):
        self.file = file

    def fail(self, where: str, expected: str, found: Any) -> CorruptCheckpointError:
        shown = repr(found)
        if len(shown) > 80:
            shown = shown[:77] + "..."
        return CorruptCheckpointError(
            f"checkpoint metadata {self.file}: {where} must be {expected}, found {shown}; "
            "the file is damaged or was not written by ckptzip"
        )

    def get(self, obj: dict[str, Any], key: str, where: str) -> Any:
        if key not in obj:
            raise self.fail(f"{where}.{key}", "present", "nothing")
        return obj[key]

    def obj(self, value: Any, where: str) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise self.fail(where, "an object", value)
        return value

    def arr(self, value: Any, where: str) -> list[Any]:
        if not isinstance(value, list):
            raise self.fail(where, "an array", value)
        return value

    def text(self, value: Any, where: str, *, optional: bool = False) -> Any:
        if not (isinstance(value, str) or (optional and value is None)):
            raise self.fail(where, "a string" + (" or null" if optional else ""), value)
        return value

    def nat(self, value: Any, where: str, *, optional: bool = False) -> Any:
        if optional and value is None:
            return None
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise self.fail(where, "a non-negative integer" + (" or null" if optional else ""), value)
        return value

    def size(self, value: Any, where: str) -> torch.Size:
        return torch.Size(self.nat(v, f"{where}[{i}]") for i, v in enumerate(self.arr(value, where)))


def decode_metadata(data: bytes, file: str) -> Metadata:
    """Rebuild DCP ``Metadata`` (with :class:`StoredItem` storage data) from its metadata file."""
    try:
        document = load(io.BytesIO(data))
    except CorruptCheckpointError as exc:
        raise CorruptCheckpointError(f"checkpoint metadata {file} is damaged: {exc}") from exc
    c = _Checker(file)
    top = c.obj(document, "the document")
    if top.get("format") != FORMAT:
        raise c.fail("field 'format'", repr(FORMAT), top.get("format"))
    version = c.nat(c.get(top, "version", "document"), "field 'version'")
    if version not in (1, FORMAT_VERSION):
        raise UnsupportedFormatError(
            f"checkpoint metadata {file} has ckptzip-dcp version {version}; this ckptzip reads "
            f"versions 1 and {FORMAT_VERSION}. Upgrade ckptzip to load this checkpoint."
        )
    unknown = set(top) - _TOP_KEYS
    if unknown:
        raise c.fail("the document", f"an object with keys {sorted(_TOP_KEYS)}", sorted(unknown))

    metadata = Metadata(
        state_dict_metadata={
            fqn: _entry_from_tree(c, entry, f"state_dict[{fqn!r}]")
            for fqn, entry in c.obj(c.get(top, "state_dict", "document"), "state_dict").items()
        },
        planner_data=_planner_data_from_tree(c, c.get(top, "planner_data", "document")),
        storage_data=_items_from_tree(c, c.get(top, "items", "document"), version),
    )
    _check_tensors(c, metadata.state_dict_metadata, metadata.storage_data)
    if metadata.planner_data is not None:
        _check_list_positions(c, metadata.planner_data)
        _check_planner_keys(c, metadata.planner_data, metadata.state_dict_metadata)
    # Set after construction: older torch releases have no such constructor arguments.
    metadata.storage_meta = _storage_meta_from_tree(c, c.get(top, "storage_meta", "document"))
    metadata.version = c.text(c.get(top, "dcp_version", "document"), "field 'dcp_version'", optional=True)
    return metadata


def _entry_from_tree(c: _Checker, entry: Any, where: str) -> TensorStorageMetadata | BytesStorageMetadata:
    entry = c.obj(entry, where)
    kind = c.get(entry, "type", where)
    if kind == "bytes":
        return BytesStorageMetadata()
    if kind != "tensor":
        raise c.fail(f"{where}.type", "'tensor' or 'bytes'", kind)
    dtype_name = c.get(entry, "dtype", where)
    if not isinstance(dtype_name, str) or dtype_name not in TORCH_DTYPES:
        raise c.fail(f"{where}.dtype", "a torch dtype name", dtype_name)
    chunks = []
    for i, chunk in enumerate(c.arr(c.get(entry, "chunks", where), f"{where}.chunks")):
        at = f"{where}.chunks[{i}]"
        chunk = c.obj(chunk, at)
        chunks.append(
            ChunkStorageMetadata(
                offsets=c.size(c.get(chunk, "offsets", at), f"{at}.offsets"),
                sizes=c.size(c.get(chunk, "sizes", at), f"{at}.sizes"),
            )
        )
    return TensorStorageMetadata(
        properties=TensorProperties(dtype=TORCH_DTYPES[dtype_name]),
        size=c.size(c.get(entry, "size", where), f"{where}.size"),
        chunks=chunks,
    )


def _check_tensors(c: _Checker, entries: dict[str, Any], items: dict[MetadataIndex, StoredItem]) -> None:
    """Each tensor's chunks must tile it exactly (inside it, no overlaps, no gaps) and each must
    have a stored item: DCP allocates every tensor at its declared size before reading, and an
    uncovered region would reach the caller as uninitialised memory."""
    for fqn, md in entries.items():
        if not isinstance(md, TensorStorageMetadata):
            continue
        where = f"state_dict[{fqn!r}]"
        for i, chunk in enumerate(md.chunks):
            at = f"{where}.chunks[{i}]"
            if len(chunk.offsets) != len(md.size) or len(chunk.sizes) != len(md.size):
                raise c.fail(at, f"offsets and sizes of {len(md.size)} dimensions", chunk)
            if any(o + n > d for o, n, d in zip(chunk.offsets, chunk.sizes, md.size)):
                raise c.fail(at, f"inside the tensor's size {list(md.size)}", [list(chunk.offsets), list(chunk.sizes)])
            if MetadataIndex(fqn, chunk.offsets) not in items:
                raise c.fail(f"{at}.offsets", "the offsets of a stored item", list(chunk.offsets))
        covered = sum(math.prod(chunk.sizes) for chunk in md.chunks)
        if covered != math.prod(md.size):
            raise c.fail(f"{where}.chunks", f"chunks covering its {math.prod(md.size)} elements", covered)
        clash = _overlap([(chunk.offsets, chunk.sizes) for chunk in md.chunks])
        if clash is not None:
            raise c.fail(f"{where}.chunks", "chunks that do not overlap", clash)


def _overlap(chunks: list[tuple[Sequence[int], Sequence[int]]]) -> tuple[list[int], list[int]] | None:
    """Offsets of two overlapping non-empty chunks (offsets, sizes), or ``None``: a sweep along the
    dimension with the most distinct offsets (the sharded one), comparing only boxes that meet along it."""
    boxes = [(list(o), [a + n for a, n in zip(o, s)]) for o, s in chunks if math.prod(s) > 0]
    if len(boxes) < 2:
        return None
    ndim = len(boxes[0][0])
    if ndim == 0:
        return boxes[0][0], boxes[1][0]
    dim = max(range(ndim), key=lambda d: len({start[d] for start, _ in boxes}))
    active: list[tuple[list[int], list[int]]] = []
    for start, end in sorted(boxes, key=lambda box: box[0][dim]):
        active = [box for box in active if box[1][dim] > start[dim]]
        for other_start, other_end in active:
            if all(other_start[d] < end[d] and start[d] < other_end[d] for d in range(ndim)):
                return other_start, start
        active.append((start, end))
    return None


def _check_list_positions(c: _Checker, planner_data: dict[str, tuple[str | int, ...]]) -> None:
    """A list position in a key path must not exceed the keys stored under that list (plus a few
    empty elements): DCP fills a list with ``None`` up to each position it rebuilds."""
    highest: dict[tuple[str | int, ...], tuple[int, str]] = {}
    keys: dict[tuple[str | int, ...], int] = {}
    for key, path in planner_data.items():
        for depth in range(1, len(path)):
            position = path[depth]
            if isinstance(position, int):
                prefix = path[:depth]
                keys[prefix] = keys.get(prefix, 0) + 1
                if position >= highest.get(prefix, (-1, ""))[0]:
                    highest[prefix] = (position, key)
    for prefix, (position, key) in highest.items():
        if position >= keys[prefix] + _EMPTY_LIST_ELEMENTS:
            raise c.fail(
                f"planner_data[{key!r}]",
                f"a path whose list positions fit the {keys[prefix]} keys stored under that list",
                position,
            )


def _check_planner_keys(c: _Checker, planner_data: dict[str, tuple[str | int, ...]], entries: dict[str, Any]) -> None:
    """DCP's planner maps each stored key to the path it was flattened from: every stored key has
    a path, the path joins to the key, and the key is stored; otherwise the load planner asks for
    entries that do not exist."""
    for key, path in planner_data.items():
        if ".".join(map(str, path)) != key:
            raise c.fail(f"planner_data[{key!r}]", "the path whose parts join to its key", list(path))
        if key not in entries:
            raise c.fail(f"planner_data[{key!r}]", "the key of a stored state_dict entry", key)
    unmapped = sorted(set(entries) - set(planner_data))
    if planner_data and unmapped:  # an empty mapping: a planner that did not flatten
        raise c.fail("planner_data", "a path for every stored state_dict entry", f"none for {unmapped[:3]}")


def _planner_data_from_tree(c: _Checker, raw: Any) -> dict[str, tuple[str | int, ...]] | None:
    if raw is None:
        return None
    return {
        key: tuple(
            p if isinstance(p, str) else c.nat(p, f"planner_data[{key!r}][{i}]")
            for i, p in enumerate(c.arr(path, f"planner_data[{key!r}]"))
        )
        for key, path in c.obj(raw, "planner_data").items()
    }


def _items_from_tree(c: _Checker, raw: Any, version: int) -> dict[MetadataIndex, StoredItem]:
    items: dict[MetadataIndex, StoredItem] = {}
    for i, item in enumerate(c.arr(raw, "items")):
        where = f"items[{i}]"
        item = c.obj(item, where)
        offset = c.get(item, "offset", where)
        index = MetadataIndex(
            fqn=c.text(c.get(item, "fqn", where), f"{where}.fqn"),
            offset=None if offset is None else c.size(offset, f"{where}.offset"),
            index=c.nat(c.get(item, "index", where), f"{where}.index", optional=True),
        )
        items[index] = StoredItem(
            file=check_name(c.get(item, "file", where), f"checkpoint metadata {c.file}, {where}"),
            offset=c.nat(c.get(item, "start", where), f"{where}.start"),
            length=c.nat(c.get(item, "length", where), f"{where}.length"),
            pipeline=c.obj(c.get(item, "pipeline", where), f"{where}.pipeline"),
            checksum=c.text(c.get(item, "checksum", where), f"{where}.checksum"),
            tensor=c.nat(c.get(item, "tensor", where), f"{where}.tensor") if version >= 2 else None,
        )
    return items


def _storage_meta_from_tree(c: _Checker, raw: Any) -> StorageMeta | None:
    if raw is None:
        return None
    raw = c.obj(raw, "storage_meta")
    meta = StorageMeta(
        checkpoint_id=c.text(c.get(raw, "checkpoint_id", "storage_meta"), "storage_meta.checkpoint_id", optional=True),
        save_id=c.text(c.get(raw, "save_id", "storage_meta"), "storage_meta.save_id", optional=True),
    )
    meta.modules = [
        c.text(m, f"storage_meta.modules[{i}]")
        for i, m in enumerate(c.arr(c.get(raw, "modules", "storage_meta"), "storage_meta.modules"))
    ]
    return meta
