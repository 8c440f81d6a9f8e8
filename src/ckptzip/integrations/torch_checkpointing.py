"""torch_checkpointing integration: Meta's ``CheckpointManager`` with its items stored coded by
ckptzip::

    from ckptzip.integrations.torch_checkpointing import CompressedCheckpointManager

    manager = CompressedCheckpointManager(CheckpointManager.Config(...), codec="auto")
    manager.save("ckpt/step_1000", {"model": model.state_dict(), "optimizer": optim.state_dict(), "step": 1000})
    manager.load("ckpt/step_1000", into={"model": model.state_dict(), "optimizer": optim.state_dict()})

``save`` codes each item that is a mapping holding tensors (``coded=`` names them instead) the
way ckptzip's DCP stager does: its GPU tensors on their GPU, on the caller's stream, in batches
whose stored bytes are copied into pinned shared memory; its host tensors are copied into
shared memory. The item then holds only a snapshot, so torch_checkpointing's stager keeps it as
it is, its writer process receives the compressed bytes without a copy, and the training loop
may change the state as soon as ``save`` returns (no ``manager.lock()`` is needed for these
items). The writer (the checkpoint process, or the caller for a synchronous saver) writes each
coded item as the ``torch.save`` archive torch_checkpointing reads (``<item>_<rank>.pt``), whose
one tensor record is a ckptzip container; loading it decodes it (every chunk verified) while
torch unpickles, so torch_checkpointing's own reader, resharder and ``torch.load`` read it.
"""

from __future__ import annotations

import dataclasses
import io
import sys
import warnings
from collections.abc import Collection, Mapping
from concurrent.futures import Future
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
from torch.distributed.tensor import DTensor

try:
    from torch_checkpointing import CheckpointManager
    from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig
except ImportError as exc:
    raise ImportError(
        "ckptzip.integrations.torch_checkpointing needs torch_checkpointing, which is not installed; "
        "install it with: pip install 'ckptzip[torch-checkpointing]'"
    ) from exc

from ..api import load
from ..engine import Policy, warm_up
from ..errors import UnsupportedFormatError, UnsupportedObjectError
from ..memory.pinned import PinnedPool
from ..staging import HostStaged, stage_coded
from ..tree import flatten, map_tree

__all__ = ["CompressedCheckpointManager", "CompressedItem"]

# The archives name _decoded (this module's) and pass it (FORMAT, container, DTensor shells): its
# module, name and arguments are a file format, kept as they are for every archive written
FORMAT = 1
_Shell = tuple[Any, Any, torch.Size, tuple[int, ...]]  # a DTensor's mesh, placements, global shape and stride


class CompressedItem(dict):  # type: ignore[type-arg]
    """One checkpoint item staged by ckptzip. As a mapping it is the item as saved (the live
    values: torch_checkpointing reads its sharding metadata from them); what is written is the
    snapshot: a :class:`~ckptzip.staging.HostStaged` whose GPU tensors are coded already.

    It crosses to torch_checkpointing's writer process as its snapshot in shared memory (a
    reduction registered with ``multiprocessing``'s pickler), and ``torch.save`` writes it as one
    ckptzip container (``__reduce_ex__``). Staging copies nothing of it (``__deepcopy__``)."""

    _staged: HostStaged
    _tree: Any
    _shells: dict[str, _Shell]
    _container: torch.Tensor | None

    @classmethod
    def stage(cls, value: Mapping[Any, Any], codec: str, pool: PinnedPool, gpu_memory: int | None) -> CompressedItem:
        """Snapshot ``value`` now: GPU tensors coded on their GPUs (queued on the caller's stream),
        host tensors copied into shared memory. DTensors are stored as their local tensors and
        rebuilt around them on load. Raises :class:`~ckptzip.errors.UnsupportedObjectError` for
        a value ckptzip does not store."""
        shells: dict[str, _Shell] = {}

        def local(leaf: Any, path: str) -> Any:
            if isinstance(leaf, DTensor):
                shells[path] = (leaf.device_mesh, leaf.placements, leaf.shape, leaf.stride())
                return leaf._local_tensor
            return leaf

        flat = flatten(map_tree(value, local))
        staged = stage_coded([t.name for t in flat.tensors], [t.tensor for t in flat.tensors], Policy.parse(codec),
                             pool, gpu_memory, shared=True)
        return cls._of(value, staged, flat.tree, shells)

    @classmethod
    def _of(cls, value: Mapping[Any, Any], staged: HostStaged, tree: Any, shells: dict[str, _Shell]
            ) -> CompressedItem:
        item = cls(value)
        item._staged, item._tree, item._shells, item._container = staged, tree, shells, None
        return item

    @property
    def staged(self) -> HostStaged:
        return self._staged

    def __deepcopy__(self, memo: dict[int, Any]) -> CompressedItem:
        return self  # a snapshot already: staging it again would copy compressed bytes for nothing

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        """What ``torch.save`` writes: ``_decoded(FORMAT, container, shells)``, the container a
        uint8 tensor (one record of the archive). Built once: the staged bytes are written into
        it, the host tensors coded now."""
        if self._container is None:
            buffer = io.BytesIO()
            self._staged.write(buffer, self._tree)
            self._container = torch.frombuffer(bytearray(buffer.getbuffer()), dtype=torch.uint8)
        return (_decoded, (FORMAT, self._container, self._shells))


def _handed_over(item: CompressedItem) -> tuple[Any, ...]:
    """The item as torch_checkpointing's writer process receives it: its snapshot, portable."""
    return (_received, (item._staged.portable(), item._tree, item._shells))


def _received(staged: HostStaged, tree: Any, shells: dict[str, _Shell]) -> CompressedItem:
    return CompressedItem._of({}, staged, tree, shells)


ForkingPickler.register(CompressedItem, _handed_over)


def _decoded(version: int, container: torch.Tensor, shells: dict[str, _Shell]) -> Any:
    """The item ``torch.load`` (or torch_checkpointing's reader) finds in the archive, decoded and
    verified: on the device the container was mapped to where that is not the host (a
    ``map_location`` of a GPU), else on the host. A meta container (torch_checkpointing's
    resharder reading tensor slices by offset) has no bytes to slice: ``NotImplementedError``
    sends the resharder to read the whole file."""
    if version != FORMAT:
        raise UnsupportedFormatError(
            f"a ckptzip torch_checkpointing item of format {version}; this ckptzip reads format {FORMAT}: upgrade ckptzip"
        )
    if container.is_meta:
        raise NotImplementedError("a ckptzip item is decoded whole, not read by tensor offsets")
    device = container.device
    state = load(container.cpu().numpy().data, map_location=device)
    if not shells:
        return state

    def rewrap(leaf: Any, path: str) -> Any:
        shell = shells.get(path)
        if shell is None:
            return leaf
        mesh, placements, shape, stride = shell
        return DTensor.from_local(leaf, mesh, placements, run_check=False, shape=shape, stride=stride)

    return map_tree(state, rewrap)


def _holds_tensors(value: Any) -> bool:
    return isinstance(value, torch.Tensor) or (
        isinstance(value, Mapping) and any(_holds_tensors(v) for v in value.values())
    ) or (isinstance(value, (list, tuple)) and any(_holds_tensors(v) for v in value))


class CompressedCheckpointManager(CheckpointManager):
    """torch_checkpointing's ``CheckpointManager`` whose items are stored coded by ckptzip
    (module docstring). Everything else is torch_checkpointing's: its savers (synchronous, or
    staging and a writer process), its commit protocol, metadata and resharding, and ``load``.

    Args:
        config: torch_checkpointing's ``CheckpointManager.Config``. Without a ``storage_config``
            it writes local files without O_DIRECT (``LocalFileSystemStorageConfig(use_direct_io=
            False)``): ``torch.save``'s unaligned writes fail with EINVAL through O_DIRECT on
            filesystems that enforce its alignment.
        codec: ckptzip preset (``"auto"``, ``"fast"``, ``"portable"``) or codec id.
        coded: the items to code; by default every item that is a mapping holding tensors, each
            saved by torch_checkpointing as usual (with a warning) where ckptzip cannot store a
            value in it. Items named here raise instead.
        gpu_memory: cap on the GPU memory coding uses beside the state (as for ``ckptzip.save``).
    """

    def __init__(self, config: CheckpointManager.Config | None = None, *, codec: str = "auto",
                 coded: Collection[str] | None = None, gpu_memory: int | None = None) -> None:
        config = config or CheckpointManager.Config()
        if config.storage_config is None:
            config = dataclasses.replace(config, storage_config=LocalFileSystemStorageConfig(use_direct_io=False))
        super().__init__(config)
        Policy.parse(codec)  # a bad codec fails here, not in the first save
        self._codec = codec
        self._coded = None if coded is None else frozenset(coded)
        self._gpu_memory = gpu_memory
        # staged bytes cross to the writer process without a copy; reused once that write is done
        self._pool = PinnedPool(count=sys.maxsize, shared=True)
        self._in_flight: list[HostStaged] = []
        self._last_write: Future[Any] | None = None
        warm_up(policy=Policy.parse(codec))

    def save(self, checkpoint_id: str, checkpoint: Mapping[str, Any]) -> Future[Any] | None:
        """Stage the items ckptzip codes (module docstring), then save as torch_checkpointing
        does. Waits for the previous write first (as torch_checkpointing's own save does), since
        its staged bytes are in the buffers this one reuses."""
        self._settle()
        payload = {key: self._item(key, value) for key, value in checkpoint.items()}
        self._in_flight = [v.staged for v in payload.values() if isinstance(v, CompressedItem)]
        try:
            self._last_write = super().save(checkpoint_id, payload)
        except BaseException:
            self._settle()
            raise
        if self._last_write is None:
            self._settle()
        return self._last_write

    def _item(self, key: str, value: Any) -> Any:
        named = self._coded is not None and key in self._coded
        if not named and (self._coded is not None or not (isinstance(value, Mapping) and _holds_tensors(value))):
            return value
        if not isinstance(value, Mapping):
            raise UnsupportedObjectError(f"item {key!r} is a {type(value).__name__}; ckptzip codes mapping items")
        try:
            return CompressedItem.stage(value, self._codec, self._pool, self._gpu_memory)
        except UnsupportedObjectError as exc:
            if named:
                raise UnsupportedObjectError(f"item {key!r}: {exc}") from exc
            warnings.warn(f"ckptzip: item {key!r} is saved by torch_checkpointing itself, uncompressed: {exc}; "
                          "make it storable, or leave it out of coded=", stacklevel=3)
            return value

    def _settle(self) -> None:
        """Wait for the last write, then give its staged buffers back (an error of that write is
        torch_checkpointing's to raise, in its next save or close)."""
        if self._last_write is not None:
            try:
                self._last_write.exception()
            finally:
                self._last_write = None
        for staged in self._in_flight:
            staged.release()
        self._in_flight = []

    def close(self) -> None:
        try:
            super().close()
        finally:
            self._settle()
            self._pool.clear()
