"""``ckz-huff`` on a GPU: the coder of :mod:`ckptzip.codecs.ckzhuff` as Triton kernels
(``_ckzhuff_triton.py``, shipped compiled like the byte planes' kernels), byte for byte what the
CPU's coder writes and reads.

One call codes a whole batch: a table of the chunks' addresses and sizes reaches the device in
one copy, and two launches of one program per chunk follow (encoding: the code and header, then
the lanes; decoding: the header's checks and table, then the lanes). Encoding waits only for the
coded sizes, and only when asked (:meth:`~ckptzip.codecs.base.Codec.queue_segments`); decoding
waits for each chunk's status, so that a malformed chunk is named with its flaw, as on the CPU.
Chunks start at 4-byte aligned addresses; scratch (4 KiB a chunk encoding, 12 KiB decoding) and
outputs come from torch's allocator on the current stream. Under ``TRITON_INTERPRET=1`` the
codec runs on CPU tensors (tests).
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Callable, Iterator, Sequence

import numpy as np
import torch

from ..codecs.base import Codec, Segments
from ..codecs.ckzhuff import CODEC_ID, FLAWS, MAX_CHUNK, OVERHEAD, check_chunks, check_raw
from ..codecs.registry import declare, mark_unavailable, register
from ..errors import CorruptChunkError
from ..memory.tables import to_device
from . import INTERPRET, _aot, run_gpu

MODULE = "_ckzhuff_triton"
BLOCK = 4096  # bytes a planning program reads at once (whole rounds of 512)
COPY = 1024  # bytes a program copies at once (stored and constant chunks)
PLAN_WARPS = 8  # the planning and table programs: vectors of 256 symbols
LANE_WARPS = 1  # the lanes' programs: a thread a lane
ENC_ROW, DEC_ROW, TABLE = 1024, 768, 4096 + 256  # int32 scratch per chunk; int16 decode table entries
# Bits of the decoder's first-level table (codes of up to FIRST bits; longer ones by all 12): a
# warp's 32 lookups then share a few of its lines. At most 8 (a chunk's TABLE has room for 256
# first-level entries), or 12: one level only (bench/coder_gpu.py's variant, compiled by Triton).
FIRST = 8
SLOT_ALIGN = 16  # coded chunks' slots start at multiples of this


def variants() -> Iterator[tuple[str, str, dict[str, str], dict[str, object], int | None]]:
    """The kernels' variants this module launches (``_build``: shipped compiled)."""
    table = {"table": "*i64", "scratch": "*i32"}
    yield MODULE, "plan_kernel", {**table, "sizes": "*i64"}, {"BLOCK": BLOCK}, PLAN_WARPS
    yield MODULE, "pack_kernel", table, {"COPY": COPY}, LANE_WARPS
    yield MODULE, "table_kernel", {**table, "tables": "*i16", "status": "*i32"}, {"FIRST": FIRST}, PLAN_WARPS
    yield MODULE, "decode_kernel", {**table, "tables": "*i16", "status": "*i32"}, {"COPY": COPY, "FIRST": FIRST}, LANE_WARPS


def _where(t: torch.Tensor) -> bool:
    """Whether ``t`` lies where the kernels run: a GPU, or the host under Triton's interpreter."""
    return t.is_cuda or (INTERPRET and t.device.type == "cpu")


def _check(what: str, t: torch.Tensor, offsets: np.ndarray, lengths: np.ndarray) -> None:
    if not (_where(t) and t.dtype == torch.uint8 and t.dim() == 1 and t.is_contiguous()):
        raise ValueError(f"{CODEC_ID} (cuda) takes 1-D contiguous torch.uint8 CUDA tensors; {what} is not one")
    if offsets.shape != lengths.shape or (offsets < 0).any() or (offsets + lengths > t.numel()).any():
        raise ValueError(f"{CODEC_ID} (cuda): a {what} chunk lies outside its buffer")
    misaligned = (t.data_ptr() + offsets) % CkzHuffCudaCodec.alignment != 0
    if misaligned.any():
        index = int(np.argmax(misaligned))
        raise ValueError(f"{CODEC_ID} (cuda) reads and writes chunks at {CkzHuffCudaCodec.alignment}-byte aligned "
                         f"addresses; {what} chunk {index} is at offset {int(offsets[index])}")


def _rows(src: torch.Tensor, src_offsets: np.ndarray, src_lengths: np.ndarray, dst: torch.Tensor,
          dst_offsets: np.ndarray, extra: np.ndarray) -> torch.Tensor:
    """The kernels' table: per chunk, its source address and bytes, its output address, and one more number."""
    rows = np.empty((src_lengths.size, 4), dtype=np.int64)
    rows[:, 0] = src_offsets + src.data_ptr()
    rows[:, 1] = src_lengths
    rows[:, 2] = dst_offsets + dst.data_ptr()
    rows[:, 3] = extra
    return to_device(rows.reshape(-1), src.device)


def _read_later(sizes: torch.Tensor) -> Callable[[], np.ndarray]:
    """The coded sizes, copied behind the launches now and waited for when asked."""
    if not sizes.is_cuda:
        return lambda: np.array(sizes.numpy())
    host = torch.empty(sizes.shape, dtype=sizes.dtype, pin_memory=True)
    host.copy_(sizes, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record(torch.cuda.current_stream(sizes.device))

    def read() -> np.ndarray:
        copied.synchronize()
        return np.array(host.numpy())

    return read


def _pack(chunks: Sequence[torch.Tensor], sizes: np.ndarray) -> tuple[torch.Tensor, np.ndarray]:
    """The chunks copied into one new buffer at aligned offsets."""
    slots = -(-np.maximum(sizes, 1) // SLOT_ALIGN) * SLOT_ALIGN
    offsets = np.cumsum(slots) - slots
    out = torch.zeros(int(slots.sum()), dtype=torch.uint8, device=chunks[0].device)
    for chunk, at in zip(chunks, offsets.tolist()):
        out[at : at + chunk.numel()].copy_(chunk)
    return out, offsets


class CkzHuffCudaCodec(Codec):
    """``ckz-huff`` chunks on a GPU; interchangeable with the CPU's byte for byte."""

    codec_id = CODEC_ID
    backend = "cuda"
    max_chunk_bytes = MAX_CHUNK
    # A warp decodes a chunk's lanes one symbol at a time: a batch of few chunks leaves the GPU
    # idle, so where a GPU's budget keeps batches small (a host snapshot's) chunks are halved.
    small_batch_chunk_bytes = 128 << 10
    alignment = 4  # the lanes' words and whole rounds are read and written as 32-bit words

    def scratch_bytes(self, chunk_bytes: int, decompress: bool = False) -> int:
        return 4 * DEC_ROW + 2 * TABLE + 4 if decompress else 4 * ENC_ROW + 8

    def encode(self, chunks: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        if not chunks:
            return []
        lengths = np.array([c.numel() for c in chunks], dtype=np.int64)
        check_chunks(lengths, self.max_chunk_bytes)
        base, offsets = _pack(chunks, lengths)
        out, out_offsets, sizes = self.encode_segments(base, offsets, lengths)
        return [out[o : o + n] for o, n in zip(out_offsets.tolist(), sizes.tolist())]

    def decode(self, chunks: Sequence[torch.Tensor], raw_sizes: Sequence[int]) -> list[torch.Tensor]:
        raw = np.array(raw_sizes, dtype=np.int64)
        if len(chunks) != raw.size:
            raise ValueError(f"codec {CODEC_ID!r}: {len(chunks)} chunks but {raw.size} raw sizes")
        if not chunks:
            return []
        check_raw(raw)
        lengths = np.array([c.numel() for c in chunks], dtype=np.int64)
        src, src_offsets = _pack(chunks, lengths)
        slots = -(-raw // SLOT_ALIGN) * SLOT_ALIGN
        dst_offsets = np.cumsum(slots) - slots
        dst = torch.empty(int(slots.sum()), dtype=torch.uint8, device=src.device)
        self.decode_segments(src, src_offsets, lengths, dst, dst_offsets, raw)
        return [dst[o : o + n] for o, n in zip(dst_offsets.tolist(), raw.tolist())]

    def encode_segments(self, base: torch.Tensor, offsets: np.ndarray, lengths: np.ndarray
                        ) -> tuple[torch.Tensor, np.ndarray, np.ndarray]:
        return self.queue_segments(base, offsets, lengths)()

    def queue_segments(self, base: torch.Tensor, offsets: np.ndarray, lengths: np.ndarray) -> Segments:
        """Two launches over chunks of ``base`` read in place; the outputs lie in slots OVERHEAD
        bytes larger than their chunks; the coded sizes are read when the result is asked for."""
        _check("source", base, offsets, lengths)
        if not lengths.size:
            empty = (base.new_empty(0), np.zeros(0, np.int64), np.zeros(0, np.int64))
            return lambda: empty
        check_chunks(lengths, self.max_chunk_bytes)
        slots = -(-(lengths + OVERHEAD) // SLOT_ALIGN) * SLOT_ALIGN
        out_offsets = np.cumsum(slots) - slots
        device = base.device
        with _on(device):
            out = torch.empty(int(slots.sum()), dtype=torch.uint8, device=device)
            table = _rows(base, offsets, lengths, out, out_offsets, np.zeros_like(lengths))
            scratch = torch.empty(lengths.size * ENC_ROW, dtype=torch.int32, device=device)
            sizes = torch.empty(lengths.size, dtype=torch.int64, device=device)
            run_gpu(MODULE, "plan_kernel", lengths.size, device, (table, scratch, sizes), {"BLOCK": BLOCK}, PLAN_WARPS)
            run_gpu(MODULE, "pack_kernel", lengths.size, device, (table, scratch), {"COPY": COPY}, LANE_WARPS)
            read = _read_later(sizes)

        def result() -> tuple[torch.Tensor, np.ndarray, np.ndarray]:
            return out, out_offsets, read()

        return result

    def decode_segments(self, src: torch.Tensor, src_offsets: np.ndarray, src_lengths: np.ndarray,
                        dst: torch.Tensor, dst_offsets: np.ndarray, raw_lengths: np.ndarray) -> None:
        """Two launches from chunks of ``src`` into ``dst``, both in place; one wait, for the
        chunks' statuses: the first malformed chunk is a ``CorruptChunkError`` naming it and its flaw."""
        _check("stored", src, src_offsets, src_lengths)
        _check("decoded", dst, dst_offsets, raw_lengths)
        if not raw_lengths.size:
            return
        check_raw(raw_lengths)
        count, device = raw_lengths.size, src.device
        with _on(device):
            table = _rows(src, src_offsets, src_lengths, dst, dst_offsets, raw_lengths)
            scratch = torch.empty(count * DEC_ROW, dtype=torch.int32, device=device)
            tables = torch.empty(count * TABLE, dtype=torch.int16, device=device)
            status = torch.zeros(count, dtype=torch.int32, device=device)
            args = (table, scratch, tables, status)
            run_gpu(MODULE, "table_kernel", count, device, args, {"FIRST": FIRST}, PLAN_WARPS)
            run_gpu(MODULE, "decode_kernel", count, device, args, {"COPY": COPY, "FIRST": FIRST}, LANE_WARPS)
            flaws = status.cpu().numpy()
        failed = np.flatnonzero(flaws)
        if failed.size:
            index = int(failed[0])
            raise CorruptChunkError(f"{CODEC_ID} chunk {index} does not decode: {FLAWS[int(flaws[index])]}", index)


def _on(device: torch.device) -> contextlib.AbstractContextManager[object]:
    """``device`` made current where it is a GPU (the interpreter's host tensors need nothing)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _load() -> None:
    if not torch.cuda.is_available():
        mark_unavailable(CODEC_ID, "cuda", "no CUDA device is visible (torch.cuda.is_available() is False)")
    elif importlib.util.find_spec("triton") is None and not _aot.covers(torch.device("cuda", torch.cuda.current_device())):
        mark_unavailable(CODEC_ID, "cuda", "its kernels are not shipped compiled for this GPU and Triton is not "
                                           "installed (pip install triton)")
    else:
        register(CkzHuffCudaCodec)


declare([CODEC_ID], "cuda", _load)
