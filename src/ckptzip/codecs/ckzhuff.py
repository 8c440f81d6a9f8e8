"""``ckz-huff`` on the CPU: ckptzip's own entropy coder for byte planes (docs/FORMAT.md, "ckz-huff"),
in compiled C (``_ckzhuff.c``, built with the package), bit-exact with its GPU kernels
(:mod:`ckptzip.kernels.ckzhuff`) both ways.

A chunk is a size word and the bytes stored, one byte repeated, or a canonical Huffman code of
codewords of at most :data:`MAX_LEN` bits with :data:`LANES` independent lanes of codes, so a GPU
codes a chunk with a warp and a CPU core decodes lanes side by side. Chunks are independent: a
large tensor's decode spreads over ckptzip's CPU threads, chunk by chunk.

Untrusted input: every chunk decodes into exactly its declared raw size (writes stay within it,
reads within the chunk), in time linear in its stored and raw bytes; anything the format does
not allow raises ``CorruptChunkError`` naming the chunk and the flaw. Without the compiled coder
(ckptzip built without a C compiler) the codec is unavailable on the CPU, with the reason and
the fix.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from ..errors import CodecUnavailableError
from ._rows import Rows, RowsCodec, addresses, check_bounds
from ._rows import check_raw as check_decoded_sizes
from ._threads import chunk_groups, parallel_map
from .registry import declare, mark_unavailable, register

CODEC_ID = "ckz-huff"
LANES = 32  # independent code streams of a chunk
GROUP = 16  # bytes of a lane in a row: byte i of a chunk belongs to lane (i // GROUP) % LANES
MAX_LEN = 12  # the longest codeword: a table of 2**MAX_LEN entries decodes one
MAX_CHUNK = 1 << 22  # the most bytes a chunk holds (its lanes' word counts are 16-bit)
OVERHEAD = 4  # a coded chunk is at most this much larger than its bytes (stored whole)
STORED, CONSTANT, HUFFMAN = 0, 1, 2  # the forms of a chunk, its first byte
FIXED_HEADER = 4 + 2 * LANES + 32  # a Huffman chunk's size word, lanes' word counts and symbol bitmap
# What makes a chunk malformed, numbered as the decoders report it (codecs/_ckzhuff.c's Status)
FLAWS = ("", "fewer than 4 bytes", "a size word declaring another decoded size", "an unknown form",
         "stored bytes of another length than declared", "a constant of more than one byte",
         "a code of fewer than 2 symbols, or a header longer than the chunk", "header padding that is not zero",
         "a code length outside 1 to 12", "an incomplete or over-subscribed code",
         "lane lengths that do not add up to the chunk", "a lane whose codes do not fill its words exactly")
NO_CODER = ("ckptzip was installed without its ckz-huff coder (C, compiled when ckptzip is installed from "
            "source); reinstall ckptzip where a C compiler (gcc or clang) is at hand, or convert the file once on "
            "a machine that decodes it: `ckptzip convert SRC DST --codec portable`")


@functools.cache
def _coder() -> tuple[Rows, Rows] | None:
    """The compiled ``(encode, decode)`` (see ``_ckzhuff.c``), or None where it was not built."""
    try:
        from ._ckzhuff import decode, encode
    except ImportError:
        return None
    return encode, decode


def check_raw(raw: np.ndarray) -> None:
    """``CorruptChunkError`` for the first declared decoded size a chunk cannot have."""
    check_decoded_sizes(CODEC_ID, raw, MAX_CHUNK)


def check_chunks(lengths: np.ndarray, max_chunk: int) -> None:
    """``ValueError`` for the first chunk an encoder does not take (empty or over ``max_chunk``)."""
    bad = (lengths <= 0) | (lengths > max_chunk)
    if bad.any():
        index = int(np.argmax(bad))
        raise ValueError(f"{CODEC_ID} encodes chunks of 1 to {max_chunk} bytes; chunk {index} has {int(lengths[index])}")


class CkzHuffCpuCodec(RowsCodec):
    """``ckz-huff`` chunks on the CPU, interchangeable with the GPU's byte for byte."""

    codec_id = CODEC_ID
    max_chunk_bytes = max_decoded_chunk = MAX_CHUNK

    def __init__(self) -> None:
        coder = _coder()
        if coder is None:  # built directly, not through the registry (which knows the reason)
            raise CodecUnavailableError(f"codec {CODEC_ID!r} cannot run on the CPU here: {NO_CODER}.")
        self._encode, self._decode = coder

    def encode_segments(self, base: torch.Tensor, offsets: np.ndarray, lengths: np.ndarray
                        ) -> tuple[torch.Tensor, np.ndarray, np.ndarray]:
        """Non-empty chunks of at most MAX_CHUNK bytes; each output in a slot OVERHEAD bytes larger."""
        check_bounds(CODEC_ID, "source", base, offsets, lengths)
        if not lengths.size:
            return torch.empty(0, dtype=torch.uint8), np.zeros(0, np.int64), np.zeros(0, np.int64)
        check_chunks(lengths, self.max_chunk_bytes)
        slots = lengths + OVERHEAD
        out_offsets = np.cumsum(slots) - slots
        out = torch.empty(int(slots.sum()), dtype=torch.uint8)
        rows = np.empty((lengths.size, 4), np.int64)  # as _ckzhuff.c takes them
        rows[:, 0], rows[:, 1] = addresses(base, offsets), lengths
        rows[:, 2], rows[:, 3] = addresses(out, out_offsets), slots
        sizes = np.zeros(lengths.size, np.uint64)

        def run(group: np.ndarray) -> None:
            coded = np.zeros(group.size, np.uint64)
            self._encode(np.ascontiguousarray(rows[group]), coded)
            sizes[group] = coded

        parallel_map(run, chunk_groups(lengths), int(lengths.sum()))
        return out, out_offsets, sizes.astype(np.int64)



def _load() -> None:
    if _coder() is not None:
        register(CkzHuffCpuCodec)
    else:
        mark_unavailable(CODEC_ID, "cpu", NO_CODER)


declare([CODEC_ID], "cpu", _load)
