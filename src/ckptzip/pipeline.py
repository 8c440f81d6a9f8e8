"""Tensor ⇄ stored chunks: transform → chunk → codec → checksum, and the same in reverse."""

from __future__ import annotations

import torch

from .checksum import format_wsum64, wsum64
from .codecs import GPU_ONLY_IDS, get_codec, has_codec
from .errors import CkptzipError, CorruptCheckpointError
from .format import DTYPES, ContainerReader, ContainerWriter, TensorEntry
from .encode import encode_tensor
from .transforms import get_transform


def _to_device(chunks: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    if not chunks or device.type == "cpu":
        return chunks
    dev = torch.cat(chunks).to(device, non_blocking=False)
    return list(dev.split([c.numel() for c in chunks]))


def write_tensor(writer: ContainerWriter, name: str, tensor: torch.Tensor, codec: str) -> TensorEntry:
    """Compress one tensor into the container and return its table entry."""
    encoded = encode_tensor(name, tensor, codec)
    for stream in encoded.streams:
        host = stream.pieces
        if host and host[0].is_cuda:
            host = list(torch.cat(host).cpu().split([p.numel() for p in host]))
        for piece, raw_length in zip(host, stream.raw_lengths):
            stream.entry.chunks.append(writer.write_chunk(piece, raw_length))
    entry = encoded.table_entry()
    writer.add_tensor(entry)
    return entry


def verify_checksum(entry: TensorEntry, value: int) -> None:
    """Raise ``CorruptCheckpointError`` unless ``value`` is the entry's wsum64."""
    found = format_wsum64(value)
    if found != entry.checksum:
        raise CorruptCheckpointError(
            f"tensor {entry.name!r}: decoded bytes have checksum {found}, expected {entry.checksum}; "
            "the file is damaged or a codec misbehaved"
        )


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
    verify_checksum(entry, wsum64(data))
    dtype = DTYPES[entry.dtype]
    tensor = data.view(dtype) if entry.nbytes else torch.empty(0, dtype=dtype, device=data.device)
    return tensor.reshape(entry.shape).to(device)
