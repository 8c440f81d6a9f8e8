"""Choose, per tensor, the transforms and per-stream codecs (the ``codec=`` argument of save).

Presets:
- ``"auto"``: byte planes for multi-byte dtypes; planes whose sampled order-0 entropy shows
  structure get the best codec of the backend (GPU: nvCOMP ans; CPU: zstd); near-random planes
  (float mantissa bytes) are stored raw, since no codec shrinks them and coding them costs time.
- ``"fast"``: as auto, with the fastest codec of the backend.
- ``"portable"``: as auto, with zstd everywhere, so the file decodes on machines without a GPU.
A plain codec id (``"zstd"``, ``"ans"``, ...) applies that codec to every tensor's raw bytes.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass

import torch

from .codecs import GPU_ONLY_IDS, KNOWN_IDS, Codec, get_codec, has_codec
from .errors import CkptzipError
from .transforms import BytePlanes, Transform

PRESETS = ("auto", "fast", "portable")
SMALL_TENSOR_BYTES = 1 << 12
RANDOM_ENTROPY_BITS = 7.5
_SAMPLE_ELEMENTS = 1 << 13

# Stored chunk size by (codec id, backend): large enough for the entropy coders' tables and
# the GPU's parallelism, small enough that nvCOMP's zstd decoder stays fast.
_CHUNK_BYTES = {
    ("raw", "cpu"): 16 << 20,
    ("raw", "cuda"): 16 << 20,
    ("zstd", "cpu"): 1 << 20,
    ("zstd", "cuda"): 256 << 10,
    ("ans", "cuda"): 1 << 20,
    ("bitcomp", "cuda"): 1 << 20,
}
_DEFAULT_CHUNK_BYTES = 256 << 10
_PRESET_CODECS = {
    ("auto", "cuda"): {"id": "ans", "data_type": "|u1"},
    ("fast", "cuda"): {"id": "ans", "data_type": "|u1"},
    ("portable", "cuda"): {"id": "zstd", "level": 3},
    ("auto", "cpu"): {"id": "zstd", "level": 3},
    ("fast", "cpu"): {"id": "zstd", "level": 1},
    ("portable", "cpu"): {"id": "zstd", "level": 3},
}


@dataclass(frozen=True)
class StreamPlan:
    """How one stream is stored."""

    codec: Codec
    chunk_bytes: int


@dataclass(frozen=True)
class TensorPlan:
    """How one tensor is stored: optional transform, then one plan per stream."""

    transform: Transform | None
    streams: tuple[StreamPlan, ...]
    backend: str


def validate_codec_arg(codec: str) -> None:
    """Reject an unknown ``codec=`` argument early, with the choices."""
    if codec not in PRESETS and codec not in KNOWN_IDS:
        raise CkptzipError(
            f"codec={codec!r} is neither a preset {list(PRESETS)} nor a codec id {sorted(KNOWN_IDS)}"
        )


def backend_for(device: torch.device, nbytes: int, codec: str) -> str:
    """Where a tensor is compressed: on its GPU when nvCOMP can and it is not tiny, else on the
    CPU; a GPU-only codec asked for by id runs on the GPU wherever the tensor is."""
    if codec in GPU_ONLY_IDS:
        return "cuda"
    if device.type != "cuda" or nbytes < SMALL_TENSOR_BYTES:
        return "cpu"
    probe = codec if codec in KNOWN_IDS else _PRESET_CODECS[(codec, "cuda")]["id"]
    return "cuda" if has_codec(probe, "cuda") else "cpu"


def _stream(codec_config: dict, backend: str) -> StreamPlan:
    codec = _cached_codec(json.dumps(codec_config, sort_keys=True), backend)
    return StreamPlan(codec, _CHUNK_BYTES.get((codec.codec_id, backend), _DEFAULT_CHUNK_BYTES))


@functools.lru_cache(maxsize=64)
def _cached_codec(codec_config: str, backend: str) -> Codec:
    """Codec objects are immutable values: build each configuration once per process."""
    return get_codec(json.loads(codec_config), backend)


def entropy_of_counts(counts: torch.Tensor) -> torch.Tensor:
    """Order-0 entropy in bits/byte of each row of byte counts (``[..., 256]``), on the counts'
    device; 0 for empty rows."""
    counts = counts.to(torch.float32)
    p = counts / counts.sum(dim=-1, keepdim=True).clamp_min(1)
    return (-(p * torch.log2(p.clamp_min(1e-30))).sum(dim=-1)).clamp_min(0.0)


def plane_entropies(data: torch.Tensor, itemsize: int) -> list[float]:
    """Order-0 entropy in bits/byte of each byte plane, from an evenly strided sample of elements."""
    elements = data.numel() // itemsize
    sample = data.view(-1, itemsize)[:: max(1, elements // _SAMPLE_ELEMENTS)].t().long()
    offsets = torch.arange(itemsize, device=data.device)[:, None] * 256
    counts = torch.bincount((sample + offsets).reshape(-1), minlength=256 * itemsize)
    return entropy_of_counts(counts.view(itemsize, 256)).cpu().tolist()


def plan_tensor(
    data: torch.Tensor, dtype: torch.dtype, codec: str, backend: str, entropies: list[float] | None = None
) -> TensorPlan:
    """Plan how to store ``data`` (the 1-D uint8 bytes of a tensor of ``dtype``) on ``backend``.

    ``entropies`` of the byte planes may be given (the GPU batch path counts them while it splits);
    otherwise they are sampled here.
    """
    if codec in KNOWN_IDS:
        return TensorPlan(None, (_stream({"id": codec}, backend),), backend)
    best = _PRESET_CODECS[(codec, backend)]
    if not splits_into_planes(dtype, data.numel()):
        return TensorPlan(None, (_stream(best if data.numel() else {"id": "raw"}, backend),), backend)
    itemsize = dtype.itemsize
    if dtype.is_floating_point or dtype.is_complex:
        if entropies is None:
            entropies = plane_entropies(data, itemsize)
        coded = [e < RANDOM_ENTROPY_BITS for e in entropies]
    else:
        coded = [True] * itemsize
    streams = tuple(_stream(best if c else {"id": "raw"}, backend) for c in coded)
    return TensorPlan(BytePlanes(itemsize), streams, backend)


def splits_into_planes(dtype: torch.dtype, nbytes: int) -> bool:
    """Whether presets split tensors of this dtype and size into byte planes."""
    return nbytes >= SMALL_TENSOR_BYTES and dtype.itemsize in (2, 4, 8)
