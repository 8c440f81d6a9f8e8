"""A batch's chunks as one table, from the streams being coded to the index entries read back.

:class:`Chunks` is that table: NumPy columns, so a batch of thousands of chunks costs array
operations, not a Python loop per chunk. The encoder cuts its streams into it
(:meth:`Chunks.cut`) and leaves it on the :class:`~.encode.EncodedBatch` the writer records;
the reader and decoder list a batch's index entries into it (:class:`Listed`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..checksum import MASK64
from ..errors import CorruptCheckpointError
from ..format import TensorEntry
from ..format.reader import verify_xxh3


@dataclass
class Chunks:
    """A batch's chunk table, in table order (a tensor's streams in order, a stream's chunks in
    order). Per chunk: its stream (numbered within the batch), its number within that stream, its
    decoded (``raw``) and stored (``length``) sizes, and where its stored bytes lie: at
    ``offset`` in buffer ``base`` of the batch's buffers (chunks listed from an index: in the
    file, and ``digest`` as the index records it; chunks being coded have theirs computed as
    they are gathered)."""

    stream: np.ndarray
    index: np.ndarray
    raw: np.ndarray
    length: np.ndarray
    base: np.ndarray
    offset: np.ndarray
    digest: np.ndarray | None = None  # uint64

    @classmethod
    def cut(cls, counts: np.ndarray, chunk_bytes: np.ndarray, size: np.ndarray, base: np.ndarray,
            offset: np.ndarray) -> Chunks:
        """Streams of ``size`` bytes at ``offset`` of buffers ``base`` cut into ``counts`` chunks
        of ``chunk_bytes`` each (a stream's last one shorter), stored as they are so far."""
        stream = np.repeat(np.arange(size.size), counts)
        index = np.arange(stream.size) - np.repeat(np.cumsum(counts) - counts, counts)
        raw = np.minimum(chunk_bytes[stream], size[stream] - index * chunk_bytes[stream])
        return cls(stream, index, raw, raw.copy(), base[stream], offset[stream] + index * chunk_bytes[stream])

    @classmethod
    def gathered(cls, raw: np.ndarray, length: np.ndarray) -> Chunks:
        """The chunks of one stream stored back to back in one buffer."""
        index = np.arange(length.size, dtype=np.int64)
        zeros = np.zeros(length.size, dtype=np.int64)
        return cls(zeros, index, raw, length, zeros, np.cumsum(length) - length)


@dataclass(frozen=True)
class Listed:
    """The chunks of a batch of index entries: the entries, each stream's tensor (a position in
    ``entries``) and number in that tensor, and the chunk table (offsets in the file)."""

    entries: list[TensorEntry]
    streams: list[tuple[int, int]]
    chunks: Chunks

    @classmethod
    def of(cls, entries: list[TensorEntry]) -> Listed:
        streams = [(t, j) for t, entry in enumerate(entries) for j in range(len(entry.streams))]
        columns = [entries[t].streams[j].columns for t, j in streams]
        counts = np.array([c.offset.size for c in columns], dtype=np.int64)
        stream = np.repeat(np.arange(len(streams), dtype=np.int64), counts)

        def cat(name: str, dtype: type) -> np.ndarray:
            return np.concatenate([getattr(c, name) for c in columns]) if columns else np.zeros(0, dtype)

        index = np.arange(stream.size, dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
        chunks = Chunks(stream, index, cat("raw_length", np.int64), cat("length", np.int64),
                        np.zeros(stream.size, dtype=np.int64), cat("offset", np.int64), cat("digest", np.uint64))
        return cls(entries, streams, chunks)

    def name(self, i: int) -> str:
        """Chunk ``i`` as an error names it."""
        t, j = self.streams[int(self.chunks.stream[i])]
        return f"tensor {self.entries[t].name!r} stream {j} chunk {int(self.chunks.index[i])}"

    def verify_digests(self, found: np.ndarray) -> None:
        """Raise ``CorruptCheckpointError`` naming the first chunk whose wsum64 (``found``, per
        chunk) is not the index's."""
        chunks = self.chunks
        assert chunks.digest is not None
        bad = np.flatnonzero(found.astype(np.uint64) != chunks.digest)
        if bad.size:
            i = int(bad[0])
            start = int(chunks.offset[i])
            raise CorruptCheckpointError(
                f"{self.name(i)} (file bytes {start}..{start + int(chunks.length[i])}) is damaged: "
                f"wsum64 {int(found[i]) & MASK64:016x}, expected {int(chunks.digest[i]):016x}"
            )

    def verify_xxh3(self, data: np.ndarray, start: int) -> None:
        """Check the XXH3 digests (format 1) of the chunks that start in ``data``, the file's bytes
        from offset ``start``."""
        offset = self.chunks.offset
        inside = np.flatnonzero((offset >= start) & (offset < start + data.size)).tolist()
        listed = []
        for i in inside:
            t, j = self.streams[int(self.chunks.stream[i])]
            k = int(self.chunks.index[i])
            listed.append((self.entries[t], j, k, self.entries[t].streams[j].chunks[k]))
        verify_xxh3(data, start, listed)

    def spans(self, size: int) -> list[tuple[int, int]]:
        """Runs of whole chunks of at most ``size`` bytes (a larger chunk alone), as (file
        offset, bytes)."""
        spans: list[tuple[int, int]] = []
        for offset, length in zip(self.chunks.offset.tolist(), self.chunks.length.tolist()):
            if spans and spans[-1][0] + spans[-1][1] == offset and spans[-1][1] + length <= size:
                spans[-1] = (spans[-1][0], spans[-1][1] + length)
            else:
                spans.append((offset, length))
        return spans
