"""Tensors a checkpoint already holds in another form: duplicates (the same bytes twice) and
bf16/fp16 tensors that are the round-to-nearest cast of an fp32 tensor of the same shape (the
model copy of a mixed-precision trainer's fp32 master weights). docs/FORMAT.md, "Version 2.1".

Pairs are found without name conventions: candidates share a size (duplicates) or a shape (casts)
and a device; a sample of elements must match before the whole tensor is compared, on its device.
The cast is defined bit for bit by integer arithmetic, so every device rebuilds the same bits.
"""

from __future__ import annotations

import collections

import numpy as np
import torch

from ..kernels import to_device
from ..kernels.segments import gather_bytes, segment_sums

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


def find_duplicates(tensors: list[torch.Tensor]) -> dict[int, int]:
    """Position -> earlier position holding the same bytes, for every later duplicate.

    Tensors of equal size on one device are candidates; a sample of each (all of a device's
    candidates in one gather, one sync) splits them into groups, and whole-tensor digests of the
    groups' members (one pass, one sync) pick the pairs compared byte for byte."""
    groups: dict[tuple[torch.device, int], list[int]] = collections.defaultdict(list)
    for i, t in enumerate(tensors):
        if _eligible(t):
            groups[t.device, t.numel() * t.element_size()].append(i)
    by_device: dict[torch.device, list[int]] = collections.defaultdict(list)
    for (device, _), members in groups.items():
        if len(members) > 1:
            by_device[device].extend(members)
    out: dict[int, int] = {}
    for members in by_device.values():
        flats = [_flat_bytes(tensors[i]) for i in members]
        sizes = np.array([f.numel() for f in flats], dtype=np.int64)
        rows = np.repeat(np.arange(len(members)), SAMPLES)
        samples = gather_bytes(flats, rows, _sample_positions(sizes).reshape(-1)).cpu().numpy()
        samples = samples.reshape(len(members), SAMPLES)
        by_sample: dict[tuple[int, bytes], list[int]] = collections.defaultdict(list)
        for m, (size, row) in enumerate(zip(sizes.tolist(), samples)):
            by_sample[size, row.tobytes()].append(m)
        alike = [same for same in by_sample.values() if len(same) > 1]
        out.update(_same_bytes([flats[m] for same in alike for m in same],
                               [[members[m] for m in same] for same in alike]))
    return out


def _same_bytes(flats: list[torch.Tensor], groups: list[list[int]]) -> dict[int, int]:
    """Among the tensors of each group (``flats`` holds the groups' members in order, their
    positions are in ``groups``; a group's tensors have one size): later duplicate -> earlier
    original. Digests of all of them first (one pass, one sync), so only tensors with equal
    digests are compared byte for byte: linear, even for many tensors whose samples agree."""
    if not flats:
        return {}
    count = len(flats)
    sizes = np.array([f.numel() for f in flats], dtype=np.int64)
    digests = segment_sums(flats, np.arange(count), np.zeros(count, np.int64), sizes).cpu().tolist()
    out: dict[int, int] = {}
    at = 0
    for positions in groups:
        originals: dict[int, list[int]] = collections.defaultdict(list)  # digest -> indices into flats
        for k in range(at, at + len(positions)):
            match = next((j for j in originals[digests[k]] if torch.equal(flats[j], flats[k])), None)
            if match is None:
                originals[digests[k]].append(k)
            else:
                out[positions[k - at]] = positions[match - at]
        at += len(positions)
    return out


def find_casts(tensors: list[torch.Tensor], skip: set[int]) -> dict[int, int]:
    """Position of a bf16/fp16 tensor -> position of the fp32 tensor it is the exact cast of
    (positions in ``skip`` are neither). Per shape and device: one batched sample comparison of
    every candidate pair, then a full comparison of the pairs whose samples matched."""
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
    for (device, shape), (sources, targets) in groups.items():
        if not sources or not targets:
            continue
        at = _sample_at(tensors[sources[0]].numel(), device)
        source_samples = torch.stack([tensors[j].detach().reshape(-1)[at] for j in sources])
        for dtype in CAST_DTYPES:
            members = [i for i in targets if tensors[i].dtype == dtype]
            if not members:
                continue
            want = torch.stack([tensors[i].detach().reshape(-1)[at].view(torch.int16) for i in members])
            got = cast(source_samples, dtype).view(torch.int16)
            matches = (want[:, None, :] == got[None, :, :]).all(dim=2).cpu().tolist()  # one sync per group
            for i, row in zip(members, matches):
                for j, ok in zip(sources, row):
                    if ok and torch.equal(cast(tensors[j], dtype).view(torch.int16), tensors[i].detach().view(torch.int16)):
                        out[i] = j
                        break
    return out
