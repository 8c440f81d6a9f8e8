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
from .codecs import GPU_ONLY_IDS, KNOWN_IDS, Codec
from .format import DTYPE_NAMES, StreamEntry, TensorEntry
from .kernels.planes import fused_available, split_many, split_planes
from .planner import SMALL_TENSOR_BYTES, backend_for, entropy_of_counts, plan_tensor, splits_into_planes

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
    checksum: torch.Tensor | int  # int64 value (0-d tensor on any device, or int)

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


def encode_tensor(name: str, tensor: torch.Tensor, codec: str, *, data: torch.Tensor | None = None) -> EncodedTensor:
    """Encode one tensor on the backend that suits it (its GPU with nvCOMP, else the CPU).
    ``data``, the tensor's bytes already on the host, spares a device-to-host copy."""
    if data is None:
        data = tensor_bytes(tensor)
    backend = backend_for(data.device, data.numel(), codec)
    if backend == "cpu" and data.is_cuda:
        data = data.cpu()
    elif backend == "cuda" and not data.is_cuda:
        data = data.to("cuda")
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
    """Whether a tensor goes through :func:`encode_gpu_batch`: a CUDA tensor, when nvCOMP can run
    the codec (tiny tensors ride along and are coded on the host)."""
    return tensor.is_cuda and backend_for(tensor.device, SMALL_TENSOR_BYTES, codec) == "cuda"


def encode_gpu_batch(items: list[tuple[str, torch.Tensor]], codec: str, backend: str = "cuda") -> list[EncodedTensor]:
    """Encode CUDA tensors of one device together: tensors of one item size are packed and split
    into byte planes by one fused kernel (which also yields checksums and byte counts); one host
    sync reads checksums, counts and the tiny tensors; one nvCOMP call per codec codes the planes
    that carry structure; one more sync reads the compressed sizes.

    ``backend`` "cpu" runs the same batching with CPU codecs (used by tests on machines without a GPU).
    """
    device = items[0][1].device
    datas = [tensor_bytes(t) for _, t in items]
    preset = codec not in KNOWN_IDS
    tiny = [i for i, d in enumerate(datas) if d.numel() < SMALL_TENSOR_BYTES and codec not in GPU_ONLY_IDS]
    groups: dict[int, list[int]] = defaultdict(list)
    alone = []
    for i, ((_, t), d) in enumerate(zip(items, datas)):
        if i in tiny:
            continue
        k = t.dtype.itemsize
        if preset and splits_into_planes(t.dtype, d.numel()) and fused_available(d.device, d.numel(), k):
            groups[k].append(i)
        else:
            alone.append(i)
    hist = torch.zeros(len(items), 8 * 256, dtype=torch.int32, device=device)
    checksums = torch.zeros(len(items), dtype=torch.int64, device=device)
    streams_of: dict[int, list[torch.Tensor]] = {}
    for k, idx in groups.items():
        buffer, starts, strides, sums = split_many([datas[i] for i in idx], k, hist, idx)
        checksums[idx] = sums
        for i, start, stride in zip(idx, starts, strides):
            n = datas[i].numel() // k
            streams_of[i] = [buffer[start + j * stride : start + j * stride + n] for j in range(k)]
    for i in alone:
        k = items[i][1].dtype.itemsize
        if preset and splits_into_planes(items[i][1].dtype, datas[i].numel()):
            planes, checksum = split_planes(datas[i], k, hist[i])
            streams_of[i] = planes
            checksums[i] = checksum
        else:
            streams_of[i] = [datas[i]]
            checksums[i] = wsum64_tensor(datas[i])
    tiny_bytes = torch.cat([datas[i] for i in tiny]) if tiny else checksums.new_empty(0).view(torch.uint8)
    entropies = entropy_of_counts(hist.view(len(items), 8, 256))
    host_checksums = checksums.cpu().tolist()  # sync 1: checksums, entropies and tiny tensors
    all_entropies = entropies.cpu().tolist()
    host_tiny = tiny_bytes.cpu()

    out: list[EncodedTensor | None] = [None] * len(items)
    offset = 0
    for i in tiny:
        n = datas[i].numel()
        out[i] = encode_tensor(items[i][0], items[i][1], codec, data=host_tiny[offset : offset + n])
        offset += n

    jobs: dict[str, list[tuple[int, int]]] = defaultdict(list)
    codecs: dict[str, Codec] = {}
    plans = {}
    chunks_of: dict[tuple[int, int], list[torch.Tensor]] = {}
    for i, streams in streams_of.items():
        entropies = all_entropies[i][: len(streams)] if len(streams) > 1 else None
        plan = plans[i] = plan_tensor(datas[i], items[i][1].dtype, codec, backend, entropies)
        for j, (stream, stream_plan) in enumerate(zip(streams, plan.streams)):
            chunks_of[(i, j)] = split_chunks(stream, stream_plan.chunk_bytes)
            if stream_plan.codec.codec_id != "raw" and stream.numel():
                key = repr(stream_plan.codec)
                codecs[key] = stream_plan.codec
                jobs[key].append((i, j))
    coded: dict[tuple[int, int], list[torch.Tensor]] = {}
    for key, work in jobs.items():
        encoded = codecs[key].encode([c for ij in work for c in chunks_of[ij]])  # sync 2, once per codec
        start = 0
        for ij in work:
            coded[ij] = encoded[start : start + len(chunks_of[ij])]
            start += len(chunks_of[ij])
    for i, plan in plans.items():
        streams = []
        for j, (stream, stream_plan) in enumerate(zip(streams_of[i], plan.streams)):
            chunks = chunks_of[(i, j)]
            if (i, j) in coded:
                streams.append(_stream_or_raw(stream_plan.codec, chunks, coded[(i, j)], stream.numel()))
            else:
                streams.append(EncodedStream({"id": "raw"}, stream.numel(), chunks, [c.numel() for c in chunks]))
        transforms = [plan.transform.get_config()] if plan.transform else []
        out[i] = EncodedTensor(items[i][0], items[i][1], transforms, streams, host_checksums[i])
    return out  # type: ignore[return-value]
