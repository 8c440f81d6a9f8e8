"""The JSON index: dataclasses, serialization and strict validation (docs/FORMAT.md, "Index")."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import strictjson
from ..errors import CorruptCheckpointError, UnsupportedFormatError, UnsupportedObjectError
from ..transforms import get_transform
from .spec import DTYPES, FORMAT_NAME, KNOWN_MINORS, MAX_CHUNK_RAW, MAX_DIMS, PREAMBLE_SIZE, READABLE_MAJORS, VERSION

_TOP_KEYS = {"format", "version", "writer", "tree", "tensors", "bases"}
_TENSOR_KEYS = {"name", "dtype", "shape", "nbytes", "checksum", "transforms", "streams"}
_TENSOR_OPTIONAL = {"device"}
_STREAM_KEYS = {"codec", "nbytes", "chunks"}


@dataclass(frozen=True)
class Chunk:
    """``length`` stored bytes at ``offset`` that decode to ``raw_length`` bytes; ``digest`` is the
    checksum of the stored bytes (16 hex digits: wsum64 in format 2, XXH3-64 in format 1)."""

    offset: int
    length: int
    raw_length: int
    digest: str

    def to_json(self) -> list[int | str]:
        return [self.offset, self.length, self.raw_length, self.digest]


@dataclass
class StreamEntry:
    """One output stream of a tensor's transforms, coded by one codec, in chunks."""

    codec: dict[str, Any]
    nbytes: int
    chunks: list[Chunk] = field(default_factory=list)

    @property
    def compressed_nbytes(self) -> int:
        return sum(c.length for c in self.chunks)

    def to_json(self) -> dict[str, Any]:
        return {"codec": self.codec, "nbytes": self.nbytes, "chunks": [c.to_json() for c in self.chunks]}


@dataclass
class TensorEntry:
    """One row of the tensor table."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    checksum: str
    transforms: list[dict[str, Any]]
    streams: list[StreamEntry]
    device: str | None = None

    @property
    def compressed_nbytes(self) -> int:
        return sum(s.compressed_nbytes for s in self.streams)

    @property
    def codecs(self) -> list[str]:
        """Codec id of each stream, in order."""
        return [s.codec["id"] for s in self.streams]

    def to_json(self) -> dict[str, Any]:
        out = {
            "name": self.name,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "nbytes": self.nbytes,
            "checksum": self.checksum,
            "transforms": self.transforms,
            "streams": [s.to_json() for s in self.streams],
        }
        if self.device is not None:
            out["device"] = self.device
        return out


@dataclass
class Index:
    """The whole index of a file."""

    tree: Any
    tensors: list[TensorEntry]
    writer: str
    version: tuple[int, int] = VERSION

    def to_json(self) -> bytes:
        doc = {
            "format": FORMAT_NAME,
            "version": list(self.version),
            "writer": self.writer,
            "tree": self.tree,
            "tensors": [t.to_json() for t in self.tensors],
            "bases": [],
        }
        try:
            return json.dumps(doc, separators=(",", ":"), allow_nan=False).encode("utf-8")
        except (RecursionError, ValueError) as exc:  # nesting past the interpreter's limit, huge ints
            raise UnsupportedObjectError(f"the saved object cannot be written as JSON: {exc}") from None

    @classmethod
    def parse(cls, raw: bytes, data_end: int) -> Index:
        """Parse and validate index bytes of a file whose data section ends at ``data_end``."""
        doc = strictjson.loads(raw, "the index")
        _expect(isinstance(doc, dict), "the index is not a JSON object")
        version = doc.get("version")
        _expect(_is_int_list(version, 2), f"index 'version' is {version!r:.40}, expected [major, minor]")
        if version[0] not in READABLE_MAJORS:
            raise UnsupportedFormatError(
                f"index format version {version[0]}.{version[1]}; this ckptzip reads versions "
                f"{', '.join(f'{m}.x' for m in READABLE_MAJORS)}. Install a ckptzip release that supports it."
            )
        if version[1] <= KNOWN_MINORS[version[0]]:
            _check_keys(doc, _TOP_KEYS, set(), "index")
        else:
            _expect(_TOP_KEYS <= set(doc), f"index lacks keys {sorted(_TOP_KEYS - set(doc))}")
        _expect(doc["format"] == FORMAT_NAME, f"index 'format' is {doc['format']!r:.40}, expected {FORMAT_NAME!r}")
        if doc["bases"] != []:
            raise UnsupportedFormatError(
                "this checkpoint is stored relative to other checkpoints ('bases'), which this ckptzip "
                "cannot read; upgrade ckptzip"
            )
        _expect(isinstance(doc["writer"], str), "index 'writer' is not a string")
        _expect(isinstance(doc["tensors"], list), "index 'tensors' is not an array")
        tensors = [_parse_tensor(t, i) for i, t in enumerate(doc["tensors"])]
        _check_tiling(tensors, data_end, table_order=version[0] == 1)
        names = [t.name for t in tensors]
        _expect(len(set(names)) == len(names), "tensor names in the index are not unique")
        return cls(doc["tree"], tensors, doc["writer"], (version[0], version[1]))


def _expect(condition: bool, message: str) -> None:
    if not condition:
        raise CorruptCheckpointError(f"{message}; the file is damaged or was not written by ckptzip")


def _is_int(v: Any, lo: int = 0, hi: int = 1 << 63) -> bool:
    return type(v) is int and lo <= v <= hi


def _is_int_list(v: Any, length: int | None = None) -> bool:
    return isinstance(v, list) and (length is None or len(v) == length) and all(_is_int(x) for x in v)


def _check_keys(obj: dict[str, Any], required: set[str], optional: set[str], what: str) -> None:
    keys = set(obj)
    _expect(required <= keys, f"{what} lacks keys {sorted(required - keys)}")
    _expect(keys <= required | optional, f"{what} has unknown keys {sorted(keys - required - optional)}")


_HEX = re.compile(r"[0-9a-f]*")


def _is_hex(v: Any, digits: int) -> bool:
    return isinstance(v, str) and len(v) == digits and _HEX.fullmatch(v) is not None


def _is_device(v: Any) -> bool:
    if not isinstance(v, str):
        return False
    try:
        torch.device(v)
    except RuntimeError:
        return False
    return True


def _parse_tensor(doc: Any, i: int) -> TensorEntry:
    _expect(isinstance(doc, dict), f"tensor table entry {i} is not an object")
    _check_keys(doc, _TENSOR_KEYS, _TENSOR_OPTIONAL, f"tensor table entry {i}")
    name = doc["name"]
    _expect(isinstance(name, str) and name != "", f"tensor table entry {i} has no name")
    what = f"tensor {name!r}"
    dtype = doc["dtype"]
    _expect(isinstance(dtype, str), f"{what} has dtype {dtype!r:.40}, expected a dtype name")
    if dtype not in DTYPES:
        raise UnsupportedFormatError(f"{what} has dtype {dtype!r:.40}, which this torch build does not have")
    shape = doc["shape"]
    _expect(
        _is_int_list(shape) and len(shape) <= MAX_DIMS and all(x < 1 << 62 for x in shape),
        f"{what} has shape {shape!r:.80}, expected a list of at most {MAX_DIMS} sizes",
    )
    itemsize = DTYPES[dtype].itemsize
    nbytes = doc["nbytes"]
    _expect(_is_int(nbytes), f"{what} has nbytes {nbytes!r:.40}")
    _expect(math.prod(shape) * itemsize == nbytes, f"{what}: shape {shape} of {dtype} is not {nbytes} bytes")
    checksum = doc["checksum"]
    _expect(
        isinstance(checksum, str) and checksum.startswith("wsum64:") and _is_hex(checksum[7:], 16),
        f"{what} has checksum {checksum!r:.40}, expected 'wsum64:' and 16 hex digits",
    )
    device = doc.get("device")
    _expect(device is None or _is_device(device), f"{what} has device {device!r:.40}, expected a torch device string")
    transforms = doc["transforms"]
    _expect(isinstance(transforms, list) and len(transforms) <= 1, f"{what} has transforms {transforms!r:.80}")
    sizes = [nbytes]
    for config in transforms:
        transform = get_transform(config)
        item = getattr(transform, "itemsize", itemsize)
        _expect(item == itemsize, f"{what}: transform {config} does not match the {itemsize}-byte {dtype}")
        sizes = [s for size in sizes for s in transform.stream_sizes(size)]
    streams = doc["streams"]
    _expect(isinstance(streams, list), f"{what} has no stream list")
    _expect(len(streams) == len(sizes), f"{what} has {len(streams)} streams, its transforms make {len(sizes)}")
    parsed = [_parse_stream(s, size, f"{what} stream {j}") for j, (s, size) in enumerate(zip(streams, sizes))]
    return TensorEntry(name, dtype, tuple(shape), nbytes, checksum, transforms, parsed, device)


def _parse_stream(doc: Any, expected_nbytes: int, what: str) -> StreamEntry:
    _expect(isinstance(doc, dict), f"{what} is not an object")
    _check_keys(doc, _STREAM_KEYS, set(), what)
    codec = doc["codec"]
    _expect(isinstance(codec, dict) and isinstance(codec.get("id"), str), f"{what} has codec {codec!r:.80}")
    _expect(doc["nbytes"] == expected_nbytes, f"{what} has nbytes {doc['nbytes']!r:.40}, expected {expected_nbytes}")
    chunks = doc["chunks"]
    _expect(isinstance(chunks, list), f"{what} has no chunk list")
    if not _chunks_valid(chunks):  # find the first bad one, for the message
        for k, c in enumerate(chunks):
            ok = (
                isinstance(c, list)
                and len(c) == 4
                and _is_int(c[0])
                and _is_int(c[1], 1)
                and _is_int(c[2], 1, MAX_CHUNK_RAW)
                and _is_hex(c[3], 16)
            )
            _expect(ok, f"{what} chunk {k} is {c!r:.80}, expected [offset, length, raw_length, xxh3]")
    parsed = [Chunk(*c) for c in chunks]
    total = sum(c.raw_length for c in parsed)
    _expect(total == expected_nbytes, f"{what}: chunks decode to {total} bytes, expected {expected_nbytes}")
    if codec["id"] == "raw":
        _expect(all(c.length == c.raw_length for c in parsed), f"{what}: a raw chunk's stored and decoded sizes differ")
    return StreamEntry(codec, expected_nbytes, parsed)


def _chunks_valid(chunks: list[Any]) -> bool:
    """Every chunk is [offset, length, raw_length, digest] within bounds (a few passes over the
    columns: indexes of large states list tens of thousands of chunks)."""
    if not all(type(c) is list and len(c) == 4 for c in chunks):
        return False
    if not chunks:
        return True
    offsets, lengths, raws, digests = zip(*chunks)
    return (
        all(type(v) is int for column in (offsets, lengths, raws) for v in column)
        and min(offsets) >= 0 and max(offsets) <= 1 << 63
        and min(lengths) >= 1 and max(lengths) <= 1 << 63
        and min(raws) >= 1 and max(raws) <= MAX_CHUNK_RAW
        and all(type(d) is str and len(d) == 16 for d in digests)
        and _HEX.fullmatch("".join(digests)) is not None
    )


def _check_tiling(tensors: list[TensorEntry], data_end: int, table_order: bool) -> None:
    """Chunks tile the data section: in table order (format 1), or in offset order with each
    stream's chunks back to back (format 2)."""
    chunks = [(c, t, j, k) for t in tensors for j, s in enumerate(t.streams) for k, c in enumerate(s.chunks)]
    if not table_order:
        for t in tensors:
            for j, s in enumerate(t.streams):
                for k in range(1, len(s.chunks)):
                    prev, c = s.chunks[k - 1], s.chunks[k]
                    _expect(
                        c.offset == prev.offset + prev.length,
                        f"tensor {t.name!r} stream {j} chunk {k} starts at {c.offset}, expected "
                        f"{prev.offset + prev.length} (a stream's chunks lie back to back)",
                    )
        chunks.sort(key=lambda item: item[0].offset)
    position = PREAMBLE_SIZE
    for c, t, j, k in chunks:
        _expect(
            c.offset == position,
            f"tensor {t.name!r} stream {j} chunk {k} starts at {c.offset}, expected {position} "
            "(chunks must tile the data section)",
        )
        position += c.length
    _expect(position == data_end, f"chunks end at {position} but the data section ends at {data_end}")
