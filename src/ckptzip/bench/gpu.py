"""GPU-side measurements of ckptzip's own pipeline: GPU-resident compress and decompress
throughput of a whole state, and the hardware ceilings (device copy, pinned transfers, disk)."""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..encode import EncodedTensor, encode_gpu_batch, encode_tensor
from ..format import ContainerReader
from ..state_io import _decode_gpu_batch, _read_groups, _save_groups
from ..tree import flatten
from .baselines import CodecThroughput


def cuda_seconds(fn: Callable[[], Any], reps: int = 3, warmup: int = 1) -> float:
    """Median wall time of ``fn`` with the device synchronised before and after each run."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def encode_resident(state: Any, codec: str) -> list[EncodedTensor]:
    """Encode every tensor of ``state`` the way save() does, leaving the chunks on the GPU."""
    flat = flatten(state)
    out: list[EncodedTensor] = []
    for gpu, group in _save_groups(flat.tensors, codec):
        items = [(g.name, g.tensor) for g in group]
        out.extend(encode_gpu_batch(items, codec) if gpu else [encode_tensor(*items[0], codec)])
    return out


def measure_resident(state: Any, checkpoint: Path, codec: str, reps: int = 3) -> CodecThroughput:
    """Time GPU-resident encode of ``state`` and GPU-resident decode of ``checkpoint`` (saved with
    the same codec): the decode reads stored bytes into device memory first, untimed."""
    encoded = encode_resident(state, codec)
    raw = sum(e.tensor.numel() * e.tensor.element_size() for e in encoded)
    stored = sum(p.numel() for e in encoded for s in e.streams for p in s.pieces)
    del encoded
    encode_s = cuda_seconds(lambda: encode_resident(state, codec), reps)
    with open(checkpoint, "rb") as f:
        reader = ContainerReader(f)
        devices = [torch.device("cuda")] * len(reader.tensors)
        batches = []
        for kind, idx in _read_groups(reader.tensors, devices):
            entries = [reader.tensors[i] for i in idx]
            if kind != "cuda":
                continue
            host = torch.empty(sum(e.compressed_nbytes for e in entries), dtype=torch.uint8)
            first = entries[0].streams[0].chunks[0].offset
            chunks = [(e, j, k, c) for e in entries for j, s in enumerate(e.streams) for k, c in enumerate(s.chunks)]
            reader.read_into(host, first, chunks)
            batches.append((entries, host.cuda()))
    decode_s = cuda_seconds(lambda: [_decode_gpu_batch(e, r) for e, r in batches], reps)
    return CodecThroughput(f"ckptzip-{codec}", raw, stored, encode_s, decode_s, mismatch=None)


def ceilings(nbytes: int = 1 << 31, directory: str | None = None) -> dict[str, float]:
    """GB/s of a device-to-device copy (bytes read + written), pinned D2H and H2D, and a sequential
    file write with fsync and read-back in the given directory."""
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dev2 = torch.empty_like(dev)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    d2d = cuda_seconds(lambda: dev2.copy_(dev))
    d2h = cuda_seconds(lambda: host.copy_(dev, non_blocking=True))
    h2d = cuda_seconds(lambda: dev.copy_(host, non_blocking=True))
    data = host.numpy()
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        path = os.path.join(tmp, "ceiling.bin")
        start = time.perf_counter()
        with open(path, "wb") as f:
            f.write(memoryview(data))
            f.flush()
            os.fsync(f.fileno())
        write_s = time.perf_counter() - start
        start = time.perf_counter()
        with open(path, "rb") as f:
            f.readinto(memoryview(data))
        read_s = time.perf_counter() - start
    return {
        "d2d_copy_gbps": 2 * nbytes / d2d / 1e9,
        "pinned_d2h_gbps": nbytes / d2h / 1e9,
        "pinned_h2d_gbps": nbytes / h2d / 1e9,
        "disk_write_fsync_gbps": nbytes / write_s / 1e9,
        "disk_read_warm_gbps": nbytes / read_s / 1e9,
    }
