"""Tensors → coded chunks, before they are written: one tensor at a time, or a batch on the GPU.

An :class:`EncodedTensor` holds a tensor's stored chunks (on the device that made them, or on the
host) and what its index entry needs; :mod:`ckptzip.staging` moves device chunks to pinned host
memory and writes them in file order.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch

from .checksum import wsum64_tensor
from .codecs import Codec
from .format import DTYPE_NAMES, StreamEntry, TensorEntry
from .kernels.planes import split_planes
from .planner import backend_for, entropies_from_counts, plan_tensor, splits_into_planes

_MASK64 = (1 << 64) - 1


@dataclass
class EncodedStream:
    """The stored chunks of one stream and their decoded sizes."""

    codec: dict
    nbytes: int
    pieces: list[torch.Tensor]
    raw_lengths: list[int]
    entry: StreamEntry = field(init=False)

    def __post_init__(self) -> None:
        self.entry = StreamEntry(self.codec, self.nbytes, [])


@dataclass
class EncodedTensor:
    """A tensor ready to be written: metadata, streams, and its wsum64."""

    name: str
    tensor: torch.Tensor
    transforms: list[dict]
    streams: list[EncodedStream]
    checksum: torch.Tensor  # 0-d int64, on any device

    def table_entry(self) -> TensorEntry:
        """The index entry, once every chunk of every stream has been written."""
        t = self.tensor
        return TensorEntry(
            name=self.name,
            dtype=DTYPE_NAMES[t.dtype],
            shape=tuple(t.shape),
            nbytes=t.numel() * t.element_size(),
            checksum=f"wsum64:{int(self.checksum) & _MASK64:016x}",
            transforms=self.transforms,
            streams=[s.entry for s in self.streams],
            device=str(t.device),
        )


def tensor_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's elements in C order as a 1-D uint8 tensor on the same device (no copy if contiguous)."""
    t = tensor.detach().resolve_conj().resolve_neg()  # lazy conj/neg views have no byte view
    if not t.is_contiguous():
        t = t.contiguous()
    flat = t.reshape(-1)
    return flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8, device=t.device)


def split_chunks(stream: torch.Tensor, chunk_bytes: int) -> list[torch.Tensor]:
    """Views of consecutive pieces of at most ``chunk_bytes``."""
    return list(stream.split(chunk_bytes)) if stream.numel() else []


def _stream_or_raw(codec: Codec, chunks: list[torch.Tensor], encoded: list[torch.Tensor], nbytes: int) -> EncodedStream:
    """The coded stream, or the raw bytes when coding did not make it smaller."""
    raw_lengths = [c.numel() for c in chunks]
    if sum(e.numel() for e in encoded) >= nbytes:
        return EncodedStream({"id": "raw"}, nbytes, list(chunks), raw_lengths)
    return EncodedStream(codec.get_config(), nbytes, encoded, raw_lengths)


def encode_tensor(name: str, tensor: torch.Tensor, codec: str) -> EncodedTensor:
    """Encode one tensor on the backend that suits it (its GPU with nvCOMP, else the CPU)."""
    data = tensor_bytes(tensor)
    backend = backend_for(data.device, data.numel(), codec)
    if backend == "cpu" and data.is_cuda:
        data = data.cpu()
    checksum = wsum64_tensor(data)
    plan = plan_tensor(data, tensor.dtype, codec, backend)
    streams_data = plan.transform.forward(data) if plan.transform else [data]
    streams = []
    for stream, stream_plan in zip(streams_data, plan.streams):
        chunks = split_chunks(stream, stream_plan.chunk_bytes)
        encoded = stream_plan.codec.encode(chunks) if chunks else []
        streams.append(_stream_or_raw(stream_plan.codec, chunks, encoded, stream.numel()))
    transforms = [plan.transform.get_config()] if plan.transform else []
    return EncodedTensor(name, tensor, transforms, streams, checksum)


def gpu_batchable(tensor: torch.Tensor, codec: str) -> bool:
    """Whether a tensor goes through :func:`encode_gpu_batch` (a CUDA tensor nvCOMP will code)."""
    nbytes = tensor.numel() * tensor.element_size()
    return tensor.is_cuda and backend_for(tensor.device, nbytes, codec) == "cuda"


def encode_gpu_batch(items: list[tuple[str, torch.Tensor]], codec: str) -> list[EncodedTensor]:
    """Encode CUDA tensors of one device together: split planes (fused with checksums and byte
    counts), one host sync to read checksums and counts, then one nvCOMP call per codec for the
    chunks of all tensors, and one more sync for the compressed sizes."""
    device = items[0][1].device
    datas = [tensor_bytes(t) for _, t in items]
    hist = torch.zeros(len(items), 8 * 256, dtype=torch.int32, device=device)
    split: list[list[torch.Tensor]] = []
    checksums = []
    for i, ((_, tensor), data) in enumerate(zip(items, datas)):
        if codec not in ("auto", "fast", "portable") or not splits_into_planes(tensor.dtype, data.numel()):
            split.append([data])
            checksums.append(wsum64_tensor(data))
            continue
        planes, checksum = split_planes(data, tensor.dtype.itemsize, hist[i])
        split.append(planes)
        checksums.append(checksum)
    host = torch.cat([torch.stack(checksums), hist.view(-1).long()]).cpu()  # sync 1
    host_checksums, counts = host[: len(items)], host[len(items) :].view(len(items), 8, 256)

    jobs: dict[tuple, list[tuple[int, int, list[torch.Tensor]]]] = defaultdict(list)
    codecs: dict[tuple, Codec] = {}
    plans = []
    all_entropies = entropies_from_counts(counts)
    for i, ((_, tensor), data) in enumerate(zip(items, datas)):
        k = len(split[i])
        entropies = all_entropies[i][:k] if k > 1 else None
        plan = plan_tensor(data, tensor.dtype, codec, "cuda", entropies)
        plans.append(plan)
        for j, (stream, stream_plan) in enumerate(zip(split[i], plan.streams)):
            if stream_plan.codec.codec_id == "raw" or stream.numel() == 0:
                continue
            key = (repr(stream_plan.codec), stream_plan.chunk_bytes)
            codecs[key] = stream_plan.codec
            jobs[key].append((i, j, split_chunks(stream, stream_plan.chunk_bytes)))

    coded: dict[tuple[int, int], list[torch.Tensor]] = {}
    for key, work in jobs.items():
        flat = [c for _, _, chunks in work for c in chunks]
        encoded = codecs[key].encode(flat)  # sync 2 (sizes), once per codec
        start = 0
        for i, j, chunks in work:
            coded[(i, j)] = encoded[start : start + len(chunks)]
            start += len(chunks)

    out = []
    for i, (name, tensor) in enumerate(items):
        plan = plans[i]
        streams = []
        for j, (stream, stream_plan) in enumerate(zip(split[i], plan.streams)):
            chunks = split_chunks(stream, stream_plan.chunk_bytes)
            if (i, j) in coded:
                streams.append(_stream_or_raw(stream_plan.codec, chunks, coded[(i, j)], stream.numel()))
            else:
                streams.append(EncodedStream({"id": "raw"}, stream.numel(), chunks, [c.numel() for c in chunks]))
        transforms = [plan.transform.get_config()] if plan.transform else []
        out.append(EncodedTensor(name, tensor, transforms, streams, host_checksums[i]))
    return out
