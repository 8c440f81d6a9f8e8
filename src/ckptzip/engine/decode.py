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

from ..codecs import Codec
from ..errors import CkptzipError, CorruptCheckpointError, CorruptChunkError
from ..format import TensorEntry
from ..kernels import distinct
from ..kernels.planes import PLANE_ALIGN, merge_planes
from ..kernels.segments import segment_sums, tensor_sums
from ..memory.pages import populate
from ..memory.scratch import scratch
from ..memory.tables import to_device
from ..transforms import BytePlanes, Sparse
from ..transforms.sparse import unpack_bits
from .chunks import Listed
from .policy import codec_for


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


@dataclass(frozen=True)
class Outputs:
    """Where a decode puts its tensors: per entry, the uint8 tensor it decodes into (None: a new
    one) and the word its checksum is numbered from (an element range of a larger tensor: its
    first word there, so the ranges' sums add up to the tensor's)."""

    tensors: list[torch.Tensor | None]
    first_words: np.ndarray

    @classmethod
    def new(cls, count: int) -> Outputs:
        return cls([None] * count, np.zeros(count, dtype=np.int64))


@dataclass(frozen=True)
class _Batch:
    """A batch being decoded: its listed chunks, each chunk's offset in the region, each stream's
    codec configuration and whether it is coded, the region and the backend."""

    listed: Listed
    at: np.ndarray  # per chunk: where its stored bytes start in the region
    codecs: list[dict[str, Any]]
    coded: np.ndarray
    region: torch.Tensor
    backend: str

    @property
    def on_gpu(self) -> bool:
        return self.backend == "cuda"


@dataclass(frozen=True)
class _Gathered:
    """The coded chunks of a batch (``rows`` of its chunk table) where a decoder reads them: on a
    GPU copied to aligned ``slots`` of ``source``, on the host in place in the region."""

    rows: np.ndarray
    slots: np.ndarray
    source: torch.Tensor


@dataclass(frozen=True)
class _Decoded:
    """Every coded stream of a batch decoded into one buffer, each at ``stream_at`` (-1: raw)."""

    buffer: torch.Tensor
    stream_at: np.ndarray


def decode_batch(entries: list[TensorEntry], region: torch.Tensor, runs: Runs, backend: str,
                 *, digests: bool, into: Outputs | None = None) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Decode the tensors whose stored bytes fill ``region`` (laid out as ``runs`` say).

    Returns their bytes (1-D uint8 on the region's device; into ``into``'s tensors where given)
    and their wsum64 (int64, for the caller to verify), numbered as ``into`` says (default: from
    word 0). ``digests``: check each chunk's wsum64 here (files of format 2); files of format 1
    carry XXH3 digests, which the reader checks on the host before the bytes get here.
    """
    listed = Listed.of(entries)
    chunks = listed.chunks
    codecs = [entries[t].streams[j].codec for t, j in listed.streams]
    batch = _Batch(listed, runs.locate(chunks.offset) if chunks.offset.size else chunks.offset, codecs,
                   np.array([c["id"] != "raw" for c in codecs], dtype=bool), region, backend)
    gathered = _checked(batch, digests)
    return _rebuild(batch, _decode_coded(batch, gathered), into or Outputs.new(len(entries)))


def _checked(batch: _Batch, digests: bool) -> _Gathered:
    """Checksum every chunk (``digests``: and compare with the index, before any decoder runs);
    on a GPU, gather the coded chunks to the aligned slots nvCOMP needs on the way."""
    chunks, region, device = batch.listed.chunks, batch.region, batch.region.device
    chunk_coded = batch.coded[chunks.stream] if chunks.stream.size else np.zeros(0, bool)
    on_gpu = batch.on_gpu
    c_sel = np.flatnonzero(chunk_coded)
    slot = -(-chunks.length[c_sel] // PLANE_ALIGN) * PLANE_ALIGN
    c_slot = np.cumsum(slot) - slot
    coded_src = torch.empty(int(slot.sum()) if on_gpu else 0, dtype=torch.uint8, device=device)
    found = torch.zeros(chunks.length.size, dtype=torch.int64, device=device)
    zeros = np.zeros(chunks.length.size, dtype=np.int64)
    r_sel = np.flatnonzero(~chunk_coded)
    if digests and r_sel.size:
        found[to_device(r_sel, device)] = segment_sums([region], zeros[r_sel], batch.at[r_sel], chunks.length[r_sel])
    if c_sel.size and (digests or on_gpu):
        gather = dict(outs=[coded_src], out_index=zeros[c_sel], out_offsets=c_slot) if on_gpu else {}
        sums = segment_sums([region], zeros[c_sel], batch.at[c_sel], chunks.length[c_sel], **gather)
        found[to_device(c_sel, device)] = sums
    if digests:
        batch.listed.verify_digests(found.cpu().numpy())  # before any decoder runs
    return _Gathered(c_sel, c_slot, coded_src) if on_gpu else _Gathered(c_sel, batch.at[c_sel], region)


def _decoders(batch: _Batch) -> list[tuple[int, Codec | None]]:
    """Per stream, its decode group and the codec that decodes it (None for raw streams): streams
    whose codecs decode alike (:meth:`~ckptzip.codecs.Codec.decoder_config`: gdeflate's algorithm
    types, zstd's levels) share one group, so one call decodes them all."""
    groups: dict[str, tuple[int, Codec]] = {}
    known: dict[str, tuple[int, Codec]] = {}  # by a stream's own configuration
    out: list[tuple[int, Codec | None]] = []
    for s, config in enumerate(batch.codecs):
        if not batch.coded[s]:
            out.append((-1, None))
            continue
        text = json.dumps(config, sort_keys=True)
        if text not in known:
            t, j = batch.listed.streams[s]
            try:
                decoder = codec_for(config, batch.backend).decoder_config()
                key = json.dumps(decoder, sort_keys=True)
                if key not in groups:
                    groups[key] = (len(groups), codec_for(decoder, batch.backend))
            except CkptzipError as exc:
                raise type(exc)(f"tensor {batch.listed.entries[t].name!r} stream {j}: {exc}") from exc
            known[text] = groups[key]
        out.append(known[text])
    return out


def _decode_coded(batch: _Batch, gathered: _Gathered) -> _Decoded:
    """Decode every coded stream into one buffer, each stream contiguous at an aligned offset."""
    listed, coded, device = batch.listed, batch.coded, batch.region.device
    chunks, entries, c_sel = listed.chunks, listed.entries, gathered.rows
    sizes = np.array([entries[t].streams[j].nbytes for t, j in listed.streams], dtype=np.int64)
    stream_slot = np.where(coded, -(-sizes // PLANE_ALIGN) * PLANE_ALIGN, 0)
    stream_at = np.where(coded, np.cumsum(stream_slot) - stream_slot, -1)
    size = int(stream_slot.sum())
    decoded = torch.empty(size, dtype=torch.uint8, device=device) if batch.on_gpu else scratch("decoded", size)
    if not c_sel.size:
        return _Decoded(decoded, stream_at)
    c_stream = chunks.stream[c_sel]
    raw = chunks.raw[c_sel]
    first = np.r_[True, c_stream[1:] != c_stream[:-1]]
    starts = np.flatnonzero(first)
    within = np.cumsum(raw) - raw
    within = within - np.repeat(within[starts], np.diff(np.r_[starts, raw.size]))
    dst = stream_at[c_stream] + within
    src, src_offsets = gathered.source, gathered.slots
    decoders = _decoders(batch)
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
            what = (listed.name(int(c_sel[m[exc.chunk]])) if isinstance(exc, CorruptChunkError)
                    else f"tensors {sorted({entries[t].name for t, _ in listed.streams})}")
            raise CorruptCheckpointError(f"{what}: {exc}") from exc
    return _Decoded(decoded, stream_at)


def _rebuild(batch: _Batch, decoded: _Decoded, into: Outputs) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Merge planes (or copy single streams) into one tensor each (new, or ``into``'s); their
    wsum64, numbered from ``into``'s first words (sparse tensors decode whole: theirs are 0)."""
    listed, coded, region = batch.listed, batch.coded, batch.region
    entries, streams, chunks = listed.entries, listed.streams, listed.chunks
    device, first_words = region.device, into.first_words
    outs = [torch.empty(e.nbytes, dtype=torch.uint8, device=device) if g is None else g
            for e, g in zip(entries, into.tensors)]
    populate(outs)  # host outputs: their pages in one call each, on this thread, before the writes below
    checksums = torch.zeros(len(entries), dtype=torch.int64, device=device)
    first_offset = np.zeros(len(streams), dtype=np.int64)  # region offset of each stream's first chunk
    with_chunks, first = distinct(chunks.stream)
    first_offset[with_chunks] = batch.at[first]
    source_base = np.where(coded, 1, 0)  # 0: the region (raw streams in place), 1: the decoded buffer
    source_offset = np.where(coded, decoded.stream_at, first_offset)
    sources = [region, decoded.buffer]
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
        sums = merge_planes([outs[t] for t in idx], k, sources, source_base[plane_streams],
                            source_offset[plane_streams], first_words[idx])
        checksums[to_device(np.array(idx), device)] = sums
    if singles:
        s_of = np.array([by_tensor[t][0] for t in singles], dtype=np.int64)
        sizes = np.array([entries[t].nbytes for t in singles], dtype=np.int64)
        sums = segment_sums(sources, source_base[s_of], source_offset[s_of], sizes, outs=outs,
                            out_index=np.array(singles), out_offsets=np.zeros(len(singles), np.int64),
                            first_words=first_words[singles])
        checksums[to_device(np.array(singles), device)] = sums  # of the bytes copied: each whole output
    if sparse:
        assert not first_words[sparse].any(), "a sparse tensor decodes whole"
        views = [[_view(sources[source_base[s]], int(source_offset[s]), entries[t].streams[j].nbytes)
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
