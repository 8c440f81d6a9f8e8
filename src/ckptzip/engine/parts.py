"""A tensor larger than a GPU's budget allows in one batch, coded on that GPU in element ranges.

Each byte plane (the whole bytes, for tensors not split into planes) is coded a range at a time:
plane 0 of every range, then plane 1, and so on, so each stream's chunks lie back to back in the
file as the format's tiling requires, and the GPU holds about three times one range's bytes,
not the tensor's. Each stream's codec is chosen once, from a sample of the tensor, and kept for
every range (a stream has one codec). The writer's sink joins the ranges' chunks into the one
table entry a whole-tensor batch would have produced (:class:`~.encode.Part`).

A load decodes a stored tensor larger than a batch in element ranges too, cut where every stream
has a chunk boundary (:func:`stored_ranges`), each straight into its part of the output.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..format import StreamEntry, TensorEntry
from ..kernels.segments import segment_sums
from ..memory import blocks
from ..transforms import BytePlanes
from .chunks import Chunks
from .encode import EncodedBatch, Part, Recipe, StreamRecord, tensor_bytes
from .estimate import RANDOM_ENTROPY_BITS, entropy_of_count_array, middle, plane_counts
from .policy import RAW, SMALL_TENSOR_BYTES, Policy, codec_for

# Range boundaries fall on multiples of this many plane bytes: every codec's own chunk size divides
# it, so the ranges' chunks are the chunks a whole-tensor batch would have cut (a Policy's chunk
# size that does not divide it leaves each range's last chunk short, in an equally valid file).
RANGE_ALIGN = 16 << 20
_SAMPLE_BYTES = 1 << 22


@dataclass(frozen=True)
class Range:
    """Elements ``[first, end)`` of stream ``stream`` of a tensor coded in parts."""

    stream: int
    first: int
    end: int


@dataclass(frozen=True)
class Ranged:
    """A tensor coded in element ranges: how many streams it is stored as (its byte planes, or 1:
    its bytes as they are), each stream's codec, and the policy and backend that code them."""

    tensor: torch.Tensor
    streams: int
    codecs: list[dict[str, Any]]
    policy: Policy
    backend: str

    @classmethod
    def of(cls, tensor: torch.Tensor, policy: Policy, backend: str) -> Ranged:
        nbytes = tensor.numel() * tensor.element_size()
        split = policy.splits(np.array([tensor.element_size()]), np.array([nbytes]))[0]
        streams = tensor.element_size() if split else 1
        return cls(tensor, streams, _stream_codecs(tensor, streams, policy, backend), policy, backend)

    def ranges(self, range_bytes: int) -> list[Range]:
        """Each part of about ``range_bytes``, in file order."""
        elements = self.tensor.numel() * self.tensor.element_size() // self.streams  # bytes of one stream
        step = max(RANGE_ALIGN, range_bytes // RANGE_ALIGN * RANGE_ALIGN)
        cuts = [*range(0, elements, step), elements]
        return [Range(j, a, b) for j in range(self.streams) for a, b in itertools.pairwise(cuts)]


def quarters(part: Range) -> list[Range]:
    """A part cut in about four (at multiples of RANGE_ALIGN): what is tried after it ran out of
    GPU memory; none when it is one RANGE_ALIGN or less."""
    if part.end - part.first <= RANGE_ALIGN:
        return []
    step = max(RANGE_ALIGN, (part.end - part.first) // 4 // RANGE_ALIGN * RANGE_ALIGN)
    cuts = [*range(part.first, part.end, step), part.end]
    return [Range(part.stream, a, b) for a, b in itertools.pairwise(cuts)]


def _stream_codecs(tensor: torch.Tensor, streams: int, policy: Policy, backend: str) -> list[dict[str, Any]]:
    """Each stream's codec, chosen from a sample of the tensor as a whole-tensor batch chooses
    (structured planes coded, near-random float planes stored raw)."""
    data = tensor_bytes(tensor)
    nbytes = data.numel()
    if streams == 1:
        return [policy.whole_codec(backend, nbytes).get_config()]
    plane = policy.plane_codec(backend).get_config()
    if not (tensor.dtype.is_floating_point or tensor.dtype.is_complex):
        return [plane] * streams
    sample = data[middle(nbytes, _SAMPLE_BYTES, streams)]
    entropy = entropy_of_count_array(plane_counts([sample], streams))[0]
    return [plane if e < RANDOM_ENTROPY_BITS else RAW for e in entropy.tolist()]


def encode_part(ranged: Ranged, part: Range, last: bool) -> EncodedBatch:
    """Code ``part`` of a tensor (a batch of one tensor whose one stream is this range); the
    ``last`` part also carries the whole tensor's checksum."""
    data, streams, backend = tensor_bytes(ranged.tensor), ranged.streams, ranged.backend
    config = ranged.codecs[part.stream]
    size = part.end - part.first
    piece = data[part.first : part.end]
    if streams > 1:  # the range of one plane, gathered
        piece = blocks.empty(size, data.device).copy_(data.view(-1, streams)[part.first : part.end, part.stream])
    cb = ranged.policy.chunk_bytes_for(codec_for(config, backend))
    raw_offsets = np.arange(0, size, cb, dtype=np.int64)
    raw_lengths = np.minimum(cb, size - raw_offsets)
    if config["id"] == "raw":
        base, offsets, lengths = piece, raw_offsets, raw_lengths
    else:
        base, offsets, lengths = codec_for(config, backend).encode_segments(piece, raw_offsets, raw_lengths)
    chunks = Chunks.gathered(raw_lengths, lengths.astype(np.int64))
    stored = blocks.empty(int(lengths.sum()), data.device)
    zeros = np.zeros(lengths.size, dtype=np.int64)
    digests = segment_sums([base], zeros, offsets, lengths, outs=[stored], out_index=zeros, out_offsets=chunks.offset)
    checksum = (segment_sums([data], np.zeros(1, np.int64), np.zeros(1, np.int64), np.array([data.numel()]))
                if last else torch.zeros(1, dtype=torch.int64, device=data.device))
    recipe = Recipe(BytePlanes(streams) if streams > 1 else None, (StreamRecord(config, size, int(lengths.size)),))
    return EncodedBatch(stored, chunks, digests, checksum, [recipe], Part(part.stream, streams, last))


def worth_parts(tensor: torch.Tensor) -> bool:
    """Whether a tensor is big enough that coding it in ranges (not on the host) is the choice."""
    return tensor.numel() * tensor.element_size() >= max(SMALL_TENSOR_BYTES, RANGE_ALIGN)


def stored_ranges(entry: TensorEntry, limit: int) -> list[tuple[TensorEntry, int]] | None:
    """A tensor larger than ``limit`` (its byte planes, or its one stream) as element ranges cut
    where every stream has a chunk boundary, so each range decodes on its own into its part of
    the output: (an entry for the range, its byte offset in the tensor) each. None when no cut is needed or possible (sparse
    tensors, whose streams are not element ranges: they decode whole)."""
    k = len(entry.streams)
    planes = isinstance(entry.transform, BytePlanes)
    if entry.nbytes <= limit or not ((planes and k > 1) or (entry.transform is None and k == 1)):
        return None
    ends = [np.cumsum(s.columns.raw_length) for s in entry.streams]
    common = functools.reduce(np.intersect1d, ends)
    common = common[common * k % 8 == 0]  # parts start at whole words: their checksums add up (.decode.decode_batch)
    cuts = [0]
    for boundary in common.tolist():
        if boundary - cuts[-1] >= limit // k or boundary == ends[0][-1]:
            cuts.append(boundary)
    if len(cuts) <= 2:
        return None
    out = []
    for a, b in itertools.pairwise(cuts):
        streams = [StreamEntry(s.codec, b - a, [c for c, end in zip(s.chunks, e.tolist()) if a < end <= b])
                   for s, e in zip(entry.streams, ends)]
        part = TensorEntry(entry.name, "uint8", ((b - a) * k,), (b - a) * k, entry.checksum, entry.transforms,
                           streams, entry.device)
        out.append((part, a * k))
    return out
