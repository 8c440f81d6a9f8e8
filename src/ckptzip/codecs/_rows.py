"""What the compiled CPU coders (``_gdeflate.c``, ``_ckzhuff.c``) take: chunks as rows of raw
addresses into tensors whose bounds are checked here first, since the C side trusts them."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import ClassVar

import numpy as np
import torch

from ..errors import CorruptChunkError
from ._threads import chunk_groups, parallel_map
from .base import Codec

# A compiled coder's entry point: ``f(rows, sizes)`` codes each row (source address and length,
# destination address and length) into its slot, writes each output's size, and returns None or
# the first row it refused with the reason.
Rows = Callable[[np.ndarray, np.ndarray], tuple[int, str] | None]


def addresses(tensor: torch.Tensor, offsets: np.ndarray) -> np.ndarray:
    """The addresses of ``tensor``'s bytes at ``offsets``."""
    out: np.ndarray = offsets.astype(np.uint64) + np.uint64(tensor.data_ptr())
    return out


def check_bounds(codec: str, what: str, tensor: torch.Tensor, offsets: np.ndarray, lengths: np.ndarray) -> None:
    """``ValueError`` unless ``tensor`` is a 1-D contiguous uint8 CPU tensor holding every chunk."""
    if tensor.dtype != torch.uint8 or tensor.dim() != 1 or not tensor.is_contiguous() or tensor.is_cuda:
        raise ValueError(f"{codec} (cpu) takes 1-D contiguous torch.uint8 CPU tensors; {what} is not one")
    if offsets.shape != lengths.shape or (offsets < 0).any() or (offsets + lengths > tensor.numel()).any():
        raise ValueError(f"{codec} (cpu): a {what} chunk lies outside its buffer")


def check_raw(codec: str, raw: np.ndarray, bound: int) -> None:
    """``CorruptChunkError`` for the first declared decoded size a chunk cannot have (1 to ``bound``)."""
    bad = (raw <= 0) | (raw > bound)
    if bad.any():
        index = int(np.argmax(bad))
        raise corrupt(codec, index, f"declares {int(raw[index])} decoded bytes; {codec} chunks hold 1 to {bound}")


def corrupt(codec: str, index: int, what: str) -> CorruptChunkError:
    """The error of chunk ``index`` of a decode call: ``what`` is wrong with it."""
    return CorruptChunkError(f"{codec} chunk {index} {what}", index)


class RowsCodec(Codec):
    """A CPU codec whose compiled coder takes every chunk of one buffer at once: lists of chunks
    go through one buffer (:meth:`encode_segments`, :meth:`decode_segments`)."""

    backend = "cpu"
    max_decoded_chunk: ClassVar[int]  # the most bytes a chunk of its stream decodes to
    refusal: ClassVar[str] = "does not decode"  # how a chunk the decoder refuses is reported
    sizes_checked: ClassVar[bool] = False  # whether the decoder may fill less than a chunk's slot
    _decode: Rows

    def encode(self, chunks: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        lengths = np.array([c.numel() for c in chunks], dtype=np.int64)
        base = torch.cat(list(chunks)) if chunks else torch.empty(0, dtype=torch.uint8)
        out, offsets, sizes = self.encode_segments(base, np.cumsum(lengths) - lengths, lengths)
        return [out[o : o + n] for o, n in zip(offsets.tolist(), sizes.tolist())]

    def decode(self, chunks: Sequence[torch.Tensor], raw_sizes: Sequence[int]) -> list[torch.Tensor]:
        raw = np.array(raw_sizes, dtype=np.int64)
        lengths = np.array([c.numel() for c in chunks], dtype=np.int64)
        if raw.size != lengths.size:
            raise ValueError(f"codec {self.codec_id!r}: {lengths.size} chunks but {raw.size} raw sizes")
        check_raw(self.codec_id, raw, self.max_decoded_chunk)  # before anything is allocated for them
        src = torch.cat(list(chunks)) if chunks else torch.empty(0, dtype=torch.uint8)
        dst_offsets = np.cumsum(raw) - raw
        dst = torch.empty(int(raw.sum()), dtype=torch.uint8)
        self.decode_segments(src, np.cumsum(lengths) - lengths, lengths, dst, dst_offsets, raw)
        return [dst[o : o + n] for o, n in zip(dst_offsets.tolist(), raw.tolist())]

    def decode_segments(self, src: torch.Tensor, src_offsets: np.ndarray, src_lengths: np.ndarray,
                        dst: torch.Tensor, dst_offsets: np.ndarray, raw_lengths: np.ndarray) -> None:
        """The chunks decoded by the compiled coder on ckptzip's CPU threads, their bounds and
        declared sizes checked first; a chunk it refuses (or, where :attr:`sizes_checked`, one that
        decodes to another size) is a ``CorruptChunkError`` naming it."""
        check_bounds(self.codec_id, "stored", src, src_offsets, src_lengths)
        check_bounds(self.codec_id, "decoded", dst, dst_offsets, raw_lengths)
        check_raw(self.codec_id, raw_lengths, self.max_decoded_chunk)
        rows = np.empty((raw_lengths.size, 4), np.int64)  # as the compiled coders take them
        rows[:, 0], rows[:, 1] = addresses(src, src_offsets), src_lengths
        rows[:, 2], rows[:, 3] = addresses(dst, dst_offsets), raw_lengths

        def run(group: np.ndarray) -> None:
            sizes = np.zeros(group.size, np.uint64)
            failed = self._decode(np.ascontiguousarray(rows[group]), sizes)
            if failed is not None:
                row, why = failed
                raise corrupt(self.codec_id, int(group[row]), f"{self.refusal}: {why}")
            short = sizes != raw_lengths[group].astype(np.uint64)
            if self.sizes_checked and short.any():
                first = int(np.argmax(short))
                raise corrupt(self.codec_id, int(group[first]), f"decoded to {int(sizes[first])} bytes, "
                                                                f"expected {int(raw_lengths[group][first])}")

        parallel_map(run, chunk_groups(raw_lengths), int(raw_lengths.sum()))
