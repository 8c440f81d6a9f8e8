"""Tensors a checkpoint already holds in another form: duplicates (the same bytes twice) and
bf16/fp16 tensors that are the round-to-nearest cast of an fp32 tensor of the same shape (the
model copy of a mixed-precision trainer's fp32 master weights). docs/FORMAT.md, "Version 2.1".

Pairs are found without name conventions: candidates share a size (duplicates) or a shape (casts)
and a device, and are grouped by hashing a sample of their elements, then a digest of the whole
tensor, so the search is O(n log n) in tensors and O(bytes) in data; a pair is stored as one only
once its whole tensors compared equal, on their device.
The cast is defined bit for bit by integer arithmetic, so every device rebuilds the same bits.
"""

from __future__ import annotations

import collections
from typing import Any

import numpy as np
import torch

from ..checksum import wsum64_tensor
from ..kernels.segments import gather_bytes, tensor_sums
from ..memory.tables import to_device

SAMPLES = 64  # elements compared before a whole tensor is
_BLOCK = 1 << 24  # elements cast at a time (bounds the int32 temporaries)
CAST_DTYPES = (torch.bfloat16, torch.float16)


def _cast_bits(u: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The int16 bits of the cast of fp32 values whose bits are the int32 tensor ``u``."""
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    if dtype == torch.bfloat16:
        rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16  # arithmetic shift: fits int16 with its sign
        return torch.where(nan, (u >> 16) | 0x40, rounded).to(torch.int16)
    sign = (u >> 31) & 1
    e = ((u >> 23) & 0xFF) - 127 + 15  # the float16 exponent before rounding
    m = u & 0x7FFFFF
    # normal results: drop 13 mantissa bits, ties to even; a carry steps into the exponent
    normal = (e.clamp(0, 31) << 10) | (m >> 13)
    rest = m & 0x1FFF
    normal = normal + ((rest > 0x1000) | ((rest == 0x1000) & ((normal & 1) == 1))).to(torch.int32)
    # subnormal results: shift the full significand (hidden bit set) right by 14 - e
    shift = (14 - e).clamp(14, 25)
    significand = m | 0x800000
    sub = significand >> shift
    half = 1 << (shift - 1)
    rem = significand & ((1 << shift) - 1)
    sub = sub + ((rem > half) | ((rem == half) & ((sub & 1) == 1))).to(torch.int32)
    magnitude = torch.where(e >= 1, normal.clamp(max=0x7C00), torch.where(e < -10, 0, sub))
    magnitude = torch.where(nan, 0x7E00 | (m >> 13), magnitude)
    return (magnitude - (sign << 15)).to(torch.int16)  # sign set: the int16 of 0x8000 | magnitude


def cast(src: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``src`` (float32) cast to bfloat16 or float16 exactly as FORMAT.md defines it, on its device."""
    bits = src.detach().reshape(-1).view(torch.int32)
    out = torch.empty(bits.numel(), dtype=torch.int16, device=src.device)
    for start in range(0, bits.numel(), _BLOCK):
        out[start : start + _BLOCK] = _cast_bits(bits[start : start + _BLOCK], dtype)
    return out.view(dtype).reshape(src.shape)


def _eligible(t: torch.Tensor) -> bool:
    return t.numel() > 0 and t.is_contiguous() and not t.is_conj() and not t.is_neg()


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8)


def _sample_positions(sizes: np.ndarray) -> np.ndarray:
    """For each size n, SAMPLES positions spread evenly over ``range(n)``, first and last included
    (where n < SAMPLES, the last repeats). Integer arithmetic: a float32 linspace rounds the last
    position past ``n - 1`` on CUDA."""
    k = np.minimum(sizes, SAMPLES)[:, None]
    positions: np.ndarray = np.minimum(np.arange(SAMPLES), k - 1) * (sizes[:, None] - 1) // np.maximum(k - 1, 1)
    return positions


def _sample_at(n: int, device: torch.device) -> torch.Tensor:
    """The ``min(n, SAMPLES)`` distinct positions of :func:`_sample_positions` for one size, on ``device``."""
    return to_device(_sample_positions(np.array([n], dtype=np.int64))[0, : min(n, SAMPLES)], device)


def _groups(keys: list[Any]) -> list[list[int]]:
    """Positions of ``keys`` by equal key (hashed: linear), only the keys that occur more than once,
    each group ascending."""
    by_key: dict[Any, list[int]] = collections.defaultdict(list)
    for position, key in enumerate(keys):
        by_key[key].append(position)
    return [group for group in by_key.values() if len(group) > 1]


def _digests(flats: list[torch.Tensor]) -> list[int]:
    """Whole-tensor wsum64 of 1-D uint8 tensors of one device: one pass, one sync."""
    digests: list[int] = tensor_sums(flats).cpu().tolist()
    return digests


def find_duplicates(tensors: list[torch.Tensor]) -> dict[int, int]:
    """Position -> earlier position holding the same bytes, for every later duplicate.

    Candidates share a device and a size. They are grouped by hashing, never compared in pairs:
    by a sample of each (one gather per device), then those whose samples agree by a digest of
    the whole tensor (one pass, one sync), so the search is linear in tensors and in bytes. Each
    member of a group is compared byte for byte with the group's first: a digest collision costs
    a missed duplicate, never a wrong one."""
    by_device: dict[torch.device, list[int]] = collections.defaultdict(list)
    for i, t in enumerate(tensors):
        if _eligible(t):
            by_device[t.device].append(i)
    out: dict[int, int] = {}
    for positions in by_device.values():
        sized = [positions[m] for group in _groups([tensors[i].nbytes for i in positions]) for m in group]
        if not sized:
            continue
        flats = [_flat_bytes(tensors[i]) for i in sized]
        sizes = np.array([f.numel() for f in flats], dtype=np.int64)
        rows = np.repeat(np.arange(len(flats)), SAMPLES)
        samples = gather_bytes(flats, rows, _sample_positions(sizes).reshape(-1)).cpu().numpy()
        keys = [(size, row.tobytes()) for size, row in zip(sizes.tolist(), samples.reshape(len(flats), SAMPLES))]
        alike = [m for group in _groups(keys) for m in group]
        if not alike:
            continue
        digests = _digests([flats[m] for m in alike])
        for group in _groups([(keys[m], d) for m, d in zip(alike, digests)]):
            first = alike[group[0]]
            for k in group[1:]:
                if torch.equal(flats[first], flats[alike[k]]):
                    out[sized[alike[k]]] = sized[first]
    return out


def find_casts(tensors: list[torch.Tensor], skip: set[int]) -> dict[int, int]:
    """Position of a bf16/fp16 tensor -> position of the fp32 tensor it is the exact cast of
    (positions in ``skip`` are neither).

    Per shape, device and target dtype, sources and targets are grouped by hashing a sample (the
    cast of the source's sample, the target's): linear in tensors. A target is compared whole with
    the cast of the one source of its group; where several sources share a sample, by the digests
    of their whole casts first (each source cast once), so the data is read a bounded number of
    times. A digest collision costs a missed cast, never a wrong one."""
    groups: dict[tuple[torch.device, tuple[int, ...]], tuple[list[int], list[int]]] = collections.defaultdict(
        lambda: ([], []))
    for i, t in enumerate(tensors):
        if i in skip or not _eligible(t):
            continue
        if t.dtype == torch.float32:
            groups[t.device, tuple(t.shape)][0].append(i)
        elif t.dtype in CAST_DTYPES:
            groups[t.device, tuple(t.shape)][1].append(i)
    out: dict[int, int] = {}
    for (device, _), (sources, targets) in groups.items():
        if not sources or not targets:
            continue
        at = _sample_at(tensors[sources[0]].numel(), device)
        source_samples = torch.stack([tensors[j].detach().reshape(-1)[at] for j in sources])
        for dtype in CAST_DTYPES:
            members = [i for i in targets if tensors[i].dtype == dtype]
            if not members:
                continue
            got = cast(source_samples, dtype).view(torch.int16).cpu().numpy()
            want = torch.stack([tensors[i].detach().reshape(-1)[at].view(torch.int16) for i in members]).cpu().numpy()
            by_sample: dict[bytes, tuple[list[int], list[int]]] = collections.defaultdict(lambda: ([], []))
            for j, row in zip(sources, got):
                by_sample[row.tobytes()][0].append(j)
            for i, row in zip(members, want):
                if row.tobytes() in by_sample:
                    by_sample[row.tobytes()][1].append(i)
            for alike, wanted in by_sample.values():
                if wanted:
                    out.update(_match_casts(tensors, alike, wanted, dtype))
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.int16)


def _match_casts(tensors: list[torch.Tensor], sources: list[int], targets: list[int], dtype: torch.dtype
                 ) -> dict[int, int]:
    """Target -> source among tensors whose samples agree: compared whole with the one source's
    cast, or with that of the source whose cast has the target's digest."""
    if len(sources) == 1:
        bits = _bits(cast(tensors[sources[0]], dtype))
        return {i: sources[0] for i in targets if torch.equal(bits, _bits(tensors[i]))}
    source_digests = [int(wsum64_tensor(_bits(cast(tensors[j], dtype)).view(torch.uint8))) for j in sources]
    by_digest: dict[int, int] = {}
    for j, digest in zip(sources, source_digests):
        by_digest.setdefault(digest, j)
    out = {}
    for i, digest in zip(targets, _digests([_flat_bytes(tensors[i]) for i in targets])):
        match = by_digest.get(digest)
        if match is not None and torch.equal(_bits(cast(tensors[match], dtype)), _bits(tensors[i])):
            out[i] = match
    return out
