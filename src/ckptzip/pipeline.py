"""Tensor ⇄ stored chunks: transform → chunk → codec → checksum, and the same in reverse."""

from __future__ import annotations

import torch

from .checksum import format_wsum64, wsum64
from .codecs import GPU_ONLY_IDS, get_codec, has_codec
from .errors import CkptzipError, CorruptCheckpointError
from .format import DTYPE_NAMES, DTYPES, ContainerReader, ContainerWriter, StreamEntry, TensorEntry
from .planner import backend_for, plan_tensor
from .transforms import get_transform


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


def _to_host(chunks: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copy device chunks to the host with one transfer."""
    if not chunks or not chunks[0].is_cuda:
        return chunks
    host = torch.cat(chunks).cpu()
    return list(host.split([c.numel() for c in chunks]))


def _to_device(chunks: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    if not chunks or device.type == "cpu":
        return chunks
    dev = torch.cat(chunks).to(device, non_blocking=False)
    return list(dev.split([c.numel() for c in chunks]))


def write_tensor(writer: ContainerWriter, name: str, tensor: torch.Tensor, codec: str) -> TensorEntry:
    """Compress one tensor into the container and return its table entry."""
    data = tensor_bytes(tensor)
    checksum = format_wsum64(wsum64(data))
    backend = backend_for(data.device, data.numel(), codec)
    if backend == "cpu" and data.is_cuda:
        data = data.cpu()
    plan = plan_tensor(data, tensor.dtype, codec, backend)
    streams = plan.transform.forward(data) if plan.transform else [data]
    entries = []
    for stream, stream_plan in zip(streams, plan.streams):
        raw = split_chunks(stream, stream_plan.chunk_bytes)
        codec_config = stream_plan.codec.get_config()
        encoded = _to_host(stream_plan.codec.encode(raw)) if raw else []
        if sum(e.numel() for e in encoded) >= stream.numel():  # never store a stream expanded
            encoded, codec_config = _to_host(raw), {"id": "raw"}
        chunks = [writer.write_chunk(e, r.numel()) for e, r in zip(encoded, raw)]
        entries.append(StreamEntry(codec_config, stream.numel(), chunks))
    entry = TensorEntry(
        name=name,
        dtype=DTYPE_NAMES[tensor.dtype],
        shape=tuple(tensor.shape),
        nbytes=data.numel(),
        checksum=checksum,
        transforms=[plan.transform.get_config()] if plan.transform else [],
        streams=entries,
        device=str(tensor.device),
    )
    writer.add_tensor(entry)
    return entry


def decode_backend(entry: TensorEntry, device: torch.device) -> str:
    """Decode on the GPU when the target is a GPU or a codec is GPU-only and a GPU can run it."""
    ids = set(entry.codecs)
    if all(has_codec(i, "cuda") for i in ids) and (device.type == "cuda" or ids & GPU_ONLY_IDS):
        return "cuda"
    return "cpu"


def read_tensor(reader: ContainerReader, entry: TensorEntry, device: torch.device) -> torch.Tensor:
    """Read, verify and decode one tensor onto ``device``."""
    backend = decode_backend(entry, device)
    work_device = (device if device.type == "cuda" else torch.device("cuda")) if backend == "cuda" else torch.device("cpu")
    streams = []
    for j, stream in enumerate(entry.streams):
        try:
            codec = get_codec(stream.codec, backend)
        except CkptzipError as exc:  # unknown id, unavailable here, or invalid options
            raise type(exc)(f"tensor {entry.name!r} stream {j}: {exc}") from exc
        stored = _to_device(reader.read_stream(entry, j), work_device)
        try:
            decoded = codec.decode(stored, [c.raw_length for c in stream.chunks]) if stored else []
        except CorruptCheckpointError as exc:
            raise CorruptCheckpointError(f"tensor {entry.name!r} stream {j}: {exc}") from exc
        streams.append(torch.cat(decoded) if decoded else torch.empty(0, dtype=torch.uint8, device=work_device))
    data = streams[0]
    for config in reversed(entry.transforms):
        data = get_transform(config).inverse(streams, entry.nbytes)
    found = format_wsum64(wsum64(data))
    if found != entry.checksum:
        raise CorruptCheckpointError(
            f"tensor {entry.name!r}: decoded bytes have checksum {found}, expected {entry.checksum}; "
            "the file is damaged or a codec misbehaved"
        )
    dtype = DTYPES[entry.dtype]
    tensor = data.view(dtype) if entry.nbytes else torch.empty(0, dtype=dtype, device=data.device)
    return tensor.reshape(entry.shape).to(device)
