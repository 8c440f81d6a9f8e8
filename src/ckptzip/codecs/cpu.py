"""CPU codecs: raw (stored), zstd (zstandard), deflate (zlib), lz4 (lz4.block, optional)."""

from __future__ import annotations

import threading
import zlib
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar, cast

import numpy as np
import torch
import zstandard

from ..errors import CorruptCheckpointError, CorruptChunkError
from ._threads import MIN_PARALLEL_BYTES, chunk_groups, codec_thread_count, parallel_map
from .base import Codec
from .registry import mark_unavailable, register

try:
    import lz4.block as _lz4_block
except ImportError:  # pragma: no cover - depends on the environment
    _lz4_block = None


def _to_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


def _check_size(codec_id: str, index: int, got: int, expected: int) -> None:
    if got != expected:
        raise CorruptCheckpointError(
            f"{codec_id} chunk {index} decoded to {got} bytes, expected {expected}"
        )


T = TypeVar("T")


class _CpuCodec(Codec):
    """Shared batching for CPU codecs: one function per chunk, run on the codec thread pool."""

    backend = "cpu"

    def _encode_one(self, data: memoryview) -> bytes:
        raise NotImplementedError

    def _decode_one(self, data: memoryview, raw_size: int) -> bytes:
        raise NotImplementedError

    def encode(self, chunks: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        views = [c.numpy().data for c in chunks]
        encoded = parallel_map(self._encode_one, views, sum(c.numel() for c in chunks))
        return [_to_tensor(e) for e in encoded]

    def decode(self, chunks: Sequence[torch.Tensor], raw_sizes: Sequence[int]) -> list[torch.Tensor]:
        jobs = list(enumerate(zip((c.numpy().data for c in chunks), raw_sizes)))

        def run(job: tuple[int, tuple[memoryview, int]]) -> torch.Tensor:
            index, (data, raw_size) = job
            try:
                out = self._decode_one(data, raw_size)
            except Exception as exc:  # each library has its own error type; name the chunk
                raise CorruptCheckpointError(f"{self.codec_id} chunk {index} does not decode: {exc}") from exc
            _check_size(self.codec_id, index, len(out), raw_size)
            return _to_tensor(out)

        return parallel_map(run, jobs, sum(raw_sizes))

    def encode_segments(self, base: torch.Tensor, offsets: np.ndarray, lengths: np.ndarray
                        ) -> tuple[torch.Tensor, np.ndarray, np.ndarray]:
        data = base.numpy().data
        views = [data[o : o + n] for o, n in zip(offsets.tolist(), lengths.tolist())]
        coded = parallel_map(self._encode_one, views, int(lengths.sum()))
        sizes = np.array([len(c) for c in coded], dtype=np.int64)
        out = np.frombuffer(b"".join(coded), dtype=np.uint8) if coded else np.empty(0, np.uint8)
        return torch.from_numpy(out.copy()), np.cumsum(sizes) - sizes, sizes

    def decode_segments(self, src: torch.Tensor, src_offsets: np.ndarray, src_lengths: np.ndarray,
                        dst: torch.Tensor, dst_offsets: np.ndarray, raw_lengths: np.ndarray) -> None:
        source, target = src.numpy().data, dst.numpy()

        def run(i: int) -> None:
            o, n, d, raw = int(src_offsets[i]), int(src_lengths[i]), int(dst_offsets[i]), int(raw_lengths[i])
            try:
                out = self._decode_one(source[o : o + n], raw)
            except Exception as exc:  # each library has its own error type; name the chunk
                message = (str(exc) if isinstance(exc, CorruptCheckpointError)
                           else f"{self.codec_id} data does not decode: {exc}")
                raise CorruptChunkError(message, i) from exc
            if len(out) != raw:
                raise CorruptChunkError(f"{self.codec_id} data decoded to {len(out)} bytes, expected {raw}", i)
            target[d : d + raw] = np.frombuffer(out, dtype=np.uint8)

        parallel_map(run, range(len(raw_lengths)), int(raw_lengths.sum()))


def _segments(offsets: np.ndarray, lengths: np.ndarray) -> bytes:
    """zstandard's segment table: (offset, length) pairs as native u64."""
    return np.stack([offsets, lengths], axis=1).astype(np.uint64).tobytes()


def _array(segment: object) -> np.ndarray:
    """A zstandard BufferSegment as a uint8 array, no copy (it exports the buffer protocol; its
    type stubs do not say so)."""
    return np.frombuffer(cast(memoryview, segment), dtype=np.uint8)


def _batch_threads(lengths: np.ndarray) -> int:
    """Threads for one batch call of zstandard: the calling thread's share of the cores when there
    is enough work (0: the caller's own)."""
    threads = codec_thread_count()
    return threads if lengths.size > 1 and int(lengths.sum()) >= MIN_PARALLEL_BYTES and threads > 1 else 0


@register
class RawCodec(Codec):
    """Stores bytes as they are: for data no codec shrinks (float mantissa bytes)."""

    codec_id = "raw"
    backend = "cpu"
    chunk_bytes = 16 << 20

    def encode(self, chunks: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        return list(chunks)

    def decode(self, chunks: Sequence[torch.Tensor], raw_sizes: Sequence[int]) -> list[torch.Tensor]:
        for index, (chunk, size) in enumerate(zip(chunks, raw_sizes)):
            _check_size(self.codec_id, index, chunk.numel(), size)
        return list(chunks)


@register
class RawCodecCuda(RawCodec):
    """``raw`` on CUDA tensors: no work at all."""

    backend = "cuda"


class _ThreadLocalFactory(Generic[T]):
    """zstandard contexts are not thread-safe: one per thread."""

    def __init__(self, make: Callable[[], T]) -> None:
        self._make = make
        self._local = threading.local()

    def get(self) -> T:
        obj: T | None = getattr(self._local, "obj", None)
        if obj is None:
            obj = self._local.obj = self._make()
        return obj


# Encoder parameters of zstd's ``long_matches_only``: matches of 7 bytes or more (runs), found
# through a 64-entry table, and everything else Huffman-coded literals. On float exponent planes
# (a few symbols, no repeats worth a match) short matches cost more than the literals they
# replace, so these frames are smaller and faster to code and decode there than level 1's
# (results: "Codecs per byte plane"). The frames are ordinary zstd frames.
_LONG_MATCHES_ONLY = {"min_match": 7, "search_log": 1, "hash_log": 6, "chain_log": 6}


@register
class ZstdCodec(_CpuCodec):
    """Zstandard frames via python-zstandard; interchangeable with nvCOMP zstd (raw bitstream)."""

    codec_id = "zstd"
    chunk_bytes = 1 << 20

    def __init__(self, level: int = 3, long_matches_only: bool = False) -> None:
        if not isinstance(level, int) or not -7 <= level <= 22:
            raise ValueError(f"zstd level must be an integer in [-7, 22], got {level!r}")
        if not isinstance(long_matches_only, bool):
            raise ValueError(f"zstd long_matches_only must be true or false, got {long_matches_only!r}")
        self.level = level
        self.long_matches_only = long_matches_only
        if long_matches_only:
            params = zstandard.ZstdCompressionParameters.from_level(level, write_content_size=True, **_LONG_MATCHES_ONLY)
            self._cctx = _ThreadLocalFactory(lambda: zstandard.ZstdCompressor(compression_params=params))
        else:  # zstd tunes a level's parameters to each input's size
            self._cctx = _ThreadLocalFactory(lambda: zstandard.ZstdCompressor(level=level, write_content_size=True))
        self._dctx = _ThreadLocalFactory(zstandard.ZstdDecompressor)

    def get_config(self) -> dict[str, Any]:
        config: dict[str, Any] = {"id": self.codec_id, "level": self.level}
        if self.long_matches_only:
            config["long_matches_only"] = True
        return config

    def decoder_config(self) -> dict[str, Any]:
        return {"id": self.codec_id}  # the level and the match search steer the encoder only

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ZstdCodec:
        return cls(level=config.get("level", 3), long_matches_only=config.get("long_matches_only", False))

    def _encode_one(self, data: memoryview) -> bytes:
        return self._cctx.get().compress(data)

    def _decode_one(self, data: memoryview, raw_size: int) -> bytes:
        # zstandard sizes its output buffer from the frame header when the header has a size,
        # ignoring max_output_size: check the header first so no unvalidated size is allocated.
        declared = zstandard.frame_content_size(data)
        if declared not in (-1, raw_size):  # -1: the header does not record the size
            raise CorruptCheckpointError(f"zstd frame header declares {declared} bytes, expected {raw_size}")
        return self._dctx.get().decompress(data, max_output_size=raw_size)

    def encode_segments(self, base: torch.Tensor, offsets: np.ndarray, lengths: np.ndarray
                        ) -> tuple[torch.Tensor, np.ndarray, np.ndarray]:
        """Every segment in one call of zstandard's batch compressor (its threads, no GIL)."""
        if not lengths.size:
            return torch.empty(0, dtype=torch.uint8), np.zeros(0, np.int64), np.zeros(0, np.int64)
        frames = self._cctx.get().multi_compress_to_buffer(
            zstandard.BufferWithSegments(base.numpy().data, _segments(offsets, lengths)),
            threads=_batch_threads(lengths))
        sizes = np.array([len(frames[i]) for i in range(len(frames))], dtype=np.int64)
        starts = np.cumsum(sizes) - sizes
        out = np.empty(int(sizes.sum()), dtype=np.uint8)
        for i, start in enumerate(starts.tolist()):
            out[start : start + sizes[i]] = _array(frames[i])
        return torch.from_numpy(out), starts, sizes

    def decode_segments(self, src: torch.Tensor, src_offsets: np.ndarray, src_lengths: np.ndarray,
                        dst: torch.Tensor, dst_offsets: np.ndarray, raw_lengths: np.ndarray) -> None:
        """Each chunk decoded straight into its place in ``dst`` (zstandard's batch decompressor
        fills buffers of its own, a batch's worth beside the outputs, copied out after), runs of
        chunks on the codec threads (zstandard releases the GIL); where any chunk fails, chunk by
        chunk through the generic path, so the error names the chunk."""
        source, target = src.numpy().data, dst.numpy().data
        offsets, lengths = src_offsets.tolist(), src_lengths.tolist()
        places, raws = dst_offsets.tolist(), raw_lengths.tolist()

        def run(group: np.ndarray) -> bool:
            dctx = self._dctx.get()
            for i in group.tolist():
                frame, raw = source[offsets[i] : offsets[i] + lengths[i]], raws[i]
                if zstandard.frame_content_size(frame) not in (-1, raw):  # no unvalidated sizes
                    return False
                reader = dctx.stream_reader(frame, read_across_frames=False)
                if _read_into(reader, target[places[i] : places[i] + raw]) != raw or reader.read(1):
                    return False  # short, or more than the index says
            return True

        try:
            decoded = all(parallel_map(run, chunk_groups(raw_lengths), int(raw_lengths.sum())))
        except (zstandard.ZstdError, ValueError):
            decoded = False
        if not decoded:
            super().decode_segments(src, src_offsets, src_lengths, dst, dst_offsets, raw_lengths)


def _read_into(reader: Any, out: memoryview) -> int:
    """Bytes read into ``out`` until it is full or the frame ends."""
    filled = 0
    while filled < len(out):
        n = reader.readinto(out[filled:])
        if not n:
            break
        filled += n
    return filled


@register
class DeflateCodec(_CpuCodec):
    """Raw DEFLATE (RFC 1951) via zlib; interchangeable with nvCOMP deflate (raw bitstream)."""

    codec_id = "deflate"

    def __init__(self, level: int = 6, **informative: object) -> None:
        if not isinstance(level, int) or not 0 <= level <= 9:
            raise ValueError(f"deflate level must be an integer in [0, 9], got {level!r}")
        self.level = level
        self._informative = informative

    def get_config(self) -> dict[str, Any]:
        return {"id": self.codec_id, "level": self.level, **self._informative}

    def _encode_one(self, data: memoryview) -> bytes:
        compressor = zlib.compressobj(self.level, zlib.DEFLATED, -15)
        return compressor.compress(data) + compressor.flush()

    def _decode_one(self, data: memoryview, raw_size: int) -> bytes:
        decompressor = zlib.decompressobj(-15)
        out = decompressor.decompress(data, raw_size)
        if decompressor.unconsumed_tail or not decompressor.eof:
            raise CorruptCheckpointError("deflate chunk holds more data than its declared size, or is cut short")
        return out


if _lz4_block is not None:

    @register
    class Lz4Codec(_CpuCodec):
        """LZ4 block format via the ``lz4`` package; interchangeable with nvCOMP lz4 (raw bitstream)."""

        codec_id = "lz4"

        def _encode_one(self, data: memoryview) -> bytes:
            out: bytes = _lz4_block.compress(data, store_size=False)
            return out

        def _decode_one(self, data: memoryview, raw_size: int) -> bytes:
            out: bytes = _lz4_block.decompress(data, uncompressed_size=raw_size)
            return out

else:  # pragma: no cover - depends on the environment
    mark_unavailable("lz4", "cpu", "the lz4 package is not installed (pip install ckptzip[lz4])")
