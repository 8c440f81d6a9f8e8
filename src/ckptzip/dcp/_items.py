"""DCP items: how messages name them, their tensors' names in a data file, and decoding the
one-tensor containers of version-1 checkpoints (ckptzip 0.1.0)."""

from __future__ import annotations

import contextlib
import io
import pickle
import threading
from collections.abc import Iterator
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex

from ..api import CompressedTensor, decompress
from ..errors import CkptzipError, CorruptCheckpointError, UnsupportedObjectError
from ..format import TensorEntry
from ..plain import weights_only_refusal
from ._metadata import StoredItem

def describe(index: MetadataIndex) -> str:
    """``item 'model.w' (chunk at offsets [16, 0])``: how messages name a DCP item."""
    if index.offset is None or len(index.offset) == 0:
        return f"item {index.fqn!r}"
    return f"item {index.fqn!r} (chunk at offsets {list(index.offset)})"


def tensor_name(index: MetadataIndex) -> str:
    """The name of an item's tensor in a data file: ``model.w``, or ``model.w@16,0`` for a shard."""
    if index.offset is None or len(index.offset) == 0:
        return index.fqn
    return f"{index.fqn}@{','.join(map(str, index.offset))}"


def pipeline(entry: TensorEntry) -> dict[str, Any]:
    """The codec pipeline of a stored tensor: its transforms, then one codec per stream."""
    return {"transforms": entry.transforms, "codecs": [s.codec for s in entry.streams]}


def _on(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """Make ``device`` current for GPU work, whatever device the calling thread had current."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


@contextlib.contextmanager
def _naming(where: str) -> Iterator[None]:
    """Prefix the message of a ckptzip error with the item it concerns; keep its type."""
    try:
        yield
    except CkptzipError as exc:
        raise type(exc)(f"{where}: {exc}") from exc


def decode_blob(blob: bytes, stored: StoredItem, device: torch.device, where: str) -> torch.Tensor:
    """Decode and verify one stored blob on ``device``; errors name the item (``where``).

    A blob whose container disagrees with the pipeline or checksum the metadata recorded for the
    item belongs to another item or another checkpoint.
    """
    with _naming(where):
        ct = CompressedTensor.from_bytes(blob)
        found = (pipeline(ct.entry), ct.entry.checksum)
        if found != (stored.pipeline, stored.checksum):
            raise CorruptCheckpointError(
                f"the stored container (codec pipeline {found[0]}, checksum {found[1]}) is not "
                f"the one the checkpoint metadata recorded (codec pipeline {stored.pipeline}, checksum "
                f"{stored.checksum}); the data file and the metadata do not belong together"
            )
        with _on(device):
            return decompress(ct, device=device)


def check_shape(tensor: torch.Tensor, dtype: torch.dtype, shape: torch.Size, where: str) -> None:
    """Raise ``CorruptCheckpointError`` unless ``tensor`` is what the metadata says was stored."""
    if tensor.dtype != dtype or tensor.shape != shape:
        raise CorruptCheckpointError(
            f"{where}: the stored tensor is {tensor.dtype} {list(tensor.shape)}, the checkpoint metadata "
            f"says {dtype} {list(shape)}; the data file and the metadata do not belong together"
        )


def check_safe_object(data: bytes, where: str) -> None:
    """Refuse a serialized object that torch's ``weights_only`` unpickler would not load.

    DCP's load planner unpickles non-tensor items with ``torch.load(weights_only=False)``, which
    can run code; this check lets through only what the restricted unpickler accepts (tensors,
    containers, numbers, strings, ...), so loading runs no code from the file.
    """
    try:
        with _byte_buffers_allowed():
            torch.load(io.BytesIO(data), weights_only=True)
    except pickle.UnpicklingError as exc:
        raise UnsupportedObjectError(
            f"{where} is a pickled Python object that torch's weights_only loader refuses "
            f"({weights_only_refusal(exc)}). DCP would unpickle it without restriction, which can run code from "
            "the file. If you trust this checkpoint, load it with "
            "CompressedStorageReader(path, trusted_objects=True), or allowlist the class with "
            "torch.serialization.add_safe_globals."
        ) from exc


_SAFE_GLOBALS_LOCK = threading.Lock()


@contextlib.contextmanager
def _byte_buffers_allowed() -> Iterator[None]:
    """Let the ``weights_only`` unpickler rebuild ``io.BytesIO`` values (torchtitan's train and
    data loader state): pickle makes one from its bytes, position and attribute dict, each
    unpickled under the same restrictions, and ``BytesIO.__setstate__`` only stores them, so no
    code runs. torch's allowlist is process-wide: the lock keeps checks on other threads from
    removing the entry while one runs, and an entry the caller added is left in place."""
    safe_globals = getattr(torch.serialization, "safe_globals", None)  # torch >= 2.5
    with _SAFE_GLOBALS_LOCK:
        if safe_globals is None or io.BytesIO in torch.serialization.get_safe_globals():
            yield
            return
        with safe_globals([io.BytesIO]):
            yield
