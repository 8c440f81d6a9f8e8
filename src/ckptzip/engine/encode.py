"""Tensors → stored chunks, a batch at a time, on one backend (a CUDA device or the CPU).

One pass splits every multi-byte tensor of the batch into byte planes (one launch per item size,
checksums and sampled byte counts included); one host sync reads the plane entropies (unless they
were read ahead, :func:`~.estimate.sampled_plane_entropies`); the policy codes the planes that
carry structure, with one codec call per codec, queued (:func:`start_batch`); then
:meth:`PendingBatch.finish` waits for the coded sizes and a last pass gathers every stored chunk
into one buffer in file order and checksums each chunk. A GPU's batches are finished one behind:
the host splits the next while the GPU codes this one. The plan is built with NumPy
over the whole batch: no Python work per chunk. XOR residues with few non-zero elements are coded
sparse instead (:class:`~ckptzip.transforms.Sparse`: a bitmap and the non-zero values' planes,
each coded as a near-constant float plane is).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .. import blocks
from ..codecs.base import Segments
from ..kernels import distinct
from ..kernels.planes import PLANE_ALIGN, plane_layout, split_planes
from ..kernels.segments import segment_sums, tensor_sums
from ..transforms import BytePlanes, Sparse, Transform
from ..transforms.sparse import forward_many
from ..uploads import to_device
from .estimate import RANDOM_ENTROPY_BITS, entropy_of_count_array, entropy_of_counts
from .policy import (LOW_ENTROPY_BITS, RAW, SPARSE_LZ_MAX_DENSITY, STRUCTURED_TRIAL_BYTES, TRIAL_BYTES, TRIAL_MIN_GAIN,
                     Policy, codec_for)


@dataclass(frozen=True)
class StreamRecord:
    """One stream of a tensor: its codec configuration, decoded size and number of chunks."""

    codec: dict[str, Any]
    nbytes: int
    chunks: int


@dataclass(frozen=True)
class Recipe:
    """How one tensor's bytes are stored: the transform that makes its streams (None: its bytes
    as one stream) and each stream's coding, in order. The writer records it in the index as the
    entry's ``transforms`` and ``streams``, which a reader dispatches on as ``TensorEntry.transform``."""

    transform: Transform | None
    streams: tuple[StreamRecord, ...]

    @property
    def transforms(self) -> list[dict[str, Any]]:
        """The transform as the index writes it: a list of at most one configuration."""
        return [] if self.transform is None else [self.transform.get_config()]


@dataclass(frozen=True)
class Part:
    """A batch that is one element range of one stream of a tensor coded in parts
    (:mod:`.parts`): its stream's number, the tensor's stream count, whether it is the last."""

    stream: int
    streams: int
    last: bool


@dataclass
class EncodedBatch:
    """A batch ready to be written: its stored chunks back to back in file order, and what the
    index needs (chunks listed in table order). Tensors stay on the backend's device until the
    writer copies them out."""

    stored: torch.Tensor  # 1-D uint8
    offsets: np.ndarray  # where each chunk lies in ``stored`` (chunks in table order)
    lengths: np.ndarray  # stored bytes of each chunk
    raw_lengths: np.ndarray  # decoded bytes of each chunk
    digests: torch.Tensor  # wsum64 of each stored chunk (int64)
    checksums: torch.Tensor  # wsum64 of each tensor (int64)
    recipes: list[Recipe]  # each tensor's, in table order
    part: Part | None = None  # a range of a tensor coded in parts (its one tensor's checksum: on the last)


def tensor_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's elements in C order as a 1-D uint8 tensor on its device (no copy if contiguous)."""
    t = tensor.detach()
    if t.is_conj() or t.is_neg():  # lazy conj/neg views have no byte view
        t = t.resolve_conj().resolve_neg()
    if not t.is_contiguous():
        t = t.contiguous()
    return t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8, device=t.device)


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeros on ``device``; from NumPy on the CPU (torch fills compete for OpenMP threads there)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    return torch.from_numpy(np.zeros(shape, dtype=torch.empty(0, dtype=dtype).numpy().dtype))


def _aligned_layout(sizes: np.ndarray) -> tuple[np.ndarray, int]:
    slots = -(-sizes // PLANE_ALIGN) * PLANE_ALIGN
    return np.cumsum(slots) - slots, int(slots.sum())


WHOLE, PLANE, SPARSE = 0, 1, 2  # what a stream is: a tensor's bytes, one of its byte planes, a part of a sparse coding


@dataclass(frozen=True)
class Streams:
    """The streams of a batch, in tensor order and each tensor's streams in order: per stream,
    its tensor, the buffer it lies in (an index into the batch's buffers), its offset there, its
    size in bytes, what it is (``WHOLE``, ``PLANE``, ``SPARSE``) and its number among its
    tensor's streams."""

    tensor: np.ndarray
    base: np.ndarray
    offset: np.ndarray
    size: np.ndarray
    kind: np.ndarray
    index: np.ndarray

    def __len__(self) -> int:
        return int(self.size.size)


@dataclass
class _Batch:
    """A batch being encoded: its buffers (planes, sparse parts, whole streams; codec outputs are
    appended as they are made), the streams that lie in them, each tensor's transform and
    checksum (wsum64, int64 on the batch's device)."""

    bases: list[torch.Tensor]
    streams: Streams
    transforms: list[Transform | None]
    checksums: torch.Tensor


@dataclass
class _Coding:
    """What a batch's streams are coded with: per stream, the codec configuration it is tried with
    (``RAW``: stored as it is); and the streams a trial already coded whole, as one chunk: stream ->
    (index in the batch's buffers, offset, length) of that coding (:func:`_trial`)."""

    configs: list[dict[str, Any]]
    precoded: dict[int, tuple[int, int, int]]


class _BatchBuilder:
    """Collects a batch's buffers and their streams, buffer by buffer, and each tensor's
    transform; :meth:`build` puts the streams in order."""

    def __init__(self, count: int) -> None:
        self.bases: list[torch.Tensor] = []
        self.transforms: list[Transform | None] = [None] * count
        self._parts: list[tuple[np.ndarray, ...]] = []

    def add(self, buffer: torch.Tensor, tensor: np.ndarray, offset: np.ndarray, size: np.ndarray, kind: int) -> None:
        """A buffer holding streams of ``tensor`` (one entry per stream) at ``offset``, of ``size``."""
        self._parts.append((tensor, np.full(tensor.size, len(self.bases), dtype=np.int64), offset, size,
                            np.full(tensor.size, kind, dtype=np.int8)))
        self.bases.append(buffer)

    def build(self, checksums: torch.Tensor) -> _Batch:
        if not self._parts:
            empty = np.zeros(0, np.int64)
            return _Batch(self.bases, Streams(empty, empty, empty, empty, np.zeros(0, np.int8), empty), self.transforms,
                          checksums)
        tensor, base, offset, size, kind = (np.concatenate(c) for c in zip(*self._parts))
        order = np.lexsort((offset, tensor))  # tensor order, then plane order (planes lie in order)
        tensor, base, offset, size, kind = (c[order] for c in (tensor, base, offset, size, kind))
        first = np.r_[True, tensor[1:] != tensor[:-1]]
        group_start = np.maximum.accumulate(np.where(first, np.arange(tensor.size), 0))
        streams = Streams(tensor, base, offset, size, kind, np.arange(tensor.size) - group_start)
        return _Batch(self.bases, streams, self.transforms, checksums)


def encode_batch(tensors: list[torch.Tensor], policy: Policy, backend: str,
                 sparse: Sequence[int | None] | None = None) -> EncodedBatch:
    """Encode tensors that all live on the backend's device (``backend`` "cuda": one CUDA device;
    "cpu": host memory) into one :class:`EncodedBatch`. ``sparse``: per tensor, its number of
    non-zero elements where it is to be coded sparse (XOR residues, :mod:`.delta`), else None."""
    return start_batch(tensors, policy, backend, sparse).finish()


def start_batch(tensors: list[torch.Tensor], policy: Policy, backend: str,
                sparse: Sequence[int | None] | None = None, entropies: np.ndarray | None = None) -> PendingBatch:
    """:func:`encode_batch` up to its codecs: on a GPU queued, not waited for, so the host can
    prepare the next batch while they run. ``entropies``: each tensor's plane entropies
    (``[tensors, 8]`` bits/byte, :func:`~.estimate.sampled_plane_entropies`), known ahead; without
    them the split's sampled byte counts are read, which waits for the split."""
    datas = [tensor_bytes(t) for t in tensors]
    device = datas[0].device
    count = len(datas)
    nbytes = np.array([d.numel() for d in datas], dtype=np.int64)
    itemsize = np.array([t.element_size() for t in tensors], dtype=np.int64)
    floating = np.array([t.dtype.is_floating_point or t.dtype.is_complex for t in tensors])
    nonzero = np.array([-1 if c is None else c for c in sparse or [None] * count], dtype=np.int64)
    split = policy.splits(itemsize, nbytes) & (nonzero < 0)
    hist = _zeros((count, 8 * 256), torch.int32, device)
    checksums = _zeros((count,), torch.int64, device)
    builder = _BatchBuilder(count)
    # one buffer holds every plane and every whole stream, in sections (one per item size, then
    # the whole streams), each at a multiple of PLANE_ALIGN
    layouts = [(k, idx, *plane_layout(nbytes[idx], k)) for k in (2, 4, 8)
               if (idx := np.flatnonzero(split & (itemsize == k))).size]
    whole = np.flatnonzero(~split & (nonzero < 0))
    whole_offsets, whole_total = _aligned_layout(nbytes[whole])
    sizes = [layout[4] for layout in layouts] + ([max(whole_total, 1)] if whole.size else [])
    sections = list(blocks.empty(sum(sizes), device).split(sizes)) if sizes else []
    for (k, idx, starts, strides, _), planes in zip(layouts, sections):
        checksums[to_device(idx, device)] = split_planes(
            [datas[i] for i in idx], k, planes, starts, strides, hist, idx)
        offsets = starts[:, None] + strides[:, None] * np.arange(k)[None, :]
        builder.add(planes, np.repeat(idx, k), offsets.reshape(-1), np.repeat(nbytes[idx] // k, k), PLANE)
        transform = BytePlanes(k)
        for i in idx.tolist():
            builder.transforms[i] = transform
    coded_sparse = np.flatnonzero(nonzero >= 0)
    if coded_sparse.size:
        checksums[to_device(coded_sparse, device)] = _sparse_streams(datas, coded_sparse, itemsize, nonzero, builder)
    if whole.size:
        offsets, buffer = whole_offsets, sections[-1]
        nonempty = whole[nbytes[whole] > 0]
        sums = segment_sums([datas[i] for i in nonempty], np.arange(nonempty.size), np.zeros(nonempty.size, np.int64),
                            nbytes[nonempty], outs=[buffer], out_index=np.zeros(nonempty.size, np.int64),
                            out_offsets=offsets[nbytes[whole] > 0])
        checksums[to_device(nonempty, device)] = sums
        builder.add(buffer, whole, offsets, nbytes[whole], WHOLE)
    batch = builder.build(checksums)
    coding = _choose_codecs(batch, _plane_entropies(hist) if entropies is None else entropies, floating, policy,
                            backend)
    return _queue_codecs(batch, coding, policy, backend)


def _sparse_streams(datas: list[torch.Tensor], idx: np.ndarray, itemsize: np.ndarray, nonzero: np.ndarray,
                    builder: _BatchBuilder) -> torch.Tensor:
    """The sparse streams of tensors ``idx`` (bitmap, value planes) into one buffer, each at an
    aligned offset, added to ``builder`` with their transforms; returns their wsum64."""
    coded = [Sparse(int(itemsize[i]), int(nonzero[i])) for i in idx]
    parts = forward_many(coded, [datas[i] for i in idx])
    sizes = np.array([p.numel() for ps in parts for p in ps], dtype=np.int64)
    offsets, total = _aligned_layout(sizes)
    pad = torch.zeros(PLANE_ALIGN, dtype=torch.uint8, device=datas[0].device)
    ends = np.r_[offsets[1:], total]
    pieces = [x for p, a, b in zip((p for ps in parts for p in ps), offsets + sizes, ends) for x in (p, pad[: b - a])]
    builder.add(torch.cat(pieces, out=blocks.empty(total, datas[0].device)),
                np.repeat(idx, [len(ps) for ps in parts]), offsets, sizes, SPARSE)
    for t, i in zip(coded, idx.tolist()):
        builder.transforms[i] = t
    return tensor_sums([datas[i] for i in idx])


def _choose_codecs(batch: _Batch, entropies: np.ndarray, floating: np.ndarray, policy: Policy, backend: str
                   ) -> _Coding:
    """The codec each stream of ``batch`` is tried with (``entropies``: each tensor's plane
    entropies), and the streams a trial already coded whole (:func:`_trial`). ``SPARSE`` streams (a sparse residue's bitmap and its values' planes)
    are coded as structured planes are, but a bitmap so sparse that it is nearly all zero bytes
    as near-constant planes are (:data:`~.policy.SPARSE_LZ_MAX_DENSITY`)."""
    streams = batch.streams
    plane_codec = policy.plane_codec(backend).get_config()
    coding = _Coding([], {})
    if not len(streams):
        return coding
    is_plane = streams.kind == PLANE
    if is_plane.any():
        plane_entropy = entropies[streams.tensor, np.minimum(streams.index, 7)]
    candidates = policy.plane_candidates(backend)
    trials = policy.samples_planes(backend)
    low = policy.low_entropy_candidate(backend)
    configs = coding.configs
    structured: list[int] = []
    random: list[int] = []
    for s in range(len(streams)):
        size = int(streams.size[s])
        if size == 0:
            configs.append(RAW)
        elif streams.kind[s] == SPARSE:
            bitmap = streams.index[s] == 0
            configs.append(low if low is not None and bitmap and _density(batch, s) <= SPARSE_LZ_MAX_DENSITY
                           else candidates[0])
            if trials and len(candidates) > 1:
                structured.append(s)
        elif not is_plane[s]:
            configs.append(policy.whole_codec(backend, size).get_config())
        elif not floating[streams.tensor[s]]:
            configs.append(plane_codec)
        elif low is not None and plane_entropy[s] < LOW_ENTROPY_BITS:
            configs.append(low)
        elif plane_entropy[s] < RANDOM_ENTROPY_BITS:
            configs.append(candidates[0])
            if trials and len(candidates) > 1:
                structured.append(s)
        else:
            configs.append(RAW)
            if trials and size >= 4 * TRIAL_BYTES:
                random.append(s)
    # Trials on samples: structured planes pick their candidate; near-random ones are coded only
    # where the plane codec shrinks them.
    for tried, options, sample in ((structured, candidates, STRUCTURED_TRIAL_BYTES), (random, candidates[:1], TRIAL_BYTES)):
        if tried:
            picks, whole = _trial(np.array(tried), batch, options, sample, policy, backend)
            for s, config in zip(tried, picks):
                configs[s] = config
            coding.precoded.update(whole)
    return coding


def _density(batch: _Batch, s: int) -> float:
    """The share of non-zero elements of the sparse residue whose bitmap is stream ``s``."""
    transform = batch.transforms[int(batch.streams.tensor[s])]
    assert isinstance(transform, Sparse)
    return transform.count / max(1, 8 * int(batch.streams.size[s]))


def _plane_entropies(hist: torch.Tensor) -> np.ndarray:
    """Entropy in bits/byte of each tensor's sampled plane bytes (``[tensors, 8]``): on a GPU,
    the wait for the split."""
    if hist.is_cuda:
        return entropy_of_counts(hist.view(-1, 8, 256)).cpu().numpy()
    return entropy_of_count_array(hist.numpy().reshape(-1, 8, 256))


def _trial(picked: np.ndarray, batch: _Batch, candidates: list[dict[str, Any]], sample: int, policy: Policy,
           backend: str) -> tuple[list[dict[str, Any]], dict[int, tuple[int, int, int]]]:
    """For each stream ``picked`` of ``batch``: the candidate that codes a sample from its
    middle (up to ``sample`` bytes) smallest, or RAW where none shrinks it by TRIAL_MIN_GAIN. One batched codec
    call per candidate and buffer. The first two candidates code every sample; each later one
    (a slower search for matches) only those where the one before it coded smallest so far, since
    more search pays only where the matches found so far did.

    A sample that is a whole stream of one chunk was coded as the stream is stored: such streams
    are returned too, as stream -> (index in ``batch.bases``, offset, length) of the picked
    coding, whose output buffers are appended to ``batch.bases``, so they are not coded again."""
    streams, bases = batch.streams, batch.bases
    base_of, size = streams.base[picked], streams.size[picked]
    n = np.minimum(size, sample)
    start = streams.offset[picked] + (size - n) // 2
    coded = np.full((len(candidates), picked.size), np.iinfo(np.int64).max, dtype=np.int64)
    where = np.empty((2, len(candidates), picked.size), dtype=np.int64)  # output buffer, offset
    outputs: list[torch.Tensor] = []
    for c, config in enumerate(candidates):
        codec = codec_for(config, backend)
        tried = np.ones(picked.size, dtype=bool) if c < 2 else coded[c - 1] < coded[: c - 1].min(axis=0)
        for base in distinct(base_of[tried])[0].tolist():
            sel = tried & (base_of == base)
            out, where[1, c, sel], coded[c, sel] = codec.encode_segments(bases[base], start[sel], n[sel])
            where[0, c, sel] = len(outputs)
            outputs.append(out)
    best = coded.argmin(axis=0)  # ties: the first candidate (the fastest)
    cols = np.arange(picked.size)
    shrinks = coded[best, cols] < (1 - TRIAL_MIN_GAIN) * n
    picks = [candidates[b] if ok else RAW for b, ok in zip(best.tolist(), shrinks.tolist())]
    whole: dict[int, tuple[int, int, int]] = {}
    used: dict[int, int] = {}  # output buffer -> its index in bases
    one_chunk = (n == size) & (n <= policy.chunk_sizes(candidates, backend)[best])
    for i in np.flatnonzero(shrinks & one_chunk).tolist():
        buffer = int(where[0, best[i], i])
        if buffer not in used:
            used[buffer] = len(bases)
            bases.append(outputs[buffer])
        whole[int(picked[i])] = (used[buffer], int(where[1, best[i], i]), int(coded[best[i], i]))
    return picks, whole


@dataclass
class PendingBatch:
    """A batch whose codecs are queued (:func:`start_batch`): its chunks (per chunk: stream, raw
    length, and where its bytes lie so far) and each codec call's members, chunks and result;
    :meth:`finish` reads the coded sizes and gathers the stored chunks."""

    batch: _Batch
    configs: list[dict[str, Any]]
    nchunks: np.ndarray
    c_stream: np.ndarray
    c_raw: np.ndarray
    c_base: np.ndarray
    c_offset: np.ndarray
    c_length: np.ndarray
    calls: list[tuple[list[int], np.ndarray, Segments]]

    def finish(self) -> EncodedBatch:
        """Fall back to raw where coding did not shrink a stream, then gather all stored chunks
        in file order (on a GPU: queued, after one wait for the coded sizes)."""
        batch, c_stream, c_base, c_offset, c_length = (self.batch, self.c_stream, self.c_base, self.c_offset,
                                                       self.c_length)
        size, bases = batch.streams.size, batch.bases
        stream_codec = list(self.configs)
        for members, sel, queued in self.calls:
            out, out_offsets, out_lengths = queued()
            coded_total = np.bincount(c_stream[sel], weights=out_lengths, minlength=size.size)
            shrinks = coded_total[c_stream[sel]] < size[c_stream[sel]]
            keep = sel[shrinks]
            c_base[keep] = len(bases)
            c_offset[keep] = out_offsets[shrinks]
            c_length[keep] = out_lengths[shrinks]
            bases.append(out)
            for s in members:
                if coded_total[s] >= size[s]:
                    stream_codec[s] = RAW
        # File order within the batch: raw streams of whole 16-byte words first (so they are copied
        # and checksummed word-wise at aligned addresses), then the rest; each stream back to back.
        raw_stream = np.array([c["id"] == "raw" for c in stream_codec], dtype=bool)
        first = raw_stream & (size % 16 == 0)
        order = np.argsort(~first[c_stream], kind="stable")
        lengths_in_order = c_length[order]
        out_offsets = np.empty_like(c_length)
        out_offsets[order] = np.cumsum(lengths_in_order) - lengths_in_order
        stored = blocks.empty(int(c_length.sum()), batch.checksums.device)
        digests = segment_sums(bases, c_base, c_offset, c_length, outs=[stored],
                               out_index=np.zeros(c_length.size, np.int64), out_offsets=out_offsets)
        return EncodedBatch(stored, out_offsets, c_length, self.c_raw, digests, batch.checksums,
                            _recipes(batch, stream_codec, self.nchunks))


def _queue_codecs(batch: _Batch, coding: _Coding, policy: Policy, backend: str) -> PendingBatch:
    """Chunk every stream and queue the coding of the coded ones (one call per codec and buffer;
    streams in ``coding.precoded`` were coded by a trial, as one chunk)."""
    streams, bases, configs = batch.streams, batch.bases, coding.configs
    size = streams.size
    cb = policy.chunk_sizes(configs, backend)
    nchunks = -(-size // np.maximum(cb, 1))
    c_stream = np.repeat(np.arange(size.size), nchunks)
    within = np.arange(c_stream.size) - np.repeat(np.cumsum(nchunks) - nchunks, nchunks)
    c_raw = np.minimum(cb[c_stream], size[c_stream] - within * cb[c_stream])
    c_base = streams.base[c_stream].copy()
    c_offset = streams.offset[c_stream] + within * cb[c_stream]
    c_length = c_raw.copy()
    groups: dict[tuple[str, int], list[int]] = {}
    first_chunk = np.cumsum(nchunks) - nchunks
    for s, config in enumerate(configs):
        if s in coding.precoded:  # one chunk
            c_base[first_chunk[s]], c_offset[first_chunk[s]], c_length[first_chunk[s]] = coding.precoded[s]
        elif config["id"] != "raw" and nchunks[s]:
            groups.setdefault((_key(config), int(streams.base[s])), []).append(s)
    calls: list[tuple[list[int], np.ndarray, Segments]] = []
    for (_, base), members in groups.items():
        sel = np.flatnonzero(np.isin(c_stream, members))
        queued = codec_for(configs[members[0]], backend).queue_segments(bases[base], c_offset[sel], c_raw[sel])
        calls.append((members, sel, queued))
    return PendingBatch(batch, configs, nchunks, c_stream, c_raw, c_base, c_offset, c_length, calls)


def _recipes(batch: _Batch, codecs: list[dict[str, Any]], nchunks: np.ndarray) -> list[Recipe]:
    """Each tensor's recipe: its transform, and its streams as they were stored."""
    records: list[list[StreamRecord]] = [[] for _ in batch.transforms]
    for t, config, nbytes, chunks in zip(batch.streams.tensor.tolist(), codecs, batch.streams.size.tolist(),
                                         nchunks.tolist()):
        records[t].append(StreamRecord(config, nbytes, chunks))
    return [Recipe(transform, tuple(streams)) for transform, streams in zip(batch.transforms, records)]


def _key(config: dict[str, Any]) -> str:
    return repr(sorted(config.items()))
