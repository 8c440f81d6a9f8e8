"""What a training state could compress to, per tensor class: the order-0 entropy bound of its
byte planes and the best ratio a plain codec reaches on those planes (the reference ckptzip's
presets are held to).

Both group tensors by :func:`ckptzip.report.tensor_class`, plus :data:`CORE` (the fp32
weights, ``exp_avg`` and ``exp_avg_sq`` together) and ``"total"``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from .measure import iter_tensors
from ckptzip.codecs import get_codec, has_codec
from ckptzip.engine import SMALL_TENSOR_BYTES, entropy_of_counts
from ckptzip.report import TENSOR_CLASSES, tensor_class
from ckptzip.transforms import BytePlanes

__all__ = [
    "CORE",
    "CPU_REFERENCE",
    "GPU_REFERENCE",
    "GROUPS",
    "ReferenceCodec",
    "TensorSize",
    "dtype_name",
    "entropy_by_group",
    "group_keys",
    "group_totals",
    "planes_reference",
]

CORE = "fp32 w+m+v"
_CORE_CLASSES = ("weights", "exp_avg", "exp_avg_sq")
GROUPS = (*TENSOR_CLASSES, CORE, "total")
REFERENCE_BYTES = 1 << 30  # tensor bytes per class the codec-on-planes reference codes at most


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"``."""
    return str(dtype).removeprefix("torch.")


def group_keys(cls: str, dtype: str) -> tuple[str, ...]:
    """The groups a tensor of class ``cls`` and dtype ``dtype`` counts in."""
    core = (CORE,) if dtype == "float32" and cls in _CORE_CLASSES else ()
    return (cls, *core, "total")


@dataclass(frozen=True)
class TensorSize:
    """One tensor as a method stored it: class, dtype name, raw and stored bytes."""

    cls: str
    dtype: str
    raw: int
    stored: int


def group_totals(sizes: Iterable[TensorSize]) -> dict[str, dict[str, Any]]:
    """``{group: {"raw_bytes", "stored_bytes", "ratio"}}`` in :data:`GROUPS` order, groups present only."""
    totals: dict[str, list[int]] = {}
    for s in sizes:
        for key in group_keys(s.cls, s.dtype):
            pair = totals.setdefault(key, [0, 0])
            pair[0] += s.raw
            pair[1] += s.stored
    return {
        key: {"raw_bytes": raw, "stored_bytes": stored, "ratio": raw / stored if stored else None}
        for key in GROUPS
        if key in totals
        for raw, stored in [totals[key]]
    }


def _classified(state: Any) -> Iterator[tuple[str, str, int, torch.Tensor]]:
    """``(class, dtype name, itemsize, 1-D uint8 bytes)`` of every non-empty tensor of ``state``."""
    for path, tensor in iter_tensors(state):
        if tensor.numel():
            data = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
            yield tensor_class(path, tensor), dtype_name(tensor.dtype), tensor.element_size(), data


# ------------------------------------------------------------------------------ entropy bound

_SAMPLE_ELEMENTS = 1 << 13


def plane_entropies(data: torch.Tensor, itemsize: int) -> list[float]:
    """Order-0 entropy in bits/byte of each byte plane, from an evenly strided sample of elements."""
    elements = data.numel() // itemsize
    sample = data.view(-1, itemsize)[:: max(1, elements // _SAMPLE_ELEMENTS)].t().long()
    offsets = torch.arange(itemsize, device=data.device)[:, None] * 256
    counts = torch.bincount((sample + offsets).reshape(-1), minlength=256 * itemsize)
    return entropy_of_counts(counts.view(itemsize, 256)).cpu().tolist()


def entropy_by_group(state: Any) -> dict[str, dict[str, Any]]:
    """Order-0 entropy of each tensor's byte planes (an evenly strided sample), summed per group.

    Per group: ``raw_bytes``; ``order0_bytes``, the size an order-0 coder fitted to each plane of
    each tensor would write; ``bound`` = raw / order0; ``planes``: per dtype, the bits per byte of
    each plane, high byte first, averaged over the group's tensors weighted by size.
    """
    raw: dict[str, int] = {}
    coded: dict[str, float] = {}
    plane_bits: dict[str, dict[str, list[float]]] = {}
    plane_weight: dict[str, dict[str, int]] = {}
    for cls, dtype, itemsize, data in _classified(state):
        bits = plane_entropies(data, itemsize)
        for key in group_keys(cls, dtype):
            raw[key] = raw.get(key, 0) + data.numel()
            coded[key] = coded.get(key, 0.0) + data.numel() / itemsize * sum(bits) / 8
            sums = plane_bits.setdefault(key, {}).setdefault(dtype, [0.0] * itemsize)
            for plane, b in enumerate(bits):
                sums[plane] += b * data.numel()
            weights = plane_weight.setdefault(key, {})
            weights[dtype] = weights.get(dtype, 0) + data.numel()
    out: dict[str, dict[str, Any]] = {}
    for key in GROUPS:
        if key not in raw:
            continue
        planes = {
            dtype: [round(s / plane_weight[key][dtype], 3) for s in reversed(sums)]
            for dtype, sums in plane_bits[key].items()
        }
        bound = raw[key] / coded[key] if coded[key] else None
        out[key] = {"raw_bytes": raw[key], "order0_bytes": round(coded[key]), "bound": bound, "planes": planes}
    return out


# ---------------------------------------------------------------------------- planes reference


@dataclass(frozen=True)
class ReferenceCodec:
    """One codec the reference runs on every byte plane, with the chunk size it uses."""

    label: str
    config: dict[str, Any]
    chunk_bytes: int


GPU_REFERENCE = (
    ReferenceCodec("ans", {"id": "ans", "data_type": "|u1"}, 1 << 20),
    ReferenceCodec("zstd", {"id": "zstd"}, 256 << 10),
    ReferenceCodec("gdeflate-0", {"id": "gdeflate", "algorithm_type": 0}, 64 << 10),
    ReferenceCodec("bitcomp", {"id": "bitcomp"}, 1 << 20),
)
CPU_REFERENCE = (
    ReferenceCodec("zstd-3", {"id": "zstd", "level": 3}, 1 << 20),
    ReferenceCodec("deflate-1", {"id": "deflate", "level": 1}, 1 << 20),
)


def _planes_stored(codec: Any, planes: list[torch.Tensor], chunk_bytes: int) -> int | None:
    """Bytes of ``planes`` (or a tensor's bytes as one stream) coded chunk by chunk, a plane kept raw
    where coding does not shrink it;
    ``None`` if a decoded chunk differs from its input."""
    chunks = [c for plane in planes for c in plane.split(chunk_bytes)]
    encoded = codec.encode(chunks)
    decoded = codec.decode(encoded, [c.numel() for c in chunks])
    if not torch.equal(torch.cat(chunks), torch.cat(decoded)):
        return None
    stored = 0
    start = 0
    for plane in planes:
        count = -(-plane.numel() // chunk_bytes)
        coded = sum(e.numel() for e in encoded[start : start + count])
        stored += min(coded, plane.numel())
        start += count
    return stored


def planes_reference(
    state: Any, backend: str, max_bytes: int = REFERENCE_BYTES
) -> dict[str, dict[str, Any]]:
    """Ratio of each reference codec on each tensor's byte planes, per group, and the best one.

    ``backend`` is ``"cuda"`` (nvCOMP: :data:`GPU_REFERENCE`) or ``"cpu"`` (:data:`CPU_REFERENCE`).
    Tensors below the planner's small-tensor size, and dtypes that do not split into planes, are
    coded whole, as the presets do. Per class at most ``max_bytes`` of tensors are coded, in state order; every
    coded chunk is decoded and compared, and a codec that fails that check gets ``None``.
    Returns ``{group: {"raw_bytes", "codecs": {label: ratio | None}, "best", "best_ratio"}}``.
    """
    codecs = GPU_REFERENCE if backend == "cuda" else CPU_REFERENCE
    device = torch.device("cuda" if backend == "cuda" else "cpu")
    usable = [r for r in codecs if has_codec(r.config["id"], backend)]
    instances = {r.label: get_codec(r.config, backend) for r in usable}
    raw: dict[str, int] = {}
    stored: dict[str, dict[str, int | None]] = {}
    for cls, dtype, itemsize, data in _classified(state):
        if raw.get(cls, 0) >= max_bytes:
            continue
        keys = group_keys(cls, dtype)
        data = data.to(device)
        split = data.numel() >= SMALL_TENSOR_BYTES and itemsize in (2, 4, 8)
        planes = BytePlanes(itemsize).forward(data) if split else [data]
        for ref in usable:
            size = _planes_stored(instances[ref.label], planes, ref.chunk_bytes)
            for key in keys:
                per_codec = stored.setdefault(key, {})
                previous = per_codec.get(ref.label, 0)
                per_codec[ref.label] = None if previous is None or size is None else previous + size
        for key in keys:
            raw[key] = raw.get(key, 0) + data.numel()
    out: dict[str, dict[str, Any]] = {}
    for key in GROUPS:
        if key not in raw:
            continue
        ratios = {label: None if s is None else raw[key] / s for label, s in stored.get(key, {}).items()}
        valid = {label: r for label, r in ratios.items() if r is not None}
        best = max(valid, key=valid.__getitem__, default=None)
        out[key] = {
            "raw_bytes": raw[key],
            "codecs": ratios,
            "best": best,
            "best_ratio": valid[best] if best is not None else None,
        }
    return out
