"""The index's own values: chunk digests as hex, stream entries as JSON."""

from __future__ import annotations

import json

import numpy as np

from ckptzip.format import Chunk, StreamEntry, digest_hexes
from ckptzip.format.index import ChunkColumns


def test_digests_are_sixteen_hex_digits_that_read_back_as_the_same_values() -> None:
    values = np.array([0, 1, 0xABCDEF, (1 << 63) + 5, (1 << 64) - 1], dtype=np.uint64)
    hexes = digest_hexes(values)
    assert hexes == [f"{int(v):016x}" for v in values.tolist()]
    assert hexes[-1] == "ffffffffffffffff"
    columns = ChunkColumns.of([Chunk(0, 1, 1, h) for h in hexes])
    assert columns.digest.tolist() == values.tolist()
    assert digest_hexes(np.zeros(0, dtype=np.uint64)) == []


def test_a_stream_writes_each_chunk_as_an_array_of_its_four_fields() -> None:
    stream = StreamEntry({"id": "zstd"}, 30, [Chunk(64, 10, 20, "00000000000000ff"), Chunk(74, 5, 10, "0" * 16)])
    assert json.dumps(stream.to_json(), separators=(",", ":")) == (
        '{"codec":{"id":"zstd"},"nbytes":30,"chunks":[[64,10,20,"00000000000000ff"],[74,5,10,"0000000000000000"]]}')
