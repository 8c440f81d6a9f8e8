"""``CompressedStorageWriter``: DCP's ``StorageWriter`` that stores every item compressed."""

from __future__ import annotations

import collections
import dataclasses
import io
import os
import threading
import uuid
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from ..errors import CkptzipError, UnsupportedObjectError, UsageError
from ..engine import Policy, SaveOptions, warm_up, write_state
from ..memory import gpu
from ..storage import write_error
from ..tree import flatten
from ._directory import CheckpointDirectory
from ._args import check_extensions, check_serialization_format
from ._items import describe, pipeline, tensor_name
from ._metadata import StoredItem, check_planner_data, encode_metadata, metadata_file
from ._staging import Staged, stage

DATA_SUFFIX = ".ckzd"


@dataclasses.dataclass(frozen=True)
class _FilePrefix:
    """The per-rank storage data of a save plan: the name prefix of that rank's data file."""

    prefix: str


class CompressedStorageWriter(CheckpointDirectory, StorageWriter):
    """Write a DCP checkpoint whose items are each a compressed one-tensor ``.ckz`` container.

    Use it wherever DCP takes a ``storage_writer``::

        dcp.save(state, storage_writer=CompressedStorageWriter("ckpt/step100"))
        dcp.async_save(state, storage_writer=CompressedStorageWriter("s3://bucket/step100"))

    With ``dcp.async_save`` the writer is DCP's stager (``AsyncStager``): GPU tensors are coded
    on their GPU in the caller and only their stored bytes are copied to pinned host memory,
    which is kept for the next save; host tensors are copied (:mod:`._staging`). The files are
    those of a synchronous save, the staged GPU tensors in ``__<rank>.ckzd``, the rest beside.
    With DCP's checkpoint process (``AsyncCheckpointerType.PROCESS``) the writer is pickled into
    that process and hands it its stagings, in shared memory and without CUDA objects
    (:meth:`__getstate__`).

    Each rank compresses and writes only its own shards, into one data file (``__<rank>.ckzd``,
    a ``.ckz`` container of all its items); shards on a GPU are compressed on that GPU, in
    batches, when nvCOMP is installed.
    The coordinator writes the metadata file last, atomically, so a checkpoint without it is
    incomplete. ``path`` is a directory or an fsspec URL (``storage_options`` go to fsspec).

    The positional arguments are ``FileSystemWriter``'s, in its order, so code written for it
    runs unchanged; ``codec`` and ``storage_options`` are ckptzip's own.

    Args:
        single_file_per_rank: one data file per rank (default), or one per item when False.
        sync_files: fsync data and metadata files (local disks) before the save returns.
        thread_count: accepted for compatibility; items are encoded by the engine's thread pool
            (``CKPTZIP_THREADS``) and, on a GPU, in batches on that GPU.
        per_thread_copy_ahead: accepted for compatibility; the engine copies GPU shards to the
            host in its own batches.
        cache_staged_state_dict: accepted for compatibility: the pinned memory ``dcp.async_save``
            stages into is always kept for the next save.
        overwrite: replace a checkpoint already at ``path``; its metadata is removed before any
            data is written, so a failed save never leaves it describing half-written data.
        _extensions: DCP stream extensions; ckptzip takes none (``UsageError`` says why).
        serialization_format: DCP's ``SerializationFormat``; only ``TORCH_SAVE`` (the default).
        codec: ckptzip preset (``"auto"``, ``"fast"``, ``"portable"``) or codec id, for tensors.
        gpu_memory: cap on the GPU memory coding uses beside the state (as for :func:`ckptzip.save`).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        single_file_per_rank: bool = True,
        sync_files: bool = True,
        thread_count: int | None = None,
        per_thread_copy_ahead: int = 10_000_000,
        cache_staged_state_dict: bool = False,
        overwrite: bool = True,
        _extensions: Sequence[Any] | None = None,
        serialization_format: Any = None,
        *,
        codec: str = "auto",
        storage_options: dict[str, Any] | None = None,
        gpu_memory: int | None = None,
    ) -> None:
        super().__init__()
        check_extensions(_extensions)
        check_serialization_format(serialization_format)
        self._policy = Policy.parse(codec)
        self.codec = codec
        self.single_file_per_rank = single_file_per_rank
        self.sync_files = sync_files
        self.overwrite = overwrite
        self.per_thread_copy_ahead = per_thread_copy_ahead
        self.cache_staged_state_dict = cache_staged_state_dict
        self._open_directory(path, storage_options)
        gpu.cap(gpu_memory)  # a bad value fails here, not in the save
        self.gpu_memory = gpu_memory
        self._staged: collections.deque[Staged | None] = collections.deque()  # stage() → write_data, in order
        self._staged_lock = threading.Lock()
        warm_up(policy=self._policy)  # compile the GPU kernels before the first save needs them
        self.save_id = uuid.uuid4().hex
        self.rank: int | None = None
        self.use_collectives = True

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """Any local path or URL names a place this writer can write to."""
        return isinstance(checkpoint_id, (str, os.PathLike))

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self._reopen(checkpoint_id)
        self.save_id = uuid.uuid4().hex

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.checkpoint_id, save_id=self.save_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.rank = kwargs.get("rank")
        self.use_collectives = kwargs.get("use_collectives", True)

    def _metadata_rank(self) -> int | None:
        """Without collectives every rank writes its own metadata file."""
        return None if self.use_collectives else self.rank

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        self._dir.makedirs()
        check_planner_data(plan.planner_data)
        if not self.use_collectives:
            plan = dataclasses.replace(plan, storage_data=_FilePrefix(f"__{self.rank}"))
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        self._remove_old_metadata()
        return [
            plan if plan.storage_data is not None else dataclasses.replace(plan, storage_data=_FilePrefix(f"__{i}"))
            for i, plan in enumerate(plans)
        ]

    def _remove_old_metadata(self) -> None:
        """Runs before any rank writes data (DCP scatters the global plan first)."""
        name = metadata_file(self._metadata_rank())
        if not self._dir.exists(name):
            return
        if not self.overwrite:
            raise write_error(
                f"a checkpoint already exists at {self._dir.location!r} ({name}) and overwrite=False; "
                "save to a new directory, or pass overwrite=True to replace it"
            )
        self._dir.remove(name)

    # ----------------------------------------------------------- DCP's AsyncStager protocol

    _synchronize_after_execute = True

    @property
    def should_synchronize_after_execute(self) -> bool:
        return self._synchronize_after_execute

    def stage(self, state_dict: Any) -> Any:
        """For ``dcp.async_save``: code the state's GPU tensors on their GPUs now and copy only
        their stored bytes to pinned host memory (host tensors are copied); returns the state
        dict DCP then saves from, on its thread or in its checkpoint process (:mod:`._staging`)."""
        staged_dict, staged = stage(state_dict, self._policy, self.gpu_memory)
        with self._staged_lock:
            self._staged.append(staged)
        return staged_dict

    def synchronize_staging(self) -> None:
        """Wait until the staged bytes are in host memory: the state may change from then on."""
        with self._staged_lock:
            pending = list(self._staged)
        for staged in pending:
            if staged is not None:
                staged.wait()

    def close(self) -> None:
        """Drop stagings no save consumed (DCP calls this when a stager is done)."""
        with self._staged_lock:
            dropped, self._staged = self._staged, collections.deque()
        for staged in dropped:
            if staged is not None:
                staged.release()

    def __getstate__(self) -> dict[str, Any]:
        """What DCP's checkpoint process receives (``AsyncCheckpointerType.PROCESS`` pickles the
        writer with the staged dict): the pending stagings, handed over with their bytes in
        shared memory and no CUDA object (:meth:`._staging.Staged.portable`); this writer keeps
        none of them, so nothing accumulates here from save to save."""
        with self._staged_lock:
            handed, self._staged = self._staged, collections.deque()
        state = {k: v for k, v in self.__dict__.items() if k != "_staged_lock"}
        try:
            state["_staged"] = collections.deque(None if s is None else s.portable() for s in handed)
        except BaseException:
            for staged in handed:  # (those already handed gave their buffers back)
                if staged is not None:
                    staged.release()
            raise
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._staged_lock = threading.Lock()

    # ----------------------------------------------------------------------------- data

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        prefix = plan.storage_data.prefix
        with self._staged_lock:
            staged = self._staged.popleft() if self._staged else None
        results: list[WriteResult] = []
        if staged is not None:
            mine = [item for item in plan.items if self._staged_position(staged, item, planner) is not None]
            if mine:
                results = self._write_staged(prefix + DATA_SUFFIX, mine, staged, planner)
                prefix += "_host"
            else:
                staged.release()
            taken = {id(item) for item in mine}
            plan = dataclasses.replace(plan, items=[item for item in plan.items if id(item) not in taken])
        files = [(prefix + DATA_SUFFIX, plan.items)] if plan.items else []
        if not self.single_file_per_rank:
            files = [(f"{prefix}_{k}{DATA_SUFFIX}", [item]) for k, item in enumerate(plan.items)]
        results += [result for name, items in files for result in self._write_file(name, items, planner)]
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    def _write_file(self, name: str, items: list[WriteItem], planner: SavePlanner) -> list[WriteResult]:
        """All of this rank's items as one container, encoded in batches by the engine (tensors on
        a GPU on that GPU)."""
        tensors = [self._resolve(item, planner) for item in items]
        names = [tensor_name(item.index) for item in items]
        with self._dir.atomic_write(name, sync=self.sync_files) as stream:
            entries = write_state(stream, names, tensors, [{"tensor": k} for k in range(len(items))],
                                  SaveOptions(self._policy, gpu_memory=self.gpu_memory))
        return [
            WriteResult(index=item.index, size_in_bytes=entry.compressed_nbytes,
                        storage_data=StoredItem(name, 0, entry.compressed_nbytes, pipeline(entry), entry.checksum, k))
            for k, (item, entry) in enumerate(zip(items, entries))
        ]

    @staticmethod
    def _staged_position(staged: Staged, item: WriteItem, planner: SavePlanner) -> int | None:
        """Where a tensor item's staged bytes are in the staged table, or None (not staged)."""
        if item.type == WriteItemType.BYTE_IO:
            return None
        data = planner.resolve_data(item)
        return staged.position(data) if isinstance(data, torch.Tensor) else None

    def _write_staged(self, name: str, items: list[WriteItem], staged: Staged, planner: SavePlanner
                      ) -> list[WriteResult]:
        """The staged tensors as one container (every one staged, so the file is what a
        synchronous save of those tensors writes); results for this plan's items among them."""
        positions = [self._staged_position(staged, item, planner) for item in items]
        with self._dir.atomic_write(name, sync=self.sync_files) as stream:
            entries = staged.host.write(stream, [{"tensor": k} for k in range(staged.count)])
        return [
            WriteResult(index=item.index, size_in_bytes=entries[k].compressed_nbytes,
                        storage_data=StoredItem(name, 0, entries[k].compressed_nbytes, pipeline(entries[k]),
                                                entries[k].checksum, k))
            for item, k in zip(items, positions) if k is not None
        ]

    def _resolve(self, item: WriteItem, planner: SavePlanner) -> torch.Tensor:
        """An item's data as a tensor: the tensor itself, or a non-tensor value's serialized bytes."""
        data = planner.resolve_data(item)
        where = describe(item.index)
        if isinstance(data, io.BytesIO):
            raw = data.getvalue()
            return torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        if isinstance(data, torch.Tensor):
            if data.is_meta:
                raise UsageError(
                    f"{where} is a meta tensor (a staged tensor's placeholder without its staging, or a model "
                    "not materialized): DCP saves only tensors with data; stage each state with the writer "
                    "that saves it"
                )
            try:
                return flatten(data.detach()).tensors[0].tensor
            except CkptzipError as exc:
                raise type(exc)(f"{where}: {exc}") from exc
        raise UnsupportedObjectError(
            f"the save planner resolved {where} to a {type(data).__name__}; "
            "a storage writer takes tensors and io.BytesIO objects"
        )

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Write the metadata file; ``metadata`` (which ``dcp.save`` returns) is completed in place."""
        items: dict[MetadataIndex, StoredItem] = {r.index: r.storage_data for rank in results for r in rank}
        metadata.storage_data = items
        metadata.storage_meta = self.storage_meta()
        name = metadata_file(self._metadata_rank())
        self._dir.write_bytes(name, encode_metadata(metadata, items), sync=self.sync_files)
