"""torchtitan integration: checkpoint managers that store torchtitan's checkpoints with ckptzip,
for torchtitan 0.2 and 0.3.

- :class:`CompressedCheckpointManager` saves each step as a DCP checkpoint through ckptzip's
  DCP storage (:mod:`ckptzip.dcp`): ``.metadata.ckz`` and one ``__<rank>.ckzd`` per rank.
- :class:`CompressedTorchCheckpointingManager` saves each step through Meta's torch_checkpointing
  (what torchtitan 0.3's own ``torch_checkpointing`` checkpointer plans to build on), its model
  and optimizer items coded by ckptzip (:mod:`ckptzip.integrations.torch_checkpointing`).

Both are torchtitan's ``CheckpointManager`` otherwise: intervals, ``keep_latest_k``, the
last-step model-only export, ``exclude_from_loading`` and every ``async_mode`` (``disabled``,
``async``, ``async_with_pinned_mem``). Loading reads what a step directory holds: either kind of
ckptzip checkpoint, or anything torchtitan reads (a plain DCP seed or ``initial_load_path``
checkpoint, Hugging Face safetensors).

torchtitan 0.3 builds its checkpoint manager from the job config::

    config.checkpoint = CompressedCheckpointManager.Config(enable=True, interval=500,
                                                           async_mode="async", codec="auto")

torchtitan 0.2's trainer constructs ``torchtitan.train.CheckpointManager`` by name, so there the
class is put in its place (``functools.partial(CompressedCheckpointManager, codec=...)`` for
other options)::

    torchtitan.train.CheckpointManager = CompressedCheckpointManager
"""

from __future__ import annotations

import os
import re
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, cast

from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType, AsyncSaveResponse, async_save, save
from torch.distributed.checkpoint.stateful import Stateful

from ckptzip.dcp import CompressedStorageReader, CompressedStorageWriter

try:
    from torchtitan.components.checkpoint import MODEL, OPTIMIZER, AsyncMode, CheckpointManager
    from torchtitan.tools.utils import GarbageCollection
except ImportError as exc:
    raise ImportError(
        "ckptzip.integrations.torchtitan needs torchtitan, which is not installed; "
        "install it with: pip install 'ckptzip[torchtitan]'"
    ) from exc

__all__ = ["CompressedCheckpointManager", "CompressedTorchCheckpointingManager"]

_STEP = re.compile(r"step-(\d+)")
# torchtitan >= 0.3 builds its components from nested Config dataclasses (and reads local or
# fsspec folders); torchtitan 0.2 passes the job config's checkpoint section (local folders)
_BUILT_FROM_CONFIG = hasattr(CheckpointManager, "Config")
# a step torch_checkpointing committed (it renames a step's directory into place once written);
# its metadata.pkl is no marker: its synchronous saver writes it with the first checkpoint only
_TORCH_CHECKPOINTING_MODEL = f"{MODEL}_0.pt"


def _listdir(folder: str) -> list[str]:
    if _BUILT_FROM_CONFIG:
        from torchtitan.tools import filesystem

        return filesystem.listdir(folder) if filesystem.isdir(folder) else []
    return os.listdir(folder) if os.path.isdir(folder) else []


def _join(folder: str, name: str) -> str:
    if _BUILT_FROM_CONFIG:
        from torchtitan.tools import filesystem

        return str(filesystem.join(folder, name))
    return os.path.join(folder, name)


def _isfile(path: str) -> bool:
    if _BUILT_FROM_CONFIG:
        from torchtitan.tools import filesystem

        return bool(filesystem.isfile(path))
    return os.path.isfile(path)


class CompressedCheckpointManager(CheckpointManager):
    """torchtitan's ``CheckpointManager`` with its DCP checkpoints stored by ckptzip.

    Args (besides torchtitan's): ``codec``, a ckptzip preset (auto, fast, portable) or codec id
    for the tensors; ``trusted_objects``, to load non-tensor values torch's weights_only unpickler
    refuses (trusted runs only). With torchtitan 0.3 both are fields of :class:`Config`.
    """

    if _BUILT_FROM_CONFIG:

        @dataclass(kw_only=True, slots=True)
        class Config(CheckpointManager.Config):
            codec: str = "auto"
            """ckptzip preset (auto, fast, portable) or codec id for the tensors."""

            trusted_objects: bool = False
            """Load non-tensor values torch's weights_only unpickler refuses (trusted runs only)."""

    def __init__(self, *args: Any, codec: str | None = None, trusted_objects: bool | None = None,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        config = kwargs.get("config", kwargs.get("checkpoint_config", args[0] if args else None))
        self.codec = codec if codec is not None else getattr(config, "codec", "auto")
        self.trusted_objects = (trusted_objects if trusted_objects is not None
                                else getattr(config, "trusted_objects", False))

    def dcp_save(
        self, state_dict: dict[str, Any], checkpoint_id: str, async_mode: AsyncMode,
        enable_garbage_collection: bool = False, to_hf: bool = False,
    ) -> Any:
        """Save one step through :class:`CompressedStorageWriter` (a Hugging Face export as torchtitan does)."""
        if to_hf:
            return super().dcp_save(state_dict, checkpoint_id, async_mode, enable_garbage_collection, to_hf)
        writer = CompressedStorageWriter(checkpoint_id, codec=self.codec)
        result: Any
        if async_mode == AsyncMode.DISABLED:
            result = save(state_dict, storage_writer=writer)
        elif async_mode == AsyncMode.ASYNC:
            result = async_save(state_dict, storage_writer=writer, process_group=self.pg)
        else:
            # DCP's checkpoint process writes, staged by the writer in place of torchtitan's pinned
            # stager: GPU tensors coded on the GPU into pinned memory, done when async_save returns
            # (torch 2.11 leaves a DefaultStager unusable after its first async_save, and
            # torchtitan reuses it)
            upload = async_save(state_dict, storage_writer=writer, process_group=self.pg,
                                async_checkpointer_type=AsyncCheckpointerType.PROCESS)
            staged: Future[None] = Future()
            staged.set_result(None)
            # a stager that stages at once (the writer) makes async_save return the upload's future
            result = AsyncSaveResponse(staging_completion=staged, upload_completion=cast("Future[None]", upload))
        if enable_garbage_collection:
            GarbageCollection.collect("GC collection invoked by checkpointer.")
        return result

    def dcp_load(self, state_dict: dict[str, Any], checkpoint_id: str, from_hf: bool, from_quantized: bool) -> None:
        """Load a ckptzip checkpoint with :class:`CompressedStorageReader`, any other as torchtitan does."""
        if from_hf or not CompressedStorageReader.validate_checkpoint_id(checkpoint_id):
            super().dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)
            return
        reader = CompressedStorageReader(checkpoint_id, trusted_objects=self.trusted_objects)
        dcp_load(state_dict, storage_reader=reader)
        if MODEL in self.states:  # the model's entries are flattened into the saved dict
            self.states[MODEL].load_state_dict(state_dict)

    def _find_load_step(self, folder: str = "") -> int:
        """The latest ``step-N`` directory holding a checkpoint this manager loads, or one
        torchtitan finds."""
        folder = folder or self.folder
        steps = [int(super()._find_load_step(folder))]
        for name in _listdir(folder):
            match = _STEP.fullmatch(name)
            if match and self._loads(_join(folder, name)):
                steps.append(int(match.group(1)))
        return max(steps)

    @staticmethod
    def _loads(checkpoint_id: str) -> bool:
        """Whether ``checkpoint_id`` holds a checkpoint of ckptzip's (torchtitan's own it finds itself)."""
        return CompressedStorageReader.validate_checkpoint_id(checkpoint_id) or _isfile(
            _join(checkpoint_id, _TORCH_CHECKPOINTING_MODEL))


def _when_unlocked(backend: Any, done: Future[None]) -> None:
    """Complete ``done`` once ``backend`` (a torch_checkpointing manager) has staged its last save."""
    try:
        with backend.lock():
            done.set_result(None)
    except BaseException as exc:
        done.set_exception(exc)


class CompressedTorchCheckpointingManager(CompressedCheckpointManager):
    """torchtitan's ``CheckpointManager`` saving each step through torch_checkpointing, as
    torchtitan 0.3's ``torch_checkpointing`` checkpointer plans to (whose save and load are not
    written yet, and which imports a module torch_checkpointing 0.1 does not have), with the
    model and optimizer coded by ckptzip
    (:class:`ckptzip.integrations.torch_checkpointing.CompressedCheckpointManager`).

    A step directory holds one ``<item>_<rank>.pt`` per state (``model``, ``optimizer``,
    ``lr_scheduler``, ``dataloader``, ``train_state``, ...) and torch_checkpointing's
    ``metadata.pkl``; the model and optimizer items carry torch_checkpointing's resharder, so a
    step loads on another sharding (torch_checkpointing 0.1's synchronous saver writes
    ``metadata.pkl`` with its first step only: later ``disabled`` steps load on their own sharding). ``async_mode``: ``disabled`` saves with torch_checkpointing's
    synchronous saver; ``async`` and ``async_with_pinned_mem`` with its asynchronous one (the
    items coded in the caller, on the GPU for GPU state, then written by its writer process).
    Steps another manager wrote (ckptzip's DCP, plain DCP, Hugging Face) load as they do there.
    Needs a process group on CUDA devices where there are several ranks (torch_checkpointing
    gathers its metadata there).
    """

    if _BUILT_FROM_CONFIG:

        @dataclass(kw_only=True, slots=True)
        class Config(CompressedCheckpointManager.Config):
            pass

    coded_states: tuple[str, ...] = (MODEL, OPTIMIZER)
    """The states ckptzip codes (the others are saved by torch_checkpointing as it does)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._backends: dict[bool, Any] = {}  # by asynchronous: torch_checkpointing's managers, built on first use

    def _backend(self, asynchronous: bool) -> Any:
        backend = self._backends.get(asynchronous)
        if backend is None:
            from torch_checkpointing import CheckpointManager as Backend
            from torch_checkpointing import ItemSpec
            from torch_checkpointing.default_resharder import DefaultResharder

            from ckptzip.integrations.torch_checkpointing import CompressedCheckpointManager as Compressed

            config = Backend.Config.with_async_save() if asynchronous else Backend.Config.with_sync_save()
            resharder = DefaultResharder()
            config.items = {MODEL: ItemSpec(resharder=resharder, required=False),
                            OPTIMIZER: ItemSpec(resharder=resharder, required=False)}
            config.default = ItemSpec(requires_copy=False)  # the other states' state_dict()s are fresh objects
            backend = self._backends[asynchronous] = Compressed(config, codec=self.codec, coded=self.coded_states)
        return backend

    def _items(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """torchtitan's flattened state (the model's entries at the top, each other state under
        its name) as torch_checkpointing items: the model's entries as one item, each other
        state's ``state_dict()`` as its own."""
        states = {k for k in self.states if k != MODEL}
        items: dict[str, Any] = {MODEL: {k: v for k, v in state_dict.items() if k not in states}}
        for key in states & state_dict.keys():
            value = state_dict[key]
            if value is not None:
                items[key] = value.state_dict() if isinstance(value, Stateful) else value
        return items

    def dcp_save(
        self, state_dict: dict[str, Any], checkpoint_id: str, async_mode: AsyncMode,
        enable_garbage_collection: bool = False, to_hf: bool = False,
    ) -> Any:
        """Save one step through torch_checkpointing (a Hugging Face export as torchtitan does)."""
        if to_hf:
            return CheckpointManager.dcp_save(self, state_dict, checkpoint_id, async_mode, enable_garbage_collection,
                                              to_hf)
        backend = self._backend(async_mode != AsyncMode.DISABLED)
        write = backend.save(checkpoint_id, self._items(state_dict))
        if enable_garbage_collection:
            GarbageCollection.collect("GC collection invoked by checkpointer.")
        # ckptzip's items are snapshots when save returns; torch_checkpointing stages any other
        # item it must copy on a thread, and the state may change once that is done: its lock
        # (its manager.lock(), held while it stages) says when
        if async_mode == AsyncMode.ASYNC_WITH_PINNED_MEM:  # torchtitan waits before the optimizer steps
            staged: Future[None] = Future()
            threading.Thread(target=_when_unlocked, args=(backend, staged), daemon=True).start()
            return AsyncSaveResponse(staging_completion=staged, upload_completion=write)
        if async_mode == AsyncMode.ASYNC:  # torchtitan does not wait: staged before save returns
            with backend.lock():
                pass
        return write

    def dcp_load(self, state_dict: dict[str, Any], checkpoint_id: str, from_hf: bool, from_quantized: bool) -> None:
        """Load a torch_checkpointing step into torchtitan's states (in place), any other as
        :class:`CompressedCheckpointManager` does."""
        if from_hf or not _isfile(_join(checkpoint_id, _TORCH_CHECKPOINTING_MODEL)):
            super().dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)
            return
        targets = self._items(state_dict)
        loaded = self._backend(False).load(checkpoint_id, into=targets)
        for key, value in state_dict.items():
            if key in loaded and isinstance(value, Stateful):
                value.load_state_dict(loaded[key])
        if MODEL in self.states:
            self.states[MODEL].load_state_dict(loaded[MODEL])

    def close(self) -> None:
        try:
            super().close()
        finally:
            for backend in getattr(self, "_backends", {}).values():
                backend.close()
            self._backends = {}
