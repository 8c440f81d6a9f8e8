"""The codec interface: batched, lossless maps from byte chunks to byte chunks."""

from __future__ import annotations

import abc
import sys
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import numpy as np
import torch

# What :meth:`Codec.queue_segments` returns: called, the coded chunks' buffer, offsets and lengths.
Segments = Callable[[], tuple[torch.Tensor, np.ndarray, np.ndarray]]


class Codec(abc.ABC):
    """A lossless byte codec on one backend.

    Chunks are 1-D ``torch.uint8`` tensors on the backend's device (``"cpu"`` or ``"cuda"``).
    ``encode``/``decode`` take many chunks at once so GPU implementations launch once per batch.
    Two implementations share a ``codec_id`` only if each decodes the other's output.
    """

    codec_id: ClassVar[str]
    backend: ClassVar[str]
    # The stored chunk size it is used with unless a Policy sets one (a multiple of 256): large
    # enough for the entropy coders' tables and a GPU's parallelism, small enough for the decoders.
    chunk_bytes: ClassVar[int] = 256 << 10
    # The chunk size where a GPU's memory budget keeps its batches small (None: ``chunk_bytes``):
    # a launch of few chunks costs one chunk's latency, which smaller chunks shorten.
    small_batch_chunk_bytes: ClassVar[int | None] = None
    # The largest raw chunk it encodes (nvCOMP's formats have limits; most CPU codecs none of their own).
    max_chunk_bytes: ClassVar[int] = sys.maxsize
    # Address alignment of every chunk it reads and writes (nvCOMP's need for in-place batches).
    alignment: ClassVar[int] = 1
    # Whether each chunk's stream declares its decoded size, so that decode reports a chunk that
    # decodes to another size than the index says; where not, the tensor checksum catches it.
    sizes_in_stream: ClassVar[bool] = True

    @abc.abstractmethod
    def encode(self, chunks: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Compress each chunk independently."""

    def scratch_bytes(self, chunk_bytes: int, decompress: bool = False) -> int:
        """Device memory coding needs beside its inputs and outputs, however few chunks of
        ``chunk_bytes`` a call holds (a GPU's budget must hold it; none for most codecs)."""
        return 0

    @abc.abstractmethod
    def decode(self, chunks: Sequence[torch.Tensor], raw_sizes: Sequence[int]) -> list[torch.Tensor]:
        """Decompress each chunk; ``raw_sizes[i]`` is the exact decoded size of chunk ``i``."""

    def encode_segments(self, base: torch.Tensor, offsets: np.ndarray, lengths: np.ndarray
                        ) -> tuple[torch.Tensor, np.ndarray, np.ndarray]:
        """Compress chunks ``base[offsets[i] : offsets[i] + lengths[i]]`` of one 1-D uint8 buffer.

        Returns one buffer holding the coded chunks, and their offsets and lengths in it.
        """
        coded = self.encode([base[o : o + n] for o, n in zip(offsets.tolist(), lengths.tolist())])
        sizes = np.array([c.numel() for c in coded], dtype=np.int64)
        out = torch.cat(coded) if coded else base.new_empty(0)
        return out, np.cumsum(sizes) - sizes, sizes

    def queue_segments(self, base: torch.Tensor, offsets: np.ndarray, lengths: np.ndarray) -> Segments:
        """:meth:`encode_segments`, its result asked for later: a GPU codec queues its work on the
        current stream and waits for the coded sizes only when asked (the host meanwhile prepares
        the next batch); other codecs code at once."""
        coded = self.encode_segments(base, offsets, lengths)
        return lambda: coded

    def decode_segments(self, src: torch.Tensor, src_offsets: np.ndarray, src_lengths: np.ndarray,
                        dst: torch.Tensor, dst_offsets: np.ndarray, raw_lengths: np.ndarray) -> None:
        """Decompress chunk ``i`` of ``src`` into ``dst[dst_offsets[i]:]``, exactly ``raw_lengths[i]``
        bytes; ``CorruptCheckpointError`` otherwise, a ``CorruptChunkError`` where the codec knows the
        chunk (its position ``i``)."""
        chunks = [src[o : o + n] for o, n in zip(src_offsets.tolist(), src_lengths.tolist())]
        for d, o, n in zip(self.decode(chunks, raw_lengths.tolist()), dst_offsets.tolist(), raw_lengths.tolist()):
            dst[o : o + n].copy_(d)

    def get_config(self) -> dict[str, Any]:
        """JSON-able configuration with an ``"id"`` key; enough to rebuild an equal codec."""
        return {"id": self.codec_id}

    def decoder_config(self) -> dict[str, Any]:
        """The part of :meth:`get_config` a decoder needs (options that steer the encoder only
        left out): chunks coded under configurations with equal decoder configurations decode
        together, with the codec built from it."""
        return self.get_config()

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Codec:
        """Build a codec from :meth:`get_config` output."""
        options = {k: v for k, v in config.items() if k != "id"}
        return cls(**options)

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other) and self.get_config() == other.get_config()

    def __hash__(self) -> int:
        return hash((type(self), tuple(sorted(self.get_config().items()))))

    def __repr__(self) -> str:
        options = ", ".join(f"{k}={v!r}" for k, v in self.get_config().items() if k != "id")
        return f"{type(self).__name__}({options})"
