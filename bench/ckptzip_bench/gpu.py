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

import numpy as np
import torch

from ckptzip.engine import EncodedBatch, LoadPlan, Policy, Runs, decode_batch, encode_batch
from ckptzip.engine import plan_read_batches as read_batches
from ckptzip.engine import plan_write_batches as write_batches
from ckptzip.format import ContainerReader, TensorEntry
from ckptzip.tree import flatten
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


def encode_resident(state: Any, codec: str) -> list[EncodedBatch]:
    """Encode every tensor of ``state`` in the batches save() uses, leaving the chunks on the GPU."""
    policy = Policy.parse(codec)
    tensors = [item.tensor for item in flatten(state).tensors]
    return [encode_batch([tensors[i] for i in idx], policy, key.backend) for key, idx in write_batches(tensors, policy)]


def measure_resident(state: Any, checkpoint: Path, codec: str, reps: int = 3) -> CodecThroughput:
    """Time GPU-resident encode of ``state`` and GPU-resident decode of ``checkpoint`` (saved with
    the same codec): the decode reads stored bytes into device memory first, untimed."""
    encoded = encode_resident(state, codec)
    raw = sum(t.tensor.numel() * t.tensor.element_size() for t in flatten(state).tensors)
    stored = sum(b.stored.numel() for b in encoded)
    del encoded
    encode_s = cuda_seconds(lambda: encode_resident(state, codec), reps)
    regions = device_regions(ContainerReader(checkpoint.read_bytes()))
    decode_s = cuda_seconds(lambda: decode_resident(regions), reps)
    return CodecThroughput(f"ckptzip-{codec}", raw, stored, encode_s, decode_s, mismatch=None)


def device_regions(reader: ContainerReader) -> list[tuple[list[TensorEntry], torch.Tensor, Runs, str]]:
    """The stored bytes of every load batch, already in device memory: what a GPU-resident decode
    starts from."""
    everything = list(range(len(reader.tensors)))
    plan = LoadPlan(reader.tensors, reader.index.bases, everything, [torch.device("cuda")] * len(everything), None)
    stored = plan.entries  # copies and casts are rebuilt from these, not decoded
    regions = []
    for backend, work, idx in read_batches(stored, [torch.device("cuda")] * len(stored)):
        entries = [stored[i] for i in idx]
        runs = Runs.of(entries)
        if runs.total:
            host = np.concatenate([reader.ranges.view(f, n) for f, n in zip(runs.file.tolist(), runs.length.tolist())])
            regions.append((entries, torch.from_numpy(host).to(work), runs, backend))
    return regions


def decode_resident(regions: list[tuple[list[TensorEntry], torch.Tensor, Runs, str]]) -> list[Any]:
    """Decode every batch of :func:`device_regions` on the GPU, chunk checksums verified."""
    return [decode_batch(entries, region, runs, backend, digests=True) for entries, region, runs, backend in regions]


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
            f.write(data.data)
            f.flush()
            os.fsync(f.fileno())
        write_s = time.perf_counter() - start
        start = time.perf_counter()
        with open(path, "rb") as f:
            f.readinto(data.data)
        read_s = time.perf_counter() - start
    return {
        "d2d_copy_gbps": 2 * nbytes / d2d / 1e9,
        "pinned_d2h_gbps": nbytes / d2h / 1e9,
        "pinned_h2d_gbps": nbytes / h2d / 1e9,
        "disk_write_fsync_gbps": nbytes / write_s / 1e9,
        "disk_read_warm_gbps": nbytes / read_s / 1e9,
    }
