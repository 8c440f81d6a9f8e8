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

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..codecs.base import Segments
from ..kernels.planes import PLANE_ALIGN, plane_layout, split_planes
from ..kernels.segments import segment_sums, tensor_sums
from ..memory import blocks
from ..memory.pages import fresh
from ..memory.scratch import scratch
from ..memory.tables import to_device
from ..transforms import BytePlanes, Sparse, Transform
from ..transforms.sparse import forward_many
from .choice import Coding, choose_codecs
from .chunks import Chunks
from .estimate import entropy_of_count_array, entropy_of_counts
from .policy import RAW, Policy, codec_for
from .streams import PLANE, SPARSE, WHOLE, Batch, BatchBuilder


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
    chunks: Chunks  # in table order, each where it lies in ``stored``
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


def _planes_buffer(nbytes: int, device: torch.device) -> torch.Tensor:
    """The buffer of a batch's planes and whole streams: on the host, this thread's (a CPU batch
    is started and finished on one thread, and nothing holds its planes after :meth:`PendingBatch.finish`
    gathers the stored chunks), so the pages a large tensor's planes need are faulted in once a
    thread, not once a batch."""
    return blocks.empty(nbytes, device) if device.type == "cuda" else scratch("planes", nbytes)


def _aligned_layout(sizes: np.ndarray) -> tuple[np.ndarray, int]:
    slots = -(-sizes // PLANE_ALIGN) * PLANE_ALIGN
    return np.cumsum(slots) - slots, int(slots.sum())


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
    builder = BatchBuilder(count)
    # one buffer holds every plane and every whole stream, in sections (one per item size, then
    # the whole streams), each at a multiple of PLANE_ALIGN
    layouts = [(k, idx, *plane_layout(nbytes[idx], k)) for k in (2, 4, 8)
               if (idx := np.flatnonzero(split & (itemsize == k))).size]
    whole = np.flatnonzero(~split & (nonzero < 0))
    whole_offsets, whole_total = _aligned_layout(nbytes[whole])
    sizes = [layout[4] for layout in layouts] + ([max(whole_total, 1)] if whole.size else [])
    sections = list(_planes_buffer(sum(sizes), device).split(sizes)) if sizes else []
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
    coding = choose_codecs(batch, _plane_entropies(hist) if entropies is None else entropies, floating, policy,
                            backend)
    return _queue_codecs(batch, coding, policy, backend)


def _sparse_streams(datas: list[torch.Tensor], idx: np.ndarray, itemsize: np.ndarray, nonzero: np.ndarray,
                    builder: BatchBuilder) -> torch.Tensor:
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


def _plane_entropies(hist: torch.Tensor) -> np.ndarray:
    """Entropy in bits/byte of each tensor's sampled plane bytes (``[tensors, 8]``): on a GPU,
    the wait for the split."""
    if hist.is_cuda:
        return entropy_of_counts(hist.view(-1, 8, 256)).cpu().numpy()
    return entropy_of_count_array(hist.numpy().reshape(-1, 8, 256))


@dataclass(frozen=True)
class _Call:
    """A queued codec call: the streams it codes, their chunks (rows of the chunk table) and its
    result, once waited for."""

    members: list[int]
    rows: np.ndarray
    queued: Segments


@dataclass
class PendingBatch:
    """A batch whose codecs are queued (:func:`start_batch`): its chunks (where their bytes lie
    so far) and each codec call; :meth:`finish` reads the coded sizes and gathers the stored
    chunks."""

    batch: Batch
    configs: list[dict[str, Any]]
    nchunks: np.ndarray
    chunks: Chunks
    calls: list[_Call]

    def finish(self) -> EncodedBatch:
        """Fall back to raw where coding did not shrink a stream, then gather all stored chunks
        in file order (on a GPU: queued, after one wait for the coded sizes)."""
        batch, chunks = self.batch, self.chunks
        c_stream, c_length = chunks.stream, chunks.length
        size, bases = batch.streams.size, batch.bases
        stream_codec = list(self.configs)
        for call in self.calls:
            sel = call.rows
            out, out_offsets, out_lengths = call.queued()
            coded_total = np.bincount(c_stream[sel], weights=out_lengths, minlength=size.size)
            shrinks = coded_total[c_stream[sel]] < size[c_stream[sel]]
            keep = sel[shrinks]
            chunks.base[keep] = len(bases)
            chunks.offset[keep] = out_offsets[shrinks]
            c_length[keep] = out_lengths[shrinks]
            bases.append(out)
            for s in call.members:
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
        device = batch.checksums.device
        stored = blocks.empty(int(c_length.sum()), device) if device.type == "cuda" else fresh(int(c_length.sum()))
        zeros = np.zeros(c_length.size, np.int64)
        digests = segment_sums(bases, chunks.base, chunks.offset, c_length, outs=[stored], out_index=zeros,
                               out_offsets=out_offsets)
        return EncodedBatch(stored, dataclasses.replace(chunks, base=zeros, offset=out_offsets), digests,
                            batch.checksums, _recipes(batch, stream_codec, self.nchunks))


def _queue_codecs(batch: Batch, coding: Coding, policy: Policy, backend: str) -> PendingBatch:
    """Chunk every stream and queue the coding of the coded ones (one call per codec and buffer;
    streams in ``coding.precoded`` were coded by a trial, as one chunk)."""
    streams, bases, configs = batch.streams, batch.bases, coding.configs
    size = streams.size
    cb = policy.chunk_sizes(configs, backend)
    nchunks = -(-size // np.maximum(cb, 1))
    chunks = Chunks.cut(nchunks, cb, size, streams.base, streams.offset)
    groups: dict[tuple[str, int], list[int]] = {}
    first_chunk = np.cumsum(nchunks) - nchunks
    for s, config in enumerate(configs):
        if s in coding.precoded:  # one chunk
            chunks.base[first_chunk[s]], chunks.offset[first_chunk[s]], chunks.length[first_chunk[s]] = \
                coding.precoded[s]
        elif config["id"] != "raw" and nchunks[s]:
            groups.setdefault((_key(config), int(streams.base[s])), []).append(s)
    calls: list[_Call] = []
    for (_, base), members in groups.items():
        sel = np.flatnonzero(np.isin(chunks.stream, members))
        queued = codec_for(configs[members[0]], backend).queue_segments(bases[base], chunks.offset[sel], chunks.raw[sel])
        calls.append(_Call(members, sel, queued))
    return PendingBatch(batch, configs, nchunks, chunks, calls)


def _recipes(batch: Batch, codecs: list[dict[str, Any]], nchunks: np.ndarray) -> list[Recipe]:
    """Each tensor's recipe: its transform, and its streams as they were stored."""
    records: list[list[StreamRecord]] = [[] for _ in batch.transforms]
    for t, config, nbytes, chunks in zip(batch.streams.tensor.tolist(), codecs, batch.streams.size.tolist(),
                                         nchunks.tolist()):
        records[t].append(StreamRecord(config, nbytes, chunks))
    return [Recipe(transform, tuple(streams)) for transform, streams in zip(batch.transforms, records)]


def _key(config: dict[str, Any]) -> str:
    return repr(sorted(config.items()))
