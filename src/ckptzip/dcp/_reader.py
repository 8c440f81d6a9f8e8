"""``CompressedStorageReader``: DCP's ``StorageReader`` for checkpoints ckptzip wrote."""

from __future__ import annotations

import functools
import io
import itertools
import os
import uuid
from collections.abc import Iterable, Iterator
from typing import IO, Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from ..codecs import cpu_threads
from ..engine import Limit, packed, read_tensors
from ..errors import CheckpointNotFoundError, CkptzipError, CorruptCheckpointError
from ..format import DTYPES, ContainerReader
from ..memory import gpu
from ..storage import ByteRanges, open_directory
from ..engine import Task, read_ahead, run_ahead
from ._directory import CheckpointDirectory
from ._items import check_safe_object, check_shape, decode_blob, describe, pipeline
from ._metadata import StoredItem, decode_metadata, metadata_file

_DCP_METADATA_FILE = ".metadata"


def _groups(nbytes: list[int], devices: list[torch.device]) -> list[list[int]]:
    """Items decoded together: all at once, unless the GPU tensors would not fit beside the
    targets they are copied into (a GPU that training fills); then in groups of GPU bytes up to
    half of what can be had, so a load needs the targets plus about that much."""
    on_gpu = [d if d.type == "cuda" else None for d in devices]
    limits: dict[torch.device | None, Limit] = {
        d: Limit(within=gpu.available(d) // 2) for d in set(on_gpu) if d is not None}
    limits[None] = Limit()  # host targets ride along
    return packed(range(len(nbytes)), nbytes, on_gpu, limits, shared=True)


class CompressedStorageReader(CheckpointDirectory, StorageReader):
    """Read a DCP checkpoint written by :class:`CompressedStorageWriter`, on any number of ranks::

        dcp.load(state, storage_reader=CompressedStorageReader("ckpt/step100"))

    Every stored chunk is verified (chunk and tensor checksums) before it reaches the state
    dict; a damaged chunk raises ``CorruptCheckpointError`` naming the item. Shards are decoded on
    the device of the tensor they load into. Nothing from the files is unpickled by ckptzip;
    non-tensor values are unpickled by DCP's load planner, and ckptzip first checks that torch's
    ``weights_only`` unpickler accepts them unless ``trusted_objects=True``.

    Args:
        _extension_registry: DCP's registry of stream extensions (``FileSystemReader``'s second
            argument); kept, never consulted: ckptzip checkpoints record no stream extension.
        trusted_objects: hand non-tensor values to the planner without that check.
        thread_count: CPU threads decoding items concurrently (default: up to 4).
        storage_options: fsspec options when ``path`` is a URL.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        _extension_registry: Any = None,
        *,
        trusted_objects: bool = False,
        thread_count: int | None = None,
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self.extension_registry = _extension_registry
        self.trusted_objects = trusted_objects
        self.thread_count = thread_count or min(4, cpu_threads())
        self._open_directory(path, storage_options)
        self.load_id = uuid.uuid4().hex
        self._items: dict[MetadataIndex, StoredItem] = {}
        self._chunks: dict[MetadataIndex, tuple[torch.dtype, torch.Size]] = {}

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """Whether a ckptzip DCP checkpoint is at ``checkpoint_id``."""
        try:
            return open_directory(checkpoint_id).exists(metadata_file(None))
        except (CkptzipError, OSError, ValueError):
            return False

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self._reopen(checkpoint_id)
        self._items = {}
        self._chunks = {}
        self.load_id = uuid.uuid4().hex

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """Read the checkpoint's metadata file (a rank's own one when ``rank=`` is given, as DCP
        asks for checkpoints saved with ``use_collectives=False``)."""
        name = metadata_file(kwargs.get("rank"))
        try:
            data = self._dir.read_bytes(name)
        except FileNotFoundError:
            raise CheckpointNotFoundError(self._not_found_message(name)) from None
        metadata = decode_metadata(data, repr(self._dir.where(name)))
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def _not_found_message(self, name: str) -> str:
        where = self._dir.where(name)
        if self._dir.exists(_DCP_METADATA_FILE):
            return (
                f"no ckptzip checkpoint metadata at {where!r}: the directory holds a plain DCP checkpoint "
                "(FileSystemWriter's .metadata); load it with torch.distributed.checkpoint.FileSystemReader"
            )
        return (
            f"no ckptzip checkpoint metadata at {where!r}; the checkpoint does not exist or its save did "
            "not finish (the metadata file is written last)"
        )

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self._items = metadata.storage_data
        self._chunks = {
            MetadataIndex(fqn, chunk.offsets): (md.properties.dtype, chunk.sizes)
            for fqn, md in metadata.state_dict_metadata.items()
            if isinstance(md, TensorStorageMetadata)
            for chunk in md.chunks
        }

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Read each stored item once (however many requests it serves), file by file in offset
        order and one blob ahead, decoding a few items ahead on a thread pool (on the calling
        thread for GPU targets)."""
        requests: dict[MetadataIndex, list[ReadItem]] = {}
        for request in plan.items:
            requests.setdefault(request.storage_index, []).append(request)
        located = sorted(
            ((self._stored(index), index, reqs) for index, reqs in requests.items()),
            key=lambda entry: (entry[0].file, entry[0].offset),
        )
        for name, group in itertools.groupby(located, key=lambda entry: entry[0].file):
            try:
                with self._dir.open_read(name) as stream:
                    items = list(group)
                    if items[0][0].tensor is not None:
                        self._read_container(stream, name, items, planner)
                        continue
                    tasks = self._decode_tasks(stream, iter(items), planner)
                    for (index, reqs, targets), value in run_ahead(tasks, self.thread_count):
                        self._deliver(index, reqs, targets, value, planner)
            except FileNotFoundError:
                raise CorruptCheckpointError(
                    f"data file {self._dir.where(name)!r} of the checkpoint is missing; "
                    "the checkpoint is incomplete or was partly deleted"
                ) from None
        future: Future[None] = Future()
        future.set_result(None)
        return future

    def _read_container(self, stream: IO[bytes], name: str,
                        items: list[tuple[StoredItem, MetadataIndex, list[ReadItem]]], planner: LoadPlanner) -> None:
        """Items of a version-2 data file (one container of a rank's items): decoded together by the
        engine, each onto the device of the tensor it loads into."""
        where = repr(self._dir.where(name))
        try:
            container = ContainerReader(stream)
        except CkptzipError as exc:
            raise type(exc)(f"data file {where}: {exc}") from exc
        positions: list[int] = []
        devices: list[torch.device] = []
        targets: list[list[torch.Tensor]] = []
        direct: list[torch.Tensor | None] = []  # a target the item decodes straight into
        for stored, index, reqs in items:
            positions.append(self._position(container, stored, index, where))
            if reqs[0].type == LoadItemType.BYTE_IO:
                devices.append(torch.device("cpu"))
                targets.append([])
                direct.append(None)
                continue
            tensors = [planner.resolve_tensor(req).detach() for req in reqs]
            devices.append(tensors[0].device)
            targets.append(tensors)
            direct.append(tensors[0] if self._whole(container.tensors[positions[-1]].dtype, index, reqs, tensors[0])
                          else None)
        sizes = [0 if d is not None else container.tensors[p].nbytes for p, d in zip(positions, direct)]
        for group in _groups(sizes, devices):
            try:
                values = read_tensors(container, [positions[i] for i in group], [devices[i] for i in group],
                                      into=[direct[i] for i in group])
            except CkptzipError as exc:
                raise type(exc)(f"data file {where}: {exc}") from exc
            for i, value in zip(group, values):
                (stored, index, reqs), tensors = items[i], targets[i]
                target = direct[i]
                if target is not None and value.data_ptr() == target.data_ptr() and value.numel():
                    check_shape(value, *self._chunks[index], self._where(index, stored))
                    planner.commit_tensor(reqs[0], tensors[0])  # decoded in place
                    continue
                delivered = (self._bytes_of(value, f"{describe(index)} in {where}")
                             if reqs[0].type == LoadItemType.BYTE_IO else value)
                self._deliver(index, reqs, tensors, delivered, planner)
            del values  # the group's decoded tensors, copied into their targets

    def _whole(self, dtype: str, index: MetadataIndex, reqs: list[ReadItem], target: torch.Tensor) -> bool:
        """Whether an item's one request loads the whole stored chunk into a contiguous target of
        its dtype (stored as ``dtype``), which it can then be decoded straight into."""
        if len(reqs) != 1 or index not in self._chunks:
            return False
        sizes = list(self._chunks[index][1])
        req = reqs[0]
        return (all(o == 0 for o in req.storage_offsets) and list(req.lengths) == sizes
                and list(target.shape) == sizes and target.is_contiguous() and target.dtype == DTYPES.get(dtype))

    def _position(self, container: ContainerReader, stored: StoredItem, index: MetadataIndex, where: str) -> int:
        """The container's tensor of an item; raise unless it is the one the metadata recorded."""
        position = stored.tensor
        if position is None or not 0 <= position < len(container.tensors):
            raise CorruptCheckpointError(
                f"{describe(index)}: the checkpoint metadata places it at tensor {position} of {where}, "
                f"which holds {len(container.tensors)}; the data file and the metadata do not belong together"
            )
        entry = container.tensors[position]
        found = (pipeline(entry), entry.checksum)
        if found != (stored.pipeline, stored.checksum):
            raise CorruptCheckpointError(
                f"{describe(index)} in {where}: the stored tensor (codec pipeline {found[0]}, checksum {found[1]}) "
                f"is not the one the checkpoint metadata recorded (codec pipeline {stored.pipeline}, checksum "
                f"{stored.checksum}); the data file and the metadata do not belong together"
            )
        return position

    def _bytes_of(self, decoded: torch.Tensor, where: str) -> bytes:
        """A non-tensor item's serialized bytes, checked as torch's weights_only loader would."""
        if decoded.dtype != torch.uint8 or decoded.dim() != 1:
            raise CorruptCheckpointError(
                f"{where}: a non-tensor value is stored as 1-D uint8 bytes, found {decoded.dtype} "
                f"{list(decoded.shape)}; the data file and the metadata do not belong together"
            )
        data = decoded.numpy().tobytes()
        if not self.trusted_objects:
            check_safe_object(data, where)
        return data

    def _stored(self, index: MetadataIndex) -> StoredItem:
        try:
            return self._items[index]
        except KeyError:
            raise CorruptCheckpointError(
                f"{describe(index)}: the checkpoint metadata lists no stored data for it"
            ) from None

    def _where(self, index: MetadataIndex, stored: StoredItem) -> str:
        if stored.tensor is not None:
            return f"{describe(index)} in {self._dir.where(stored.file)!r}"
        return f"{describe(index)} in {self._dir.where(stored.file)!r} at bytes {stored.offset}+{stored.length}"

    def _decode_tasks(
        self,
        stream: IO[bytes],
        group: Iterable[tuple[StoredItem, MetadataIndex, list[ReadItem]]],
        planner: LoadPlanner,
    ) -> Iterator[Task[tuple[MetadataIndex, list[ReadItem], list[torch.Tensor]], Any]]:
        ranges = ByteRanges(stream)
        blobs = read_ahead(
            (stored, index, reqs, ranges.read(stored.offset, stored.length, self._where(index, stored)))
            for stored, index, reqs in group
        )
        for stored, index, reqs, blob in blobs:
            where = self._where(index, stored)
            if reqs[0].type == LoadItemType.BYTE_IO:
                yield Task((index, reqs, []), functools.partial(self._decode_bytes, blob, stored, where))
                continue
            targets = [planner.resolve_tensor(req).detach() for req in reqs]
            device = targets[0].device
            yield Task(
                (index, reqs, targets),
                functools.partial(decode_blob, blob, stored, device, where),
                inline=device.type == "cuda",
            )

    def _decode_bytes(self, blob: bytes, stored: StoredItem, where: str) -> bytes:
        return self._bytes_of(decode_blob(blob, stored, torch.device("cpu"), where), where)

    def _deliver(
        self,
        index: MetadataIndex,
        reqs: list[ReadItem],
        targets: list[torch.Tensor],
        value: Any,
        planner: LoadPlanner,
    ) -> None:
        if isinstance(value, bytes):
            for req in reqs:
                planner.load_bytes(req, io.BytesIO(value))
            return
        where = self._where(index, self._items[index])
        if index not in self._chunks:
            raise CorruptCheckpointError(f"{where}: the checkpoint metadata describes no such tensor chunk")
        check_shape(value, *self._chunks[index], where)
        for req, target in zip(reqs, targets):
            piece = value
            for dim, (start, length) in enumerate(zip(req.storage_offsets, req.lengths)):
                piece = piece.narrow(dim, start, length)
            if piece.shape != target.shape:
                raise CorruptCheckpointError(
                    f"{where}: the load plan asks for a {list(piece.shape)} region but its target is "
                    f"{list(target.shape)}"
                )
            target.copy_(piece)
            planner.commit_tensor(req, target)
