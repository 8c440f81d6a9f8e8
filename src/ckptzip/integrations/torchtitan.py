"""torchtitan integration: a checkpoint manager that saves and loads torchtitan's DCP checkpoints
through ckptzip's DCP storage (:mod:`ckptzip.dcp`), chosen from the job config::

    from ckptzip.integrations.torchtitan import CompressedCheckpointManager

    config = llama3_debugmodel()                     # any torchtitan Trainer.Config
    config.checkpoint = CompressedCheckpointManager.Config(enable=True, interval=500,
                                                           async_mode="async", codec="auto")

torchtitan builds ``config.checkpoint.build(...)``, so the trainer then runs this manager. Every
``async_mode`` works (``disabled``, ``async``, ``async_with_pinned_mem``); step directories hold
ckptzip checkpoints (``.metadata.ckz`` and ``__<rank>.ckzd``). Loading reads ckptzip checkpoints
with :class:`~ckptzip.dcp.CompressedStorageReader` and anything else (a plain DCP seed or
``initial_load_path`` checkpoint, Hugging Face safetensors) as torchtitan does.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType, async_save, save

from ckptzip.dcp import CompressedStorageReader, CompressedStorageWriter

try:
    from torchtitan.components.checkpoint import MODEL, AsyncMode, CheckpointManager
    from torchtitan.tools import filesystem
    from torchtitan.tools.utils import GarbageCollection
except ImportError as exc:
    raise ImportError(
        "ckptzip.integrations.torchtitan needs torchtitan, which is not installed; "
        "install it with: pip install 'ckptzip[torchtitan]'"
    ) from exc

__all__ = ["CompressedCheckpointManager"]

_STEP = re.compile(r"step-(\d+)")


class CompressedCheckpointManager(CheckpointManager):
    """torchtitan's ``CheckpointManager`` with its DCP checkpoints stored by ckptzip.

    Retention (``keep_latest_k``), intervals, the last-step model-only export and the async
    modes behave as in torchtitan; only the storage of each step differs.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        codec: str = "auto"
        """ckptzip preset (auto, fast, portable) or codec id for the tensors."""

        trusted_objects: bool = False
        """Load non-tensor values torch's weights_only unpickler refuses (trusted runs only)."""

    def __init__(self, config: Config, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        self.codec = config.codec
        self.trusted_objects = config.trusted_objects

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
            result = async_save(
                state_dict, storage_writer=writer, process_group=self.pg,
                async_checkpointer_type=AsyncCheckpointerType.PROCESS, async_stager=self.stager,
            )
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
        """The latest ``step-N`` directory holding a ckptzip checkpoint, or one torchtitan finds."""
        folder = folder or self.folder
        steps = [int(super()._find_load_step(folder))]
        if filesystem.isdir(folder):
            for name in filesystem.listdir(folder):
                match = _STEP.search(name)
                if match and CompressedStorageReader.validate_checkpoint_id(filesystem.join(folder, name)):
                    steps.append(int(match.group(1)))
        return max(steps)
