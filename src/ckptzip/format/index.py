"""The JSON index: dataclasses, serialization and strict validation (docs/FORMAT.md, "Index")."""

from __future__ import annotations

import contextlib
import functools
import gc
import json
import math
import re
from dataclasses import dataclass, field
from collections.abc import Iterator
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt
import torch
import xxhash

from .. import strictjson
from ..errors import CorruptCheckpointError, UnsupportedFormatError, UnsupportedObjectError
from ..transforms import Transform, get_transform
from .spec import (
    DTYPES, FORMAT_NAME, KNOWN_MINORS, MAX_CHUNK_RAW, MAX_DIMS, PREAMBLE_SIZE, READABLE_MAJORS, VERSION,
    VERSION_SOURCES, VERSION_SPARSE,
)

_TOP_KEYS = {"format", "version", "writer", "tree", "tensors", "bases"}
_TENSOR_KEYS = {"name", "dtype", "shape", "nbytes", "checksum", "transforms", "streams"}
_TENSOR_OPTIONAL = {"device"}
_TENSOR_OPTIONAL_2_1 = {"device", "source"}
_STREAM_KEYS = {"codec", "nbytes", "chunks"}
_BASE_KEYS = {"step", "name", "content_hash"}
CAST_DTYPES = ("bfloat16", "float16")  # what a "cast" source may produce, from float32


class Chunk(NamedTuple):
    """``length`` stored bytes at ``offset`` that decode to ``raw_length`` bytes; ``digest`` is the
    checksum of the stored bytes (16 hex digits: wsum64 in format 2, XXH3-64 in format 1)."""

    offset: int
    length: int
    raw_length: int
    digest: str


def digest_hexes(values: npt.NDArray[np.uint64]) -> list[str]:
    """Chunk digests as the index writes them, 16 hex digits each (what :meth:`ChunkColumns.of`
    reads back); one conversion for all of them."""
    text = values.astype(">u8").tobytes().hex()
    return [text[i : i + 16] for i in range(0, len(text), 16)]


@dataclass(frozen=True)
class ChunkColumns:
    """The chunks of a stream as arrays, for code that handles thousands of chunks at once."""

    offset: npt.NDArray[np.int64]
    length: npt.NDArray[np.int64]
    raw_length: npt.NDArray[np.int64]
    digest: npt.NDArray[np.uint64]

    @classmethod
    def of(cls, chunks: list[Chunk]) -> ChunkColumns:
        if not chunks:
            empty = np.zeros(0, dtype=np.int64)
            return cls(empty, empty, empty, np.zeros(0, dtype=np.uint64))
        offset, length, raw, digests = zip(*chunks)
        digest = np.frombuffer(bytes.fromhex("".join(digests)), dtype=">u8").astype(np.uint64)
        return cls(np.array(offset, dtype=np.int64), np.array(length, dtype=np.int64), np.array(raw, dtype=np.int64),
                   digest)

    def split(self, counts: list[int]) -> list[ChunkColumns]:
        """Consecutive parts of ``counts`` chunks each (views, no copies)."""
        ends = np.cumsum(counts)
        return [ChunkColumns(self.offset[a:b], self.length[a:b], self.raw_length[a:b], self.digest[a:b])
                for a, b in zip((ends - counts).tolist(), ends.tolist())]


@dataclass
class StreamEntry:
    """One output stream of a tensor's transforms, coded by one codec, in chunks."""

    codec: dict[str, Any]
    nbytes: int
    chunks: list[Chunk] = field(default_factory=list)  # not changed once the entry is made

    @functools.cached_property
    def columns(self) -> ChunkColumns:
        """The chunks as arrays (made once per entry)."""
        return ChunkColumns.of(self.chunks)

    @property
    def compressed_nbytes(self) -> int:
        return sum(c.length for c in self.chunks)

    def to_json(self) -> dict[str, Any]:
        # a chunk is a tuple, which JSON writes as the array [offset, length, raw_length, digest]
        return {"codec": self.codec, "nbytes": self.nbytes, "chunks": list(self.chunks)}


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
    source: dict[str, Any] | None = None  # format 2.1: {"copy": i}, {"cast": i} or {"xor": {...}}

    @property
    def compressed_nbytes(self) -> int:
        return sum(s.compressed_nbytes for s in self.streams)

    @property
    def source_kind(self) -> str | None:
        """``"copy"``, ``"cast"``, ``"xor"``, or None for a tensor stored as itself."""
        return next(iter(self.source)) if self.source else None

    @property
    def source_target(self) -> Any:
        """What the source names: a table position (copy, cast), the delta's description (xor),
        or None for a tensor stored as itself."""
        return next(iter(self.source.values())) if self.source else None

    @property
    def is_reference(self) -> bool:
        """Whether the tensor has no stored bytes of its own (a copy or a cast of another entry)."""
        return self.source_kind in ("copy", "cast")

    @property
    def codecs(self) -> list[str]:
        """Codec id of each stream, in order."""
        return [s.codec["id"] for s in self.streams]

    @functools.cached_property
    def transform(self) -> Transform | None:
        """The transform the tensor's bytes went through before their streams were coded
        (:class:`~ckptzip.transforms.BytePlanes`, :class:`~ckptzip.transforms.Sparse`), or None
        for a tensor stored as one stream: what the decoder, the reader and ``report`` go by."""
        return get_transform(self.transforms[0]) if self.transforms else None

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
        if self.source is not None:
            out["source"] = self.source
        return out


@dataclass(frozen=True)
class BaseRef:
    """A checkpoint that tensors of this one are stored relative to (format 2.1, ``bases``)."""

    step: int | None
    name: str
    content_hash: str

    def to_json(self) -> dict[str, Any]:
        return {"step": self.step, "name": self.name, "content_hash": self.content_hash}

    def describe(self) -> str:
        step = "" if self.step is None else f"step {self.step}, "
        return f"{step}{self.name!r}, content hash {self.content_hash}"


def content_hash(tensors: list[TensorEntry]) -> str:
    """XXH3-64 of a checkpoint's tensor content: names, dtypes, shapes, checksums (FORMAT.md, 2.1)."""
    h = xxhash.xxh3_64()
    for t in tensors:
        h.update(json.dumps([t.name, t.dtype, list(t.shape), t.checksum], separators=(",", ":")).encode("ascii"))
        h.update(b"\n")
    return h.hexdigest()


@dataclass
class Index:
    """The whole index of a file."""

    tree: Any
    tensors: list[TensorEntry]
    writer: str
    version: tuple[int, int] = VERSION
    bases: list[BaseRef] = field(default_factory=list)

    def to_json(self) -> bytes:
        doc = {
            "format": FORMAT_NAME,
            "version": list(self.version),
            "writer": self.writer,
            "tree": self.tree,
            "tensors": [t.to_json() for t in self.tensors],
            "bases": [b.to_json() for b in self.bases],
        }
        try:
            return json.dumps(doc, separators=(",", ":"), allow_nan=False).encode("utf-8")
        except (RecursionError, ValueError) as exc:  # nesting past the interpreter's limit, huge ints
            raise UnsupportedObjectError(f"the saved object cannot be written as JSON: {exc}") from None

    @classmethod
    def parse(cls, raw: bytes, data_end: int) -> Index:
        """Parse and validate index bytes of a file whose data section ends at ``data_end``."""
        with _no_collection():
            return cls._parse(raw, data_end)

    @classmethod
    def _parse(cls, raw: bytes, data_end: int) -> Index:
        doc = strictjson.loads(raw, "the index")
        if not isinstance(doc, dict):
            raise _corrupt("the index is not a JSON object")
        version: Any = doc.get("version")
        if not _is_int_list(version, 2):
            raise _corrupt(f"index 'version' is {version!r:.40}, expected [major, minor]")
        if version[0] not in READABLE_MAJORS:
            raise UnsupportedFormatError(
                f"index format version {version[0]}.{version[1]}; this ckptzip reads versions "
                f"{', '.join(f'{m}.x' for m in READABLE_MAJORS)}. Install a ckptzip release that supports it."
            )
        if version[1] <= KNOWN_MINORS[version[0]]:
            _check_keys(doc, _TOP_KEYS, set(), "index")
        else:
            if not set(doc) >= _TOP_KEYS:
                raise _corrupt(f"index lacks keys {sorted(_TOP_KEYS - set(doc))}")
        if doc["format"] != FORMAT_NAME:
            raise _corrupt(f"index 'format' is {doc['format']!r:.40}, expected {FORMAT_NAME!r}")
        sources = tuple(version) >= VERSION_SOURCES
        if doc["bases"] != [] and not sources:
            raise UnsupportedFormatError(
                "this checkpoint is stored relative to other checkpoints ('bases'), which this ckptzip "
                "cannot read; upgrade ckptzip"
            )
        if not isinstance(doc["bases"], list):
            raise _corrupt("index 'bases' is not an array")
        bases = [_parse_base(b, i) for i, b in enumerate(doc["bases"])]
        if not isinstance(doc["writer"], str):
            raise _corrupt("index 'writer' is not a string")
        if not isinstance(doc["tensors"], list):
            raise _corrupt("index 'tensors' is not an array")
        later = version[1] > KNOWN_MINORS[version[0]]
        chunk_lists = _ChunkLists()
        sparse = tuple(version) >= VERSION_SPARSE
        tensors = [_parse_tensor(t, i, chunk_lists, sources, later, sparse) for i, t in enumerate(doc["tensors"])]
        everything, counts = chunk_lists.finish()
        _check_tiling(tensors, everything, counts, data_end, table_order=version[0] == 1)
        names = [t.name for t in tensors]
        if len(set(names)) != len(names):
            raise _corrupt("tensor names in the index are not unique")
        _check_sources(tensors, len(bases))
        return cls(doc["tree"], tensors, doc["writer"], (version[0], version[1]), bases)


@contextlib.contextmanager
def _no_collection() -> Iterator[None]:
    """Pause the cyclic garbage collector: an index of a large state is hundreds of thousands of
    new, acyclic objects, whose allocations would otherwise set off full collections of the
    caller's whole heap (the parse of a 10k-chunk index took 3x as long with them)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _corrupt(message: str) -> CorruptCheckpointError:
    """The error for a damaged index; its message is built only when a check fails (tens of
    thousands of checks pass on every load)."""
    return CorruptCheckpointError(f"{message}; the file is damaged or was not written by ckptzip")


def _is_int(v: Any, lo: int = 0, hi: int = 1 << 63) -> bool:
    return type(v) is int and lo <= v <= hi


def _is_int_list(v: Any, length: int | None = None) -> bool:
    return isinstance(v, list) and (length is None or len(v) == length) and all(_is_int(x) for x in v)


def _check_keys(obj: dict[str, Any], required: set[str], optional: set[str], what: str) -> None:
    keys = set(obj)
    if not required <= keys:
        raise _corrupt(f"{what} lacks keys {sorted(required - keys)}")
    if not keys <= required | optional:
        raise _corrupt(f"{what} has unknown keys {sorted(keys - required - optional)}")


_HEX = re.compile(r"[0-9a-f]*")


def _is_hex(v: Any, digits: int) -> bool:
    return isinstance(v, str) and len(v) == digits and _HEX.fullmatch(v) is not None


def _is_device(v: Any) -> bool:
    """A torch device string of a device that holds data (not ``meta``, where tensors have none)."""
    if not isinstance(v, str):
        return False
    try:
        return torch.device(v).type != "meta"
    except RuntimeError:
        return False


def _parse_base(doc: Any, i: int) -> BaseRef:
    what = f"base {i}"
    if not isinstance(doc, dict):
        raise _corrupt(f"{what} is not an object")
    _check_keys(doc, _BASE_KEYS, set(), what)
    step, name = doc["step"], doc["name"]
    if not (step is None or _is_int(step)):
        raise _corrupt(f"{what} has step {step!r:.40}, expected an integer or null")
    if not (isinstance(name, str) and name != ""):
        raise _corrupt(f"{what} has name {name!r:.80}, expected a file name")
    if not _is_hex(doc["content_hash"], 16):
        raise _corrupt(f"{what} has content_hash {doc['content_hash']!r:.40}")
    return BaseRef(step, name, doc["content_hash"])


def _parse_tensor(doc: Any, i: int, chunk_lists: _ChunkLists, sources: bool = False, later: bool = False,
                  sparse: bool = False) -> TensorEntry:
    if not isinstance(doc, dict):
        raise _corrupt(f"tensor table entry {i} is not an object")
    optional = _TENSOR_OPTIONAL_2_1 if sources else _TENSOR_OPTIONAL
    if later and not set(doc) <= _TENSOR_KEYS | optional:
        raise UnsupportedFormatError(
            f"tensor table entry {i} has keys {sorted(set(doc) - _TENSOR_KEYS - optional)!r:.80} of a later "
            "format version than this ckptzip reads; upgrade ckptzip"
        )
    _check_keys(doc, _TENSOR_KEYS, optional, f"tensor table entry {i}")
    name = doc["name"]
    if not (isinstance(name, str) and name != ""):
        raise _corrupt(f"tensor table entry {i} has no name")
    what = f"tensor {name!r}"
    dtype = doc["dtype"]
    if not isinstance(dtype, str):
        raise _corrupt(f"{what} has dtype {dtype!r:.40}, expected a dtype name")
    if dtype not in DTYPES:
        raise UnsupportedFormatError(f"{what} has dtype {dtype!r:.40}, which this torch build does not have")
    shape = doc["shape"]
    if not (_is_int_list(shape) and len(shape) <= MAX_DIMS and all(x < 1 << 62 for x in shape)):
        raise _corrupt(f"{what} has shape {shape!r:.80}, expected a list of at most {MAX_DIMS} sizes")
    itemsize = DTYPES[dtype].itemsize
    nbytes = doc["nbytes"]
    if not _is_int(nbytes):
        raise _corrupt(f"{what} has nbytes {nbytes!r:.40}")
    if math.prod(shape) * itemsize != nbytes:
        raise _corrupt(f"{what}: shape {shape} of {dtype} is not {nbytes} bytes")
    checksum = doc["checksum"]
    if not (isinstance(checksum, str) and checksum.startswith("wsum64:") and _is_hex(checksum[7:], 16)):
        raise _corrupt(f"{what} has checksum {checksum!r:.40}, expected 'wsum64:' and 16 hex digits")
    device = doc.get("device")
    if not (device is None or _is_device(device)):
        raise _corrupt(f"{what} has device {device!r:.40}, expected a torch device string of a device that holds data (not 'meta')")
    source = _parse_source(doc["source"], what) if "source" in doc else None
    transforms = doc["transforms"]
    if source is not None and next(iter(source)) != "xor":
        if not (transforms == [] and doc["streams"] == []):
            raise _corrupt(f"{what} is a {next(iter(source))} of another tensor but has transforms or streams")
        return TensorEntry(name, dtype, tuple(shape), nbytes, checksum, [], [], device, source)
    if not (isinstance(transforms, list) and len(transforms) <= 1):
        raise _corrupt(f"{what} has transforms {transforms!r:.80}")
    transform = get_transform(transforms[0]) if transforms else None
    sizes = [nbytes]
    if transform is not None:
        if transform.transform_id == "sparse" and not sparse:
            raise _corrupt(f"{what} has the sparse transform of format {VERSION_SPARSE[0]}.{VERSION_SPARSE[1]}, in a "
                           "file of an earlier version")
        item = getattr(transform, "itemsize", itemsize)
        if item != itemsize:
            raise _corrupt(f"{what}: transform {transforms[0]} does not match the {itemsize}-byte {dtype}")
        sizes = transform.stream_sizes(nbytes)
    streams = doc["streams"]
    if not isinstance(streams, list):
        raise _corrupt(f"{what} has no stream list")
    if len(streams) != len(sizes):
        raise _corrupt(f"{what} has {len(streams)} streams, its transforms make {len(sizes)}")
    parsed = [_parse_stream(s, size, f"{what} stream {j}", chunk_lists) for j, (s, size) in enumerate(zip(streams, sizes))]
    entry = TensorEntry(name, dtype, tuple(shape), nbytes, checksum, transforms, parsed, device, source)
    entry.__dict__["transform"] = transform  # what the cached property would build again
    return entry


def _is_checksum(v: Any) -> bool:
    return isinstance(v, str) and v.startswith("wsum64:") and _is_hex(v[7:], 16)


def _parse_source(doc: Any, what: str) -> dict[str, Any]:
    if not (isinstance(doc, dict) and len(doc) == 1):
        raise _corrupt(f"{what} has source {doc!r:.80}, expected an object of one kind")
    kind, body = next(iter(doc.items()))
    if kind in ("copy", "cast"):
        if not _is_int(body):
            raise _corrupt(f"{what} has source {doc!r:.80}, expected a table position")
    elif kind == "xor":
        ok = (isinstance(body, dict) and set(body) == {"base", "tensor", "checksum"} and _is_int(body["base"])
              and isinstance(body["tensor"], str) and _is_checksum(body["checksum"]))
        if not ok:
            raise _corrupt(f"{what} has source {doc!r:.80}, expected {{'xor': {{'base', 'tensor', 'checksum'}}}}")
    else:
        raise UnsupportedFormatError(f"{what} has source kind {kind!r:.40}, which this ckptzip does not know; upgrade ckptzip")
    return {kind: body}


def _check_sources(tensors: list[TensorEntry], nbases: int) -> None:
    """References point at entries that can be rebuilt first, with matching sizes (FORMAT.md, 2.1)."""
    for t in tensors:
        kind = t.source_kind
        if kind is None:
            continue
        what = f"tensor {t.name!r}"
        if kind == "xor":
            base = t.source_target["base"]
            if base >= nbases:
                raise _corrupt(f"{what} is a delta against base {base}, but the file lists {nbases} bases")
            continue
        i = t.source_target
        if i >= len(tensors):
            raise _corrupt(f"{what} is a {kind} of table entry {i}, which does not exist")
        target = tensors[i]
        if target is t:
            raise _corrupt(f"{what} is a {kind} of itself")
        allowed = (None, "xor", "cast") if kind == "copy" else (None, "xor")
        if target.source_kind not in allowed:
            raise _corrupt(f"{what} is a {kind} of {target.name!r}, which is a {target.source_kind}")
        if kind == "copy":
            if not (target.nbytes == t.nbytes and target.checksum == t.checksum):
                raise _corrupt(f"{what} is a copy of {target.name!r}, whose size or checksum differs")
        else:
            if not (target.dtype == "float32" and target.shape == t.shape and t.dtype in CAST_DTYPES):
                raise _corrupt(f"{what} ({t.dtype}) is a cast of {target.name!r} ({target.dtype}), expected a "
                               f"float32 tensor of the same shape cast to one of {CAST_DTYPES}")


def _parse_stream(doc: Any, expected_nbytes: int, what: str, chunk_lists: _ChunkLists) -> StreamEntry:
    if not isinstance(doc, dict):
        raise _corrupt(f"{what} is not an object")
    _check_keys(doc, _STREAM_KEYS, set(), what)
    codec = doc["codec"]
    if not (isinstance(codec, dict) and isinstance(codec.get("id"), str)):
        raise _corrupt(f"{what} has codec {codec!r:.80}")
    if doc["nbytes"] != expected_nbytes:
        raise _corrupt(f"{what} has nbytes {doc['nbytes']!r:.40}, expected {expected_nbytes}")
    chunks = doc["chunks"]
    if not isinstance(chunks, list):
        raise _corrupt(f"{what} has no chunk list")
    entry = StreamEntry(codec, expected_nbytes)
    chunk_lists.add(entry, chunks, what)
    return entry


class _ChunkLists:
    """The chunk lists of every stream of an index, checked and turned into chunks and columns in
    a few passes over all of them at once (indexes of large states list tens of thousands)."""

    def __init__(self) -> None:
        self._streams: list[tuple[StreamEntry, list[Any], str]] = []

    def add(self, entry: StreamEntry, chunks: list[Any], what: str) -> None:
        self._streams.append((entry, chunks, what))

    def finish(self) -> tuple[ChunkColumns, list[int]]:
        """Check every chunk, fill in each stream's chunks and columns; return the columns of all
        chunks (in table order) and each stream's count of them."""
        everything = [c for _, chunks, _ in self._streams for c in chunks]
        if not _chunks_valid(everything):  # find the first bad one, for the message
            for _, chunks, what in self._streams:
                for k, c in enumerate(chunks):
                    ok = (
                        isinstance(c, list)
                        and len(c) == 4
                        and _is_int(c[0], 0, (1 << 63) - 1)
                        and _is_int(c[1], 1, (1 << 63) - 1)
                        and _is_int(c[2], 1, MAX_CHUNK_RAW)
                        and _is_hex(c[3], 16)
                    )
                    if not ok:
                        raise _corrupt(f"{what} chunk {k} is {c!r:.80}, expected [offset, length, raw_length, xxh3]")
        counts = np.array([len(chunks) for _, chunks, _ in self._streams], dtype=np.int64)
        columns = ChunkColumns.of(everything)
        ends = np.cumsum(counts)
        raw_before = np.concatenate([[0], np.cumsum(columns.raw_length)])
        decoded = raw_before[ends] - raw_before[ends - counts]
        expected = np.array([entry.nbytes for entry, _, _ in self._streams], dtype=np.int64)
        wrong = np.flatnonzero(decoded != expected)
        if wrong.size:
            i = int(wrong[0])
            raise _corrupt(f"{self._streams[i][2]}: chunks decode to {int(decoded[i])} bytes, expected {int(expected[i])}")
        is_raw = np.repeat(np.array([entry.codec["id"] == "raw" for entry, _, _ in self._streams], dtype=bool), counts)
        resized = np.flatnonzero(is_raw & (columns.length != columns.raw_length))
        if resized.size:
            i = int(np.searchsorted(ends, resized[0], side="right"))
            raise _corrupt(f"{self._streams[i][2]}: a raw chunk's stored and decoded sizes differ")
        for (entry, chunks, _), part in zip(self._streams, columns.split(counts.tolist())):
            entry.chunks = list(map(Chunk._make, chunks))
            entry.__dict__["columns"] = part  # what the cached property would compute
        return columns, counts.tolist()


def _chunks_valid(chunks: list[Any]) -> bool:
    """Every chunk is [offset, length, raw_length, digest] within bounds (a few passes over the
    columns)."""
    if not all(type(c) is list and len(c) == 4 for c in chunks):
        return False
    if not chunks:
        return True
    offsets, lengths, raws, digests = zip(*chunks)
    return (
        all(type(v) is int for column in (offsets, lengths, raws) for v in column)
        and min(offsets) >= 0 and max(offsets) < 1 << 63
        and min(lengths) >= 1 and max(lengths) < 1 << 63
        and min(raws) >= 1 and max(raws) <= MAX_CHUNK_RAW
        and all(type(d) is str and len(d) == 16 for d in digests)
        and _HEX.fullmatch("".join(digests)) is not None
    )


def _check_tiling(tensors: list[TensorEntry], everything: ChunkColumns, counts: list[int], data_end: int,
                  table_order: bool) -> None:
    """Chunks tile the data section: in table order (format 1), or in offset order with each
    stream's chunks back to back (format 2). Checked on the columns of all chunks at once
    (``everything``, in table order, ``counts`` per stream)."""
    streams = [(t, j) for t in tensors for j in range(len(t.streams))]
    if not everything.offset.size:
        if data_end != PREAMBLE_SIZE:
            raise _corrupt(f"chunks end at {PREAMBLE_SIZE} but the data section ends at {data_end}")
        return
    offset, length = everything.offset, everything.length
    stream = np.repeat(np.arange(len(streams)), counts)
    chunk = np.arange(offset.size) - np.repeat(np.cumsum(counts) - counts, counts)

    def name(i: int) -> str:
        t, j = streams[int(stream[i])]
        return f"tensor {t.name!r} stream {j} chunk {int(chunk[i])}"

    if not table_order:
        gap = np.flatnonzero((chunk[1:] > 0) & (offset[1:] != offset[:-1] + length[:-1])) + 1
        if gap.size:
            i = int(gap[0])
            raise _corrupt(f"{name(i)} starts at {int(offset[i])}, expected {int(offset[i - 1] + length[i - 1])} "
                           "(a stream's chunks lie back to back)")
        order = np.argsort(offset, kind="stable")
    else:
        order = np.arange(offset.size)
    expected = PREAMBLE_SIZE + np.cumsum(length[order]) - length[order]
    wrong = np.flatnonzero(offset[order] != expected)
    if wrong.size:
        i = int(wrong[0])
        raise _corrupt(f"{name(int(order[i]))} starts at {int(offset[order[i]])}, expected {int(expected[i])} "
                       "(chunks must tile the data section)")
    end = PREAMBLE_SIZE + sum(length.tolist())  # exact: lengths whose int64 sums wrap are caught here
    if end != data_end:
        raise _corrupt(f"chunks end at {end} but the data section ends at {data_end}")
