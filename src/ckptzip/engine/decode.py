"""Stored chunks → tensors, a batch at a time: the mirror image of :mod:`.encode`.

The stored bytes of a batch lie in one buffer on the backend's device (a GPU region filled by
host-to-device copies, or host memory). One pass checksums every chunk (and, on a GPU, gathers
the coded ones to the aligned addresses nvCOMP needs) before any decoder sees it; one codec call
per codec decodes every coded chunk in place; one merge per item size rebuilds the tensors from
their planes, raw planes read where they landed, computing each tensor's checksum in the same
pass; sparse tensors are scattered from their bitmaps and values. The caller verifies those
checksums (one sync for a whole load).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import numpy.typing as npt
import torch

from ..checksum import MASK64
from ..codecs import Codec
from ..errors import CkptzipError, CorruptCheckpointError, CorruptChunkError
from ..format import TensorEntry
from ..kernels import distinct
from ..kernels.planes import PLANE_ALIGN, merge_planes
from ..kernels.segments import segment_sums, tensor_sums
from ..transforms import BytePlanes, Sparse
from ..transforms.sparse import unpack_bits
from ..uploads import to_device
from .policy import codec_for
from .pages import populate
from .scratch import scratch


@dataclass(frozen=True)
class Runs:
    """Where a batch's stored bytes lie in its region: the contiguous runs of the file that hold
    its chunks, back to back (a part of a large tensor takes a slice of each of its planes)."""

    file: npt.NDArray[np.int64]  # file offset of each run
    region: npt.NDArray[np.int64]  # where it starts in the region
    length: npt.NDArray[np.int64]

    @classmethod
    def of(cls, entries: list[TensorEntry]) -> Runs:
        columns = [s.columns for e in entries for s in e.streams]
        if not any(c.offset.size for c in columns):
            empty = np.zeros(0, dtype=np.int64)
            return cls(empty, empty, empty)
        offset = np.concatenate([c.offset for c in columns])
        length = np.concatenate([c.length for c in columns])
        order = np.argsort(offset, kind="stable")
        offset, length = offset[order], length[order]
        starts = np.flatnonzero(np.r_[True, offset[1:] != offset[:-1] + length[:-1]])
        file = offset[starts]
        runs = np.add.reduceat(length, starts)
        return cls(file, np.cumsum(runs) - runs, runs)

    @property
    def total(self) -> int:
        return int(self.length.sum())

    @property
    def span(self) -> int:
        """Bytes of the file from the first run's start to the last one's end."""
        return int(self.file[-1] + self.length[-1] - self.file[0])

    def in_place(self) -> Runs:
        """The same runs in a region that is the file's span itself (gaps between runs kept)."""
        return Runs(self.file, self.file - self.file[0], self.length)

    def locate(self, file_offsets: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        """Region offsets of bytes at these file offsets (each inside a run)."""
        k = np.searchsorted(self.file, file_offsets, side="right") - 1
        return self.region[k] + file_offsets - self.file[k]


@dataclass
class _Chunks:
    """Every chunk of a batch as columns, in table order (tensor, stream, chunk)."""

    tensor: np.ndarray
    stream: np.ndarray  # global stream number within the batch
    file_offset: np.ndarray
    offset: np.ndarray  # in the region
    length: np.ndarray
    raw: np.ndarray
    digest: np.ndarray  # uint64
    index: np.ndarray  # chunk number within its stream


def _columns(entries: list[TensorEntry], runs: Runs) -> tuple[_Chunks, list[tuple[int, int]]]:
    streams = [(t, j) for t, entry in enumerate(entries) for j in range(len(entry.streams))]
    columns = [entries[t].streams[j].columns for t, j in streams]
    counts = np.array([c.offset.size for c in columns], dtype=np.int64)
    stream = np.repeat(np.arange(len(streams), dtype=np.int64), counts)
    tensor = np.array([t for t, _ in streams], dtype=np.int64)[stream] if streams else stream

    def cat(name: str, dtype: type) -> np.ndarray:
        return np.concatenate([getattr(c, name) for c in columns]) if columns else np.zeros(0, dtype)

    file_offset = cat("offset", np.int64)
    region = runs.locate(file_offset) if file_offset.size else file_offset
    index = np.arange(stream.size, dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
    chunks = _Chunks(tensor, stream, file_offset, region, cat("length", np.int64), cat("raw_length", np.int64),
                     cat("digest", np.uint64), index)
    return chunks, streams


def _name(entries: list[TensorEntry], streams: list[tuple[int, int]], chunks: _Chunks, i: int) -> str:
    t, j = streams[int(chunks.stream[i])]
    return f"tensor {entries[t].name!r} stream {j} chunk {int(chunks.index[i])}"


def verify_digests(entries: list[TensorEntry], streams: list[tuple[int, int]], chunks: _Chunks,
                   found: np.ndarray) -> None:
    """Raise ``CorruptCheckpointError`` naming the first chunk whose wsum64 is not the index's."""
    bad = np.flatnonzero(found.astype(np.uint64) != chunks.digest)
    if bad.size:
        i = int(bad[0])
        start = int(chunks.file_offset[i])
        raise CorruptCheckpointError(
            f"{_name(entries, streams, chunks, i)} (file bytes {start}..{start + int(chunks.length[i])}) is damaged: "
            f"wsum64 {int(found[i]) & MASK64:016x}, expected {int(chunks.digest[i]):016x}"
        )


def decode_batch(entries: list[TensorEntry], region: torch.Tensor, runs: Runs, backend: str,
                 *, digests: bool, outs: list[torch.Tensor | None] | None = None,
                 first_words: np.ndarray | None = None) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Decode the tensors whose stored bytes fill ``region`` (laid out as ``runs`` say).

    Returns their bytes (1-D uint8 on the region's device; into ``outs[i]`` where given) and their
    wsum64 (int64, for the caller to verify), each numbered from ``first_words[i]`` (entries that
    are element ranges of a larger tensor: their sums add up to the tensor's; default 0).
    ``digests``: check each chunk's wsum64 here (files of format 2); files of format 1 carry XXH3
    digests, which the reader checks on the host before the bytes get here.
    """
    device = region.device
    chunks, streams = _columns(entries, runs)
    codecs = [entries[t].streams[j].codec for t, j in streams]
    coded = np.array([c["id"] != "raw" for c in codecs], dtype=bool)
    chunk_coded = coded[chunks.stream] if chunks.stream.size else np.zeros(0, bool)
    on_gpu = backend == "cuda"
    # Coded chunks move to aligned slots for nvCOMP (on the GPU), checksummed on the way.
    c_sel = np.flatnonzero(chunk_coded)
    slot = -(-chunks.length[c_sel] // PLANE_ALIGN) * PLANE_ALIGN
    c_slot = np.cumsum(slot) - slot
    coded_src = torch.empty(int(slot.sum()) if on_gpu else 0, dtype=torch.uint8, device=device)
    found = torch.zeros(chunks.length.size, dtype=torch.int64, device=device)
    zeros = np.zeros(chunks.length.size, dtype=np.int64)
    r_sel = np.flatnonzero(~chunk_coded)
    if digests and r_sel.size:
        found[to_device(r_sel, device)] = segment_sums([region], zeros[r_sel], chunks.offset[r_sel],
                                                       chunks.length[r_sel])
    if c_sel.size and (digests or on_gpu):
        gather = dict(outs=[coded_src], out_index=zeros[c_sel], out_offsets=c_slot) if on_gpu else {}
        sums = segment_sums([region], zeros[c_sel], chunks.offset[c_sel], chunks.length[c_sel], **gather)
        found[to_device(c_sel, device)] = sums
    if digests:
        verify_digests(entries, streams, chunks, found.cpu().numpy())  # before any decoder runs
    decoded, stream_at = _decode_coded(entries, chunks, streams, codecs, coded, region, coded_src, c_sel,
                                       c_slot, on_gpu, backend)
    words = np.zeros(len(entries), dtype=np.int64) if first_words is None else first_words
    return _rebuild(entries, chunks, streams, coded, region, decoded, stream_at, outs or [None] * len(entries), words)


def _decoders(entries: list[TensorEntry], streams: list[tuple[int, int]], codecs: list[dict[str, Any]],
              coded: np.ndarray, backend: str) -> list[tuple[int, Codec | None]]:
    """Per stream, its decode group and the codec that decodes it (None for raw streams): streams
    whose codecs decode alike (:meth:`~ckptzip.codecs.Codec.decoder_config`: gdeflate's algorithm
    types, zstd's levels) share one group, so one call decodes them all."""
    groups: dict[str, tuple[int, Codec]] = {}
    known: dict[str, tuple[int, Codec]] = {}  # by a stream's own configuration
    out: list[tuple[int, Codec | None]] = []
    for s, config in enumerate(codecs):
        if not coded[s]:
            out.append((-1, None))
            continue
        text = json.dumps(config, sort_keys=True)
        if text not in known:
            t, j = streams[s]
            try:
                decoder = codec_for(config, backend).decoder_config()
                key = json.dumps(decoder, sort_keys=True)
                if key not in groups:
                    groups[key] = (len(groups), codec_for(decoder, backend))
            except CkptzipError as exc:
                raise type(exc)(f"tensor {entries[t].name!r} stream {j}: {exc}") from exc
            known[text] = groups[key]
        out.append(known[text])
    return out


def _decode_coded(entries: list[TensorEntry], chunks: _Chunks, streams: list[tuple[int, int]], codecs: list[dict[str, Any]],
                  coded: np.ndarray, region: torch.Tensor, coded_src: torch.Tensor, c_sel: np.ndarray,
                  c_slot: np.ndarray, on_gpu: bool, backend: str) -> tuple[torch.Tensor, np.ndarray]:
    """Decode every coded stream into one buffer, each stream contiguous at an aligned offset.

    Returns the buffer and each stream's offset in it (-1 for raw streams)."""
    device = region.device
    sizes = np.array([entries[t].streams[j].nbytes for t, j in streams], dtype=np.int64)
    stream_slot = np.where(coded, -(-sizes // PLANE_ALIGN) * PLANE_ALIGN, 0)
    stream_at = np.where(coded, np.cumsum(stream_slot) - stream_slot, -1)
    size = int(stream_slot.sum())
    decoded = torch.empty(size, dtype=torch.uint8, device=device) if on_gpu else scratch("decoded", size)
    if not c_sel.size:
        return decoded, stream_at
    c_stream = chunks.stream[c_sel]
    raw = chunks.raw[c_sel]
    first = np.r_[True, c_stream[1:] != c_stream[:-1]]
    starts = np.flatnonzero(first)
    within = np.cumsum(raw) - raw
    within = within - np.repeat(within[starts], np.diff(np.r_[starts, raw.size]))
    dst = stream_at[c_stream] + within
    src, src_offsets = (coded_src, c_slot) if on_gpu else (region, chunks.offset[c_sel])
    decoders = _decoders(entries, streams, codecs, coded, backend)
    stream_group = np.array([g for g, _ in decoders], np.int64)
    chunk_group = stream_group[c_stream]
    for g in distinct(chunk_group)[0].tolist():
        m = np.flatnonzero(chunk_group == g)
        codec = decoders[int(c_stream[m[0]])][1]
        assert codec is not None  # coded chunks belong to coded streams
        aligned = (decoded.data_ptr() + dst[m]) % codec.alignment == 0
        try:
            if aligned.all():
                codec.decode_segments(src, src_offsets[m], chunks.length[c_sel][m], decoded, dst[m], raw[m])
            else:  # chunks of sizes off the codec's alignment (not written by ckptzip): one by one
                for i in m.tolist():
                    tmp = torch.empty(int(raw[i]), dtype=torch.uint8, device=device)
                    codec.decode_segments(src, src_offsets[i : i + 1], chunks.length[c_sel][i : i + 1], tmp,
                                          np.zeros(1, np.int64), raw[i : i + 1])
                    decoded[int(dst[i]) : int(dst[i]) + int(raw[i])].copy_(tmp)
        except CorruptCheckpointError as exc:
            what = (_name(entries, streams, chunks, int(c_sel[m[exc.chunk]])) if isinstance(exc, CorruptChunkError)
                    else f"tensors {sorted({entries[t].name for t, _ in streams})}")
            raise CorruptCheckpointError(f"{what}: {exc}") from exc
    return decoded, stream_at


def _rebuild(entries: list[TensorEntry], chunks: _Chunks, streams: list[tuple[int, int]], coded: np.ndarray,
             region: torch.Tensor, decoded: torch.Tensor, stream_at: np.ndarray, given: list[torch.Tensor | None],
             first_words: np.ndarray) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Merge planes (or copy single streams) into one tensor each (new, or given); their wsum64,
    numbered from ``first_words`` (sparse tensors decode whole: theirs are 0)."""
    device = region.device
    outs = [torch.empty(e.nbytes, dtype=torch.uint8, device=device) if g is None else g
            for e, g in zip(entries, given)]
    populate(outs)  # host outputs: their pages in one call each, on this thread, before the writes below
    checksums = torch.zeros(len(entries), dtype=torch.int64, device=device)
    first_offset = np.zeros(len(streams), dtype=np.int64)  # region offset of each stream's first chunk
    with_chunks, first = distinct(chunks.stream)
    first_offset[with_chunks] = chunks.offset[first]
    source_base = np.where(coded, 1, 0)  # 0: the region (raw streams in place), 1: the decoded buffer
    source_offset = np.where(coded, stream_at, first_offset)
    by_tensor: dict[int, list[int]] = {}
    for s, (t, _) in enumerate(streams):
        by_tensor.setdefault(t, []).append(s)
    merges: dict[int, list[int]] = {}
    singles: list[int] = []
    sparse: list[int] = []
    for t, entry in enumerate(entries):
        if isinstance(entry.transform, Sparse):
            sparse.append(t)
        elif isinstance(entry.transform, BytePlanes):  # one stream a plane (the index checks it)
            merges.setdefault(entry.transform.itemsize, []).append(t)
        elif entry.nbytes:
            singles.append(t)
    for k, idx in merges.items():
        plane_streams = np.array([by_tensor[t] for t in idx], dtype=np.int64)
        sums = merge_planes([outs[t] for t in idx], k, [region, decoded], source_base[plane_streams],
                            source_offset[plane_streams], first_words[idx])
        checksums[to_device(np.array(idx), device)] = sums
    if singles:
        s_of = np.array([by_tensor[t][0] for t in singles], dtype=np.int64)
        sizes = np.array([entries[t].nbytes for t in singles], dtype=np.int64)
        sums = segment_sums([region, decoded], source_base[s_of], source_offset[s_of], sizes, outs=outs,
                            out_index=np.array(singles), out_offsets=np.zeros(len(singles), np.int64),
                            first_words=first_words[singles])
        checksums[to_device(np.array(singles), device)] = sums  # of the bytes copied: each whole output
    if sparse:
        assert not first_words[sparse].any(), "a sparse tensor decodes whole"
        views = [[_view([region, decoded][source_base[s]], int(source_offset[s]), entries[t].streams[j].nbytes)
                  for j, s in enumerate(by_tensor[t])] for t in sparse]
        checksums[to_device(np.array(sparse), device)] = _scatter_sparse([entries[t] for t in sparse], views,
                                                                         [outs[t] for t in sparse])
    return outs, checksums


def _view(base: torch.Tensor, offset: int, size: int) -> torch.Tensor:
    """``size`` bytes of ``base`` at ``offset``, which must hold them."""
    if offset < 0 or offset + size > base.numel():
        raise CorruptCheckpointError("a stream reaches past the bytes that hold it")
    return base[offset : offset + size]


def _scatter_sparse(entries: list[TensorEntry], streams: list[list[torch.Tensor]], outs: list[torch.Tensor]
                    ) -> torch.Tensor:
    """Rebuild sparse tensors from their bitmaps and value planes into ``outs``; their wsum64.
    The bitmaps' counts are checked against the index first (one sync for the batch)."""
    transforms = [cast(Sparse, e.transform) for e in entries]
    elements = [e.nbytes // t.itemsize for e, t in zip(entries, transforms)]
    masks, found = zip(*(unpack_bits(s[0], n) for s, n in zip(streams, elements)))
    for entry, transform, n, count in zip(entries, transforms, elements, torch.stack(found).tolist()):
        try:
            transform.verify(count, n)
        except CorruptCheckpointError as exc:
            raise CorruptCheckpointError(f"tensor {entry.name!r}: {exc}; the file is damaged") from exc
    for transform, s, mask, out in zip(transforms, streams, masks, outs):
        transform.scatter(mask, transform.values(s[1:]), out)
    return tensor_sums(outs)
