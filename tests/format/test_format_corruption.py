"""Damaged and hostile files: every one is refused with the right error and a precise message."""

from __future__ import annotations

import io
import json
import pathlib
import pickle
import struct
import tracemalloc
from collections.abc import Callable
from typing import Any

import pytest
import torch
import zstandard
from helpers import (
    END_MAGIC,
    MAGIC,
    TRAILER,
    CkzParts,
    assert_same,
    load_bytes,
    mixed_state,
    random_tensor,
    rewrite_index,
    rewrite_raw_index,
    save_bytes,
    small_chunks,
    with_preamble,
)

import ckptzip
from ckptzip import (
    CodecUnavailableError,
    CorruptCheckpointError,
    DeviceUnavailableError,
    UnsupportedFormatError,
)
from ckptzip.codecs import has_codec


def _small_object() -> dict[str, Any]:
    return {
        "w": torch.arange(40, dtype=torch.float32),  # zstd
        "noise": random_tensor(torch.uint8, (64,), seed=2),  # stored raw
        "empty": torch.empty(0),
        "meta": {"step": 3, "lr": 0.5, "name": "x", "t": (1, None)},
    }


@pytest.fixture(scope="module")
def small_file() -> bytes:
    return save_bytes(_small_object(), codec="zstd")


@pytest.fixture
def chunked_file() -> bytes:
    """Tensors over several chunks: 'w' (zstd, 12 chunks), 'noise' (raw, 2 chunks)."""
    obj = {"w": torch.zeros(3000), "noise": random_tensor(torch.uint8, (1500,), seed=4), "n": 1}
    return save_bytes(obj, codec=small_chunks("zstd"))


def _chunk_at(parts: CkzParts, position: int) -> tuple[str, int, int] | None:
    """(tensor name, stream, chunk) whose stored bytes hold this file position, if any."""
    for t in parts.index["tensors"]:
        for j, s in enumerate(t["streams"]):
            for k, (offset, length, _, _) in enumerate(s["chunks"]):
                if offset <= position < offset + length:
                    return t["name"], j, k
    return None


def test_small_file_loads(small_file: bytes) -> None:
    assert_same(load_bytes(small_file), _small_object())


def test_every_truncation_is_corrupt(small_file: bytes) -> None:
    for size in range(len(small_file)):
        with pytest.raises(CorruptCheckpointError):
            load_bytes(small_file[:size])


def test_appended_bytes_are_corrupt(small_file: bytes) -> None:
    for extra in (b"\0", b"x" * 31):
        with pytest.raises(CorruptCheckpointError, match="does not end with the ckptzip end marker"):
            load_bytes(small_file + extra)
    with pytest.raises(CorruptCheckpointError, match=f"which does not fit a file of {2 * len(small_file)} bytes"):
        load_bytes(small_file + small_file)


def test_every_bit_flip_is_corrupt_and_data_damage_names_the_chunk(small_file: bytes) -> None:
    parts = CkzParts.parse(small_file)
    data_end = len(parts.preamble) + len(parts.data)
    for position in range(len(small_file)):
        for bit in range(8):
            damaged = bytearray(small_file)
            damaged[position] ^= 1 << bit
            with pytest.raises(CorruptCheckpointError) as info:
                load_bytes(bytes(damaged))
            where = _chunk_at(parts, position)
            if where is not None:
                name, stream, chunk = where
                assert f"tensor {name!r} stream {stream} chunk {chunk} " in str(info.value)
                assert "is damaged" in str(info.value)
            elif 16 <= position < data_end:
                pytest.fail(f"position {position} is in the data section but in no chunk")


def test_bit_flips_in_a_many_chunk_file_name_the_chunk(chunked_file: bytes) -> None:
    parts = CkzParts.parse(chunked_file)
    chunks = {
        (t["name"], j, k): c
        for t in parts.index["tensors"]
        for j, s in enumerate(t["streams"])
        for k, c in enumerate(s["chunks"])
    }
    assert len(chunks) > 10
    for (name, stream, chunk), (offset, length, _, _) in chunks.items():
        for position in {offset, offset + length // 2, offset + length - 1}:
            damaged = bytearray(chunked_file)
            damaged[position] ^= 0x10
            with pytest.raises(CorruptCheckpointError, match=f"tensor {name!r} stream {stream} chunk {chunk} "):
                load_bytes(bytes(damaged))


def test_lazy_reader_reports_damage_when_the_tensor_is_read(small_file: bytes) -> None:
    parts = CkzParts.parse(small_file)
    offset = parts.index["tensors"][1]["streams"][0]["chunks"][0][0]
    damaged = bytearray(small_file)
    damaged[offset] ^= 1
    with ckptzip.open(io.BytesIO(bytes(damaged))) as reader:
        assert_same(reader["w"], _small_object()["w"])  # undamaged tensors still read
        with pytest.raises(CorruptCheckpointError, match="tensor 'noise' stream 0 chunk 0"):
            reader["noise"]


def test_empty_and_foreign_files(tmp_path) -> None:
    with pytest.raises(CorruptCheckpointError, match="file is 0 bytes, shorter than the 48 bytes"):
        load_bytes(b"")
    with pytest.raises(CorruptCheckpointError, match="this is a zip archive, not a ckptzip file"):
        load_bytes(b"PK\x03\x04" + b"\0" * 100)
    with pytest.raises(CorruptCheckpointError, match="does not end with the ckptzip end marker"):
        load_bytes(b"\0" * 100)


# --- hostile but well-hashed indexes -------------------------------------------------------------

Edit = Callable[[dict], object]


def _tensor(name: str) -> Callable[[dict], dict]:
    return lambda index: next(t for t in index["tensors"] if t["name"] == name)


W, NOISE = _tensor("w"), _tensor("noise")


def _set(getter: Callable[[dict], Any], key: Any, value: Any) -> Edit:
    def edit(index: dict) -> None:
        getter(index)[key] = value

    return edit


def _chunk(name: str, k: int = 0) -> Callable[[dict], list]:
    return lambda index: _tensor(name)(index)["streams"][0]["chunks"][k]


def _stream(name: str) -> Callable[[dict], dict]:
    return lambda index: _tensor(name)(index)["streams"][0]


HOSTILE_INDEXES: list[tuple[str, Edit, type[Exception], str]] = [
    (
        "raw_length 2**40",
        _set(_chunk("w", 0), 2, 2**40),
        CorruptCheckpointError,
        r"stream 0 chunk 0 is \[16, \d+, 1099511627776",
    ),
    (
        "raw_length past the limit",
        _set(_chunk("w", 0), 2, 2**28 + 1),
        CorruptCheckpointError,
        "expected \\[offset, length, raw_length, xxh3\\]",
    ),
    ("raw_length 0", _set(_chunk("w", 0), 2, 0), CorruptCheckpointError, "expected \\[offset, length"),
    ("length 0", _set(_chunk("w", 0), 1, 0), CorruptCheckpointError, "expected \\[offset, length"),
    ("negative offset", _set(_chunk("w", 0), 0, -16), CorruptCheckpointError, "expected \\[offset, length"),
    ("negative length", _set(_chunk("w", 0), 1, -1), CorruptCheckpointError, "expected \\[offset, length"),
    ("float offset", _set(_chunk("w", 0), 0, 16.0), CorruptCheckpointError, "expected \\[offset, length"),
    ("bool length", _set(_chunk("w", 0), 1, True), CorruptCheckpointError, "expected \\[offset, length"),
    ("three-field chunk", lambda i: _chunk("w", 0)(i).pop(), CorruptCheckpointError, "expected \\[offset, length"),
    (
        "uppercase xxh3",
        _set(_chunk("w", 0), 3, "ABCDEF0123456789"),
        CorruptCheckpointError,
        "expected \\[offset, length",
    ),
    ("short xxh3", _set(_chunk("w", 0), 3, "abc"), CorruptCheckpointError, "expected \\[offset, length"),
    (
        "overlapping chunks",
        _set(_chunk("w", 1), 0, 16),
        CorruptCheckpointError,
        r"tensor 'w' stream 0 chunk 1 starts at 16, expected \d+ \(a stream's chunks lie back to back",
    ),
    ("offset past EOF", _set(_chunk("noise", 1), 0, 10**12), CorruptCheckpointError, "chunks lie back to back"),
    (
        "length past EOF",
        lambda i: (_set(_stream("noise"), "codec", {"id": "zstd"})(i), _set(_chunk("noise", 1), 1, 2**62)(i)),
        CorruptCheckpointError,
        r"chunks end at \d+ but the data section ends at \d+",
    ),
    (
        "hole",
        lambda i: _chunk("w", 0)(i).__setitem__(1, _chunk("w", 0)(i)[1] - 1),
        CorruptCheckpointError,
        "chunks lie back to back",
    ),
    (
        "tensor nbytes",
        _set(W, "nbytes", 12004),
        CorruptCheckpointError,
        r"shape \[3000\] of float32 is not 12004 bytes",
    ),
    ("nbytes 2**62", _set(W, "nbytes", 2**62), CorruptCheckpointError, "is not 4611686018427387904 bytes"),
    ("shape", _set(W, "shape", [3001]), CorruptCheckpointError, "is not 12000 bytes"),
    ("negative shape", _set(W, "shape", [-3000]), CorruptCheckpointError, "expected a list of at most 64 sizes"),
    ("huge shape", _set(W, "shape", [0, 2**64]), CorruptCheckpointError, "expected a list of at most 64 sizes"),
    ("65 dims", _set(W, "shape", [1] * 65), CorruptCheckpointError, "expected a list of at most 64 sizes"),
    (
        "stream nbytes",
        _set(_stream("w"), "nbytes", 11999),
        CorruptCheckpointError,
        "stream 0 has nbytes 11999, expected 12000",
    ),
    (
        "chunks short of nbytes",
        lambda i: _stream("w")(i)["chunks"].pop(),
        CorruptCheckpointError,
        r"chunks decode to \d+ bytes, expected 12000",
    ),
    (
        "raw sizes differ",
        _set(_stream("w"), "codec", {"id": "raw"}),
        CorruptCheckpointError,
        "a raw chunk's stored and decoded sizes differ",
    ),
    ("codec not an object", _set(_stream("w"), "codec", "zstd"), CorruptCheckpointError, "has codec 'zstd'"),
    ("codec without id", _set(_stream("w"), "codec", {"level": 3}), CorruptCheckpointError, "has codec"),
    ("stream extra key", _set(_stream("w"), "extra", 1), CorruptCheckpointError, r"has unknown keys \['extra'\]"),
    (
        "checksum format",
        _set(W, "checksum", "crc32:00000000"),
        CorruptCheckpointError,
        "expected 'wsum64:' and 16 hex digits",
    ),
    ("duplicate names", _set(NOISE, "name", "w"), CorruptCheckpointError, "tensor names in the index are not unique"),
    ("empty name", _set(W, "name", ""), CorruptCheckpointError, "has no name"),
    ("dtype number", _set(W, "dtype", 5), CorruptCheckpointError, "has dtype 5, expected a dtype name"),
    ("dtype list", _set(W, "dtype", ["float32"]), CorruptCheckpointError, "expected a dtype name"),
    (
        "unknown dtype",
        _set(W, "dtype", "float128"),
        UnsupportedFormatError,
        "dtype 'float128', which this torch build does not have",
    ),
    (
        "device junk",
        _set(W, "device", "toaster"),
        CorruptCheckpointError,
        "has device 'toaster', expected a torch device string",
    ),
    ("device number", _set(W, "device", 0), CorruptCheckpointError, "expected a torch device string"),
    (
        "tensor extra key",
        _set(W, "owner", "me"),
        CorruptCheckpointError,
        r"tensor table entry 0 has unknown keys \['owner'\]",
    ),
    ("tensor missing key", lambda i: W(i).pop("checksum"), CorruptCheckpointError, r"lacks keys \['checksum'\]"),
    (
        "two transforms",
        _set(W, "transforms", [{"id": "byteplanes", "itemsize": 4}] * 2),
        CorruptCheckpointError,
        "has transforms",
    ),
    (
        "transform options",
        _set(W, "transforms", [{"id": "byteplanes", "itemsize": 3}]),
        CorruptCheckpointError,
        "transform 'byteplanes' has bad options",
    ),
    ("transform without id", _set(W, "transforms", [{"itemsize": 4}]), CorruptCheckpointError, "has no string 'id'"),
    (
        "sparse before 2.2",
        _set(W, "transforms", [{"id": "sparse", "itemsize": 4, "count": 0}]),
        CorruptCheckpointError,
        "has the sparse transform of format 2.2, in a file of an earlier version",
    ),
    (
        "unknown transform",
        _set(W, "transforms", [{"id": "xor-delta"}]),
        UnsupportedFormatError,
        r"unknown transform 'xor-delta'; this ckptzip knows \['byteplanes', 'sparse'\]",
    ),
    (
        "streams vs transforms",
        _set(W, "transforms", [{"id": "byteplanes", "itemsize": 4}]),
        CorruptCheckpointError,
        "has 1 streams, its transforms make 4",
    ),
    (
        "byteplanes itemsize vs dtype",
        _set(W, "transforms", [{"id": "byteplanes", "itemsize": 2}]),
        CorruptCheckpointError,
        r"transform \{'id': 'byteplanes', 'itemsize': 2\} does not match the 4-byte float32",
    ),
    ("tensors not a list", lambda i: i.__setitem__("tensors", {}), CorruptCheckpointError, "'tensors' is not an array"),
    (
        "unknown top-level key",
        lambda i: i.__setitem__("extra", 1),
        CorruptCheckpointError,
        r"index has unknown keys \['extra'\]",
    ),
    ("missing top-level key", lambda i: i.pop("bases"), CorruptCheckpointError, r"index lacks keys \['bases'\]"),
    (
        "format name",
        lambda i: i.__setitem__("format", "zipckpt"),
        CorruptCheckpointError,
        "index 'format' is 'zipckpt'",
    ),
    ("writer type", lambda i: i.__setitem__("writer", 1), CorruptCheckpointError, "'writer' is not a string"),
    ("version string", lambda i: i.__setitem__("version", "1.0"), CorruptCheckpointError, r"expected \[major, minor\]"),
    (
        "version 3.0",
        lambda i: i.__setitem__("version", [3, 0]),
        UnsupportedFormatError,
        r"index format version 3\.0; this ckptzip reads versions 1\.x, 2\.x",
    ),
    (
        "bases",
        lambda i: i.__setitem__("bases", ["prev.ckz"]),
        UnsupportedFormatError,
        "stored relative to other checkpoints",
    ),
]


@pytest.mark.parametrize(("what", "edit", "error", "message"), HOSTILE_INDEXES, ids=[h[0] for h in HOSTILE_INDEXES])
def test_hostile_index_is_refused_before_reading(
    chunked_file: bytes, what: str, edit: Edit, error: type[Exception], message: str
) -> None:
    hostile = rewrite_index(chunked_file, edit)
    with pytest.raises(error, match=message):
        ckptzip.open(io.BytesIO(hostile))  # validation happens up front, before any chunk is read
    with pytest.raises(error, match=message):
        load_bytes(hostile)


def test_index_messages_quote_names_that_look_like_format_fields() -> None:
    # the index checks fill their messages in only when a check fails, from templates: a name
    # holding braces is quoted as it is, never read as a field
    blob = save_bytes({"w{0}{x!r}": torch.zeros(3000)}, codec="zstd")
    hostile = rewrite_index(blob, _set(_stream("w{0}{x!r}"), "nbytes", 11999))
    with pytest.raises(CorruptCheckpointError, match=r"^tensor 'w\{0\}\{x!r\}' stream 0 has nbytes 11999, expected 12000;"):
        ckptzip.open(io.BytesIO(hostile))


def test_rewrite_without_edit_still_loads(chunked_file: bytes) -> None:
    assert_same(load_bytes(rewrite_index(chunked_file, lambda index: None)), load_bytes(chunked_file))


LOAD_TIME_ERRORS: list[tuple[str, Edit, type[Exception] | None, str]] = [
    (
        "unknown codec",
        _set(_stream("w"), "codec", {"id": "brotli"}),
        UnsupportedFormatError,
        r"tensor 'w' stream 0: unknown codec id 'brotli'; this ckptzip knows \[",
    ),
    (
        "bad codec option",
        _set(_stream("w"), "codec", {"id": "zstd", "level": "max"}),
        CorruptCheckpointError,
        "tensor 'w' stream 0: codec configuration .* is invalid",
    ),
    (
        "checksum value",
        _set(W, "checksum", "wsum64:0123456789abcdef"),
        CorruptCheckpointError,
        r"tensor 'w': decoded bytes have checksum wsum64:[0-9a-f]{16}, expected wsum64:0123456789abcdef",
    ),
    ("reshaped", _set(W, "shape", [3, 1000]), None, ""),
    (
        "tree index",
        lambda i: i.__setitem__("tree", {"tensor": 9}),
        CorruptCheckpointError,
        r"tree refers to tensor 9, expected an index in \[0, 2\)",
    ),
    (
        "tree tag",
        lambda i: i.__setitem__("tree", {"pickle": "gASVAAAAAAAAAAA="}),
        CorruptCheckpointError,
        "unknown value tag 'pickle'",
    ),
    (
        "tree too deep",
        lambda i: i.__setitem__("tree", json.loads('{"tuple":[' * 150 + "1" + "]}" * 150)),
        CorruptCheckpointError,
        "nested deeper than",
    ),
]


@pytest.mark.parametrize(("what", "edit", "error", "message"), LOAD_TIME_ERRORS, ids=[h[0] for h in LOAD_TIME_ERRORS])
def test_index_errors_found_when_loading(
    chunked_file: bytes, what: str, edit: Edit, error: type[Exception] | None, message: str
) -> None:
    hostile = rewrite_index(chunked_file, edit)
    if error is None:  # a consistent edit is a valid file
        assert load_bytes(hostile)["w"].shape == (3, 1000)
        return
    with pytest.raises(error, match=message):
        load_bytes(hostile)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available: the tensor would be placed on it")
def test_cuda_tensor_on_a_cpu_machine(chunked_file: bytes) -> None:
    hostile = rewrite_index(chunked_file, _set(W, "device", "cuda:0"))
    with pytest.raises(
        DeviceUnavailableError, match="saved on 'cuda:0' but CUDA is not available here; pass map_location='cpu'"
    ):
        load_bytes(hostile)
    assert load_bytes(hostile, map_location="cpu")["w"].device.type == "cpu"
    assert load_bytes(hostile, map_location={"cuda:0": "cpu"})["w"].device.type == "cpu"


@pytest.mark.skipif(has_codec("ans", "cuda"), reason="a GPU decoder for 'ans' is available here")
def test_gpu_only_codec_on_cpu_says_how_to_convert(chunked_file: bytes) -> None:
    hostile = rewrite_index(chunked_file, _set(_stream("w"), "codec", {"id": "ans", "data_type": "|u1"}))
    with ckptzip.open(io.BytesIO(hostile)) as reader:  # the index is valid: opening works
        assert reader.entries()[0].codecs == ["ans"]
    with pytest.raises(CodecUnavailableError) as info:
        load_bytes(hostile)
    message = str(info.value)
    assert "tensor 'w' stream 0: codec 'ans' is GPU-only (NVIDIA nvCOMP) and has no CPU decoder" in message
    assert "CUDA GPU" in message and "pip install ckptzip[gpu]" in message
    assert "`ckptzip convert SRC DST --codec portable`" in message
    assert isinstance(info.value, RuntimeError)


RAW_INDEXES: list[tuple[str, Callable[[bytes], bytes], str]] = [
    ("duplicate keys", lambda raw: raw.replace(b'"writer":', b'"writer":"x","writer":', 1), "duplicate keys"),
    ("duplicate nested keys", lambda raw: raw.replace(b'"nbytes":', b'"nbytes":1,"nbytes":', 1), "duplicate keys"),
    ("NaN", lambda raw: raw.replace(b'"bases":[]', b'"bases":[NaN]'), "non-JSON constant NaN"),
    ("Infinity", lambda raw: raw.replace(b'"bases":[]', b'"bases":[-Infinity]'), "non-JSON constant -Infinity"),
    ("not UTF-8", lambda raw: raw.replace(b'"ckptzip"', b'"ckpt\xffzip"'), "not valid UTF-8 JSON"),
    ("byte-order mark", lambda raw: b"\xef\xbb\xbf" + raw, "not valid UTF-8 JSON"),
    ("trailing data", lambda raw: raw + b" {}", "not valid UTF-8 JSON"),
    ("truncated JSON", lambda raw: raw[:-1], "not valid UTF-8 JSON"),
    ("empty", lambda raw: b"", "not valid UTF-8 JSON"),
    ("not an object", lambda raw: b"[" + raw + b"]", "the index is not a JSON object"),
    (
        "deep arrays",
        lambda raw: raw.replace(b'"bases":[]', b'"bases":' + b"[" * 100_000 + b"]" * 100_000),
        "not valid UTF-8 JSON",
    ),
    ("huge integer", lambda raw: raw.replace(b'"bases":[]', b'"bases":[' + b"9" * 5000 + b"]"), "not valid UTF-8 JSON"),
]


@pytest.mark.parametrize(("what", "mutate", "message"), RAW_INDEXES, ids=[r[0] for r in RAW_INDEXES])
def test_malformed_index_json_is_corrupt(
    small_file: bytes, what: str, mutate: Callable[[bytes], bytes], message: str
) -> None:
    parts = CkzParts.parse(small_file)
    raw = json.dumps(parts.index, separators=(",", ":")).encode()
    mutated = mutate(raw)
    assert mutated != raw
    with pytest.raises(CorruptCheckpointError, match=message):
        load_bytes(rewrite_raw_index(small_file, mutated))


# --- preamble and trailer -----------------------------------------------------------------------


def test_format_version_3_is_unsupported(small_file: bytes) -> None:
    with pytest.raises(UnsupportedFormatError, match=r"file format version 3\.0; this ckptzip reads versions 1\.x, 2\.x"):
        load_bytes(with_preamble(small_file, major=3))


def test_unknown_flags_are_unsupported(small_file: bytes) -> None:
    with pytest.raises(UnsupportedFormatError, match="format flags 0x1"):
        load_bytes(with_preamble(small_file, flags=1))


def test_bad_magic_with_a_matching_hash_is_corrupt(small_file: bytes) -> None:
    with pytest.raises(CorruptCheckpointError, match=r"bad magic .*: not a ckptzip file"):
        load_bytes(with_preamble(small_file, magic=b"\x89PNG\r\n\x1a\n"))


def test_a_version_flip_without_rehash_is_caught_by_the_index_hash(small_file: bytes) -> None:
    damaged = bytearray(small_file)
    damaged[8] = 3  # major version
    with pytest.raises(CorruptCheckpointError, match="the index checksum does not match"):
        load_bytes(bytes(damaged))


def test_later_minor_version_with_new_keys_is_read(small_file: bytes) -> None:
    """A 2.x reader reads 2.(x+1) files (FORMAT.md, Preamble), ignoring top-level keys it does not know."""

    def future(index: dict) -> None:
        index["version"] = [2, 7]
        index["signature"] = {"alg": "none"}

    newer = with_preamble(rewrite_index(small_file, future), minor=7)
    assert_same(load_bytes(newer), _small_object())


def _with_trailer(blob: bytes, offset: int, length: int) -> bytes:
    digest = TRAILER.unpack(blob[-TRAILER.size :])[2]
    return blob[: -TRAILER.size] + TRAILER.pack(offset, length, digest, END_MAGIC)


@pytest.mark.parametrize(
    ("offset", "length"),
    [(0, 10), (15, 10), (2**64 - 1, 2**64 - 1), (16, 2**64 - 1), (2**63, 2**63 - 40), (16, 0)],
)
def test_trailer_offsets_are_checked_against_the_file_size(small_file: bytes, offset: int, length: int) -> None:
    with pytest.raises(CorruptCheckpointError, match="trailer places the index at offset"):
        load_bytes(_with_trailer(small_file, offset, length))


def test_minimal_empty_file_is_valid() -> None:
    data = save_bytes({})
    assert data[:8] == MAGIC and data[-8:] == END_MAGIC
    assert CkzParts.parse(data).data == b""
    assert load_bytes(data) == {}


# --- chunks whose hash matches but whose content is hostile -------------------------------------


def test_zstd_frame_claiming_a_huge_size_allocates_nothing(chunked_file: bytes) -> None:
    parts = CkzParts.parse(chunked_file)
    raw_length = parts.chunk(0)[2]
    honest = zstandard.ZstdCompressor(write_content_size=True).compress(b"\0" * raw_length)
    fhd = honest[4]
    assert fhd & 0xC0 == 0x40 and fhd & 0x20  # 2-byte content size, single segment: rewrite it to 8 bytes
    bomb = honest[:4] + bytes([0xE0 | (fhd & 0x03)]) + struct.pack("<Q", 2**31) + honest[7:]
    assert zstandard.frame_content_size(bomb) == 2**31
    parts.replace_chunk(0, 0, 0, bomb)
    tracemalloc.start()
    try:
        with pytest.raises(
            CorruptCheckpointError,
            match=r"tensor 'w' stream 0 chunk 0: zstd frame header declares 2147483648 bytes, expected 1000",
        ):
            load_bytes(parts.build())
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 << 20


def test_zstd_frame_without_size_that_decodes_too_long_is_corrupt(chunked_file: bytes) -> None:
    parts = CkzParts.parse(chunked_file)
    long = zstandard.ZstdCompressor(write_content_size=False).compress(b"\0" * (1 << 20))
    parts.replace_chunk(0, 0, 3, long)
    with pytest.raises(CorruptCheckpointError, match="tensor 'w' stream 0 chunk 3: zstd data does not decode"):
        load_bytes(parts.build())


@pytest.mark.parametrize("stored", [b"\x00", b"garbage!" * 20, zstandard.ZstdCompressor().compress(b"\1" * 999)])
def test_chunk_that_does_not_decode_names_tensor_stream_and_chunk(chunked_file: bytes, stored: bytes) -> None:
    parts = CkzParts.parse(chunked_file)
    parts.replace_chunk(0, 0, 5, stored)
    with pytest.raises(CorruptCheckpointError, match="tensor 'w' stream 0 chunk 5: zstd "):
        load_bytes(parts.build())


def test_chunk_decoding_to_other_bytes_fails_the_tensor_checksum(chunked_file: bytes) -> None:
    parts = CkzParts.parse(chunked_file)
    parts.replace_chunk(0, 0, 2, zstandard.ZstdCompressor().compress(b"\1" * 1000))
    with pytest.raises(CorruptCheckpointError, match="tensor 'w': decoded bytes have checksum"):
        load_bytes(parts.build())


# --- pickles are never executed -----------------------------------------------------------------


class _Touch:
    """Unpickling this creates a file: stands in for any code a pickle can run."""

    def __init__(self, path: pathlib.Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple:
        return (pathlib.Path.touch, (self.path,))


def _payloads(marker: pathlib.Path) -> dict[str, bytes]:
    torch_file = io.BytesIO()
    torch.save({"w": torch.ones(2), "evil": _Touch(marker)}, torch_file)
    return {"pickle": pickle.dumps(_Touch(marker)), "torch.save": torch_file.getvalue()}


def test_the_pickle_payloads_are_live(tmp_path) -> None:
    payloads = _payloads(tmp_path / "proof")
    pickle.loads(payloads["pickle"])
    assert (tmp_path / "proof").exists()
    (tmp_path / "proof").unlink()
    torch.load(io.BytesIO(payloads["torch.save"]), weights_only=False)
    assert (tmp_path / "proof").exists()


@pytest.mark.parametrize("kind", ["pickle", "torch.save"])
def test_pickles_are_refused_without_being_run(tmp_path, kind: str) -> None:
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.ckz"
    path.write_bytes(_payloads(marker)[kind])
    with pytest.raises(CorruptCheckpointError, match="not a ckptzip file"):
        ckptzip.load(path)
    with pytest.raises(CorruptCheckpointError):
        ckptzip.open(path)
    assert not marker.exists()


def test_pickle_inside_a_valid_file_stays_bytes(tmp_path) -> None:
    marker = tmp_path / "pwned"
    payload = _payloads(marker)["pickle"]
    assert load_bytes(save_bytes({"blob": payload})) == {"blob": payload}
    assert not marker.exists()


def test_mixed_state_survives_rewrite_with_every_chunk_rehashed() -> None:
    """The rewrite helper itself: replacing each chunk by its own bytes keeps the file valid."""
    data = save_bytes(mixed_state())
    parts = CkzParts.parse(data)
    for i, t in enumerate(parts.index["tensors"]):
        for j, s in enumerate(t["streams"]):
            for k, (offset, length, _, _) in enumerate(s["chunks"]):
                parts.replace_chunk(i, j, k, parts.data[offset - 16 : offset - 16 + length])
    assert parts.build() == data
