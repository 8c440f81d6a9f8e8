"""``gdeflate`` on the CPU: nvCOMP's GDeflate chunks, decoded by ckptzip's own decoder and
encoded by nvCOMP's ``libnvcomp_cpu``.

A chunk is one bare GDeflate stream, what nvCOMP's GPU codec stores (its RAW bitstream), so
either side decodes the other's chunks. Decoding (``_gdeflate.c``, compiled by the package's
build) takes chunks of any size the GPU wrote, on any CPU; encoding takes chunks of at most
64 KiB (the CPU compressor's limit) at libdeflate-style level :data:`LEVEL`, whatever
``algorithm_type`` says (that option steers nvCOMP's GPU encoder only), where nvCOMP's library
loads (:mod:`._gdeflate_lib`, on first use; elsewhere encoding raises ``CodecUnavailableError``
with the reason and the fix).

Untrusted input: every chunk decodes into exactly its declared raw size (the decoder's writes
stay within it, its reads within the chunk) and must fill it; a malformed stream, or one that
decodes to another size, raises ``CorruptChunkError`` naming the chunk. Decoding is linear in
the stored and raw bytes. Empty chunks never reach nvCOMP (its compressor divides by the chunk
size).

Without the compiled decoder (ckptzip built with no C compiler) the codec is unavailable on the
CPU, with the reason and the fix.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch

from ..errors import CodecUnavailableError
from . import _gdeflate_lib
from ._rows import Rows, RowsCodec, addresses, check_bounds, corrupt
from ._threads import chunk_groups, parallel_map
from .registry import declare, mark_unavailable, register

MAX_DECODE_CHUNK = 1 << 31  # the largest chunk nvCOMP's GPU encoder writes
LEVEL = 1  # fastest level that codes (0 stores); on exponent planes within 10 % of level 12's ratio at 20x its speed
ALGORITHM_TYPES = range(6)
NO_DECODER = ("ckptzip was installed without its GDeflate decoder (C, compiled when ckptzip is installed from "
              "source); reinstall ckptzip where a C compiler (gcc or clang) is at hand, or convert the file once on "
              "a machine that decodes it: `ckptzip convert SRC DST --codec portable`")


@functools.cache
def _decoder() -> Rows | None:
    """The compiled decoder's ``decode(rows, sizes)`` (see ``_gdeflate.c``), or None where it was not built."""
    try:
        from ._gdeflate import decode
    except ImportError:
        return None
    return decode


class GdeflateCpuCodec(RowsCodec):
    """nvCOMP GDeflate chunks on the CPU; interchangeable with the GPU ``gdeflate`` codec. Decodes wherever
    ckptzip's decoder was compiled; encodes where nvCOMP's CPU library loads too."""

    codec_id = "gdeflate"
    max_decoded_chunk = MAX_DECODE_CHUNK
    refusal = "does not decode on the CPU"
    sizes_checked = True  # a stream may end before its slot is full
    max_chunk_bytes = 1 << 16  # nvcompGdeflateCPUCompressionMaxAllowedChunkSize (decoding: MAX_DECODE_CHUNK)
    chunk_bytes = max_chunk_bytes

    def __init__(self, algorithm_type: int = 1) -> None:
        if type(algorithm_type) is not int or algorithm_type not in ALGORITHM_TYPES:
            raise ValueError(f"codec 'gdeflate' option algorithm_type must be one of {list(ALGORITHM_TYPES)}, "
                             f"got {algorithm_type!r}")
        self.algorithm_type = algorithm_type
        decode = _decoder()
        if decode is None:  # built directly, not through the registry (which knows the reason)
            raise CodecUnavailableError(f"codec 'gdeflate' cannot run on the CPU here: {NO_DECODER}.")
        self._decode = decode

    def get_config(self) -> dict[str, Any]:
        return {"id": self.codec_id, "algorithm_type": self.algorithm_type}

    def decoder_config(self) -> dict[str, Any]:
        return {"id": self.codec_id}  # one bitstream whatever the algorithm type

    def encode_segments(self, base: torch.Tensor, offsets: np.ndarray, lengths: np.ndarray
                        ) -> tuple[torch.Tensor, np.ndarray, np.ndarray]:
        """Chunks of at most 64 KiB, non-empty; the outputs lie in slots of the size bound."""
        check_bounds("gdeflate", "source", base, offsets, lengths)
        if not lengths.size:
            return torch.empty(0, dtype=torch.uint8), np.zeros(0, np.int64), np.zeros(0, np.int64)
        if (lengths <= 0).any() or (lengths > self.max_chunk_bytes).any():
            index = int(np.argmax((lengths <= 0) | (lengths > self.max_chunk_bytes)))
            raise ValueError(f"gdeflate (cpu) encodes chunks of 1 to {self.max_chunk_bytes} bytes; "
                             f"chunk {index} has {int(lengths[index])}")
        library, reason = _gdeflate_lib.load()
        if library is None:
            raise CodecUnavailableError(f"codec 'gdeflate' cannot encode on the CPU here: {reason}.")
        largest = int(lengths.max())
        slot = library.max_output(largest)
        out = torch.zeros(slot * lengths.size, dtype=torch.uint8)  # zeroed: no stale bytes between slots
        out_offsets = np.arange(lengths.size, dtype=np.int64) * slot
        sizes = np.zeros(lengths.size, dtype=np.uint64)
        in_ptrs, out_ptrs = addresses(base, offsets), addresses(out, out_offsets)

        def run(group: np.ndarray) -> None:
            sizes[group] = library.compress(in_ptrs[group], lengths[group], largest, out_ptrs[group], LEVEL)

        parallel_map(run, chunk_groups(lengths), int(lengths.sum()))
        return out, out_offsets, sizes.astype(np.int64)

    def decode_segments(self, src: torch.Tensor, src_offsets: np.ndarray, src_lengths: np.ndarray,
                        dst: torch.Tensor, dst_offsets: np.ndarray, raw_lengths: np.ndarray) -> None:
        if (src_lengths <= 0).any():
            raise corrupt("gdeflate", int(np.argmax(src_lengths <= 0)), "is empty; a compressed chunk has bytes")
        super().decode_segments(src, src_offsets, src_lengths, dst, dst_offsets, raw_lengths)


def _load() -> None:
    if _decoder() is not None:
        register(GdeflateCpuCodec)
    else:
        mark_unavailable(GdeflateCpuCodec.codec_id, "cpu", NO_DECODER)


declare([GdeflateCpuCodec.codec_id], "cpu", _load, gpu_first=True)
