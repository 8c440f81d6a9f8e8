"""Which codec each stream of a batch is tried with: by what the stream is (a byte plane, a
sparse part, a tensor's whole bytes) and its plane's sampled entropy, and, where the policy asks,
by trials on samples (:func:`trial`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..kernels import distinct
from ..transforms import Sparse
from .estimate import RANDOM_ENTROPY_BITS
from .policy import (LOW_ENTROPY_BITS, RAW, SPARSE_LZ_MAX_DENSITY, STRUCTURED_TRIAL_BYTES, TRIAL_BYTES, TRIAL_MIN_GAIN,
                     Policy, codec_for)
from .streams import PLANE, SPARSE, Batch

@dataclass
class Coding:
    """What a batch's streams are coded with: per stream, the codec configuration it is tried with
    (``RAW``: stored as it is); and the streams a trial already coded whole, as one chunk: stream ->
    (index in the batch's buffers, offset, length) of that coding (:func:`trial`)."""

    configs: list[dict[str, Any]]
    precoded: dict[int, tuple[int, int, int]]


def choose_codecs(batch: Batch, entropies: np.ndarray, floating: np.ndarray, policy: Policy, backend: str
                  ) -> Coding:
    """The codec each stream of ``batch`` is tried with (``entropies``: each tensor's plane
    entropies), and the streams a trial already coded whole (:func:`trial`). ``SPARSE`` streams
    (a sparse residue's bitmap and its values' planes) are coded as structured planes are, but a
    bitmap so sparse that it is nearly all zero bytes as near-constant planes are
    (:data:`~.policy.SPARSE_LZ_MAX_DENSITY`)."""
    streams = batch.streams
    plane_codec = policy.plane_codec(backend).get_config()
    coding = Coding([], {})
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
            picks, whole = trial(np.array(tried), batch, options, sample, policy, backend)
            for s, config in zip(tried, picks):
                configs[s] = config
            coding.precoded.update(whole)
    return coding


def _density(batch: Batch, s: int) -> float:
    """The share of non-zero elements of the sparse residue whose bitmap is stream ``s``."""
    transform = batch.transforms[int(batch.streams.tensor[s])]
    assert isinstance(transform, Sparse)
    return transform.count / max(1, 8 * int(batch.streams.size[s]))


def trial(picked: np.ndarray, batch: Batch, candidates: list[dict[str, Any]], sample: int, policy: Policy,
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
