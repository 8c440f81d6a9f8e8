"""Megatron-Core integration: ``dist_checkpointing`` save and load strategies that store the
sharded tensors through ckptzip's DCP storage (:mod:`ckptzip.dcp`).

    import ckptzip.integrations.megatron                 # registers the "ckptzip" backend
    from megatron.core import dist_checkpointing

    dist_checkpointing.save(sharded_state_dict, "ckpt/iter_0001000", sharded_strategy=("ckptzip", 1))
    state_dict = dist_checkpointing.load(sharded_state_dict, "ckpt/iter_0001000")

Megatron-Core's ``torch_dist`` format runs on PyTorch DCP; this backend is the same format with
ckptzip's :class:`~ckptzip.dcp.CompressedStorageWriter` / :class:`~ckptzip.dcp.CompressedStorageReader`
in place of DCP's file system writer and reader. ``metadata.json`` names the backend
``ckptzip``, so ``dist_checkpointing.load`` picks the load strategy by itself once this module is
imported. Resharding (a different tensor- or data-parallel layout on load) works as with
``torch_dist``. What Megatron-Core saves outside the sharded strategy is unchanged: the common
state (``common.pt``, ``torch.save``) and ``metadata.json``.

Tested with megatron-core 0.16; the strategies reuse ``torch_dist``'s translation of Megatron's
sharded tensors to DCP (module-private helpers of ``megatron.core.dist_checkpointing.strategies.torch``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.checkpoint.metadata import BytesStorageMetadata

from ckptzip.dcp import CompressedStorageReader, CompressedStorageWriter

try:
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedStateDict, ShardedTensor, StateDict
    from megatron.core.dist_checkpointing.strategies.base import (
        SaveShardedStrategy,
        StrategyAction,
        register_default_strategy,
    )
    from megatron.core.dist_checkpointing.strategies.torch import (
        MCoreLoadPlanner,
        MCoreSavePlanner,
        TorchDistLoadShardedStrategy,
        _replace_sharded_keys_with_state_dict_keys,
        _replace_state_dict_keys_with_sharded_keys,
        _restore_dict_types,
        _unwrap_pyt_sharded_tensor,
        mcore_to_pyt_state_dict,
    )
except ImportError as exc:
    raise ImportError(
        "ckptzip.integrations.megatron needs Megatron-Core, which is not installed; "
        "install it with: pip install 'ckptzip[megatron]'"
    ) from exc

__all__ = ["BACKEND", "VERSION", "CkptzipLoadShardedStrategy", "CkptzipSaveShardedStrategy"]

BACKEND = "ckptzip"
VERSION = 1


class CkptzipSaveShardedStrategy(SaveShardedStrategy):
    """Save a Megatron-Core sharded state dict as a ckptzip DCP checkpoint (synchronously).

    Args:
        codec: ckptzip preset or codec id for the tensors (see :func:`ckptzip.save`).
        keep_only_main_replica: save each replicated shard once, from its main replica (as
            ``torch_dist`` does by default).
    """

    def __init__(self, codec: str = "auto", keep_only_main_replica: bool = True) -> None:
        super().__init__(BACKEND, VERSION)
        self.codec = codec
        self.keep_only_main_replica = keep_only_main_replica

    def save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: str | Path) -> None:
        """Each rank writes its own shards (one ``__<rank>.ckzd`` file); rank 0 the metadata, last."""
        sharded_state_dict, _, _ = _replace_state_dict_keys_with_sharded_keys(
            sharded_state_dict, self.keep_only_main_replica
        )
        dcp_save(
            mcore_to_pyt_state_dict(sharded_state_dict, False),
            storage_writer=CompressedStorageWriter(checkpoint_dir, codec=self.codec),
            planner=MCoreSavePlanner(dedup_replicated_tensors=not self.keep_only_main_replica, flatten_state_dict=False),
        )

    def can_handle_sharded_objects(self) -> bool:
        return True


class CkptzipLoadShardedStrategy(TorchDistLoadShardedStrategy):
    """Load a checkpoint :class:`CkptzipSaveShardedStrategy` saved, on any parallel layout.

    Every stored chunk is verified before it reaches the state dict. ``trusted_objects`` is passed
    to :class:`~ckptzip.dcp.CompressedStorageReader`: Megatron's sharded objects are pickled bytes,
    which are first checked against torch's ``weights_only`` unpickler unless it is true.
    """

    def __init__(self, trusted_objects: bool = False) -> None:
        super().__init__()
        self.trusted_objects = trusted_objects

    def _reader(self, checkpoint_dir: str | Path) -> CompressedStorageReader:
        return CompressedStorageReader(checkpoint_dir, trusted_objects=self.trusted_objects)

    def load(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: str | Path) -> StateDict:
        """The state dict that ``sharded_state_dict`` describes, loaded from ``checkpoint_dir``."""
        template = sharded_state_dict
        sharded_tensors = [t for t in nested_values(sharded_state_dict) if isinstance(t, ShardedTensor)]
        sharded_state_dict, flat_mapping, rename_mapping = _replace_state_dict_keys_with_sharded_keys(
            sharded_state_dict
        )
        pyt_state_dict = mcore_to_pyt_state_dict(sharded_state_dict, True)
        reader = self._reader(checkpoint_dir)
        dcp_load(
            pyt_state_dict,
            storage_reader=reader,
            planner=MCoreLoadPlanner(
                shapes_validation_sharded_tensors=[t for t in sharded_tensors if not t.allow_shape_mismatch],
                allow_shape_mismatch_sharded_tensors={t.key: t for t in sharded_tensors if t.allow_shape_mismatch},
            ),
        )
        state_dict: Any = {k: _unwrap_pyt_sharded_tensor(v) for k, v in pyt_state_dict.items()}
        state_dict = _replace_sharded_keys_with_state_dict_keys(state_dict, flat_mapping, rename_mapping)
        _restore_dict_types(state_dict, template)
        return state_dict

    def load_tensors_metadata(self, checkpoint_dir: str | Path, metadata: Any = None) -> ShardedStateDict:
        """The checkpoint's tensors as ``ShardedTensor`` s without data (global shapes and dtypes)."""
        if metadata is None:
            metadata = self._reader(checkpoint_dir).read_metadata()
        return super().load_tensors_metadata(Path(checkpoint_dir), metadata)

    def load_sharded_metadata(self, checkpoint_dir: str | Path) -> ShardedStateDict:
        """The checkpoint's tensors and sharded objects, without data."""
        metadata = self._reader(checkpoint_dir).read_metadata()
        objects = [
            ShardedObject.empty_from_unique_key(key)
            for key, stored in metadata.state_dict_metadata.items()
            if isinstance(stored, BytesStorageMetadata)
        ]
        sharded: ShardedStateDict = {obj.unique_key: obj for obj in objects}
        sharded.update(self.load_tensors_metadata(checkpoint_dir, metadata))
        return sharded

    def remove_sharded_tensors(self, checkpoint_dir: str, key_prefix: str) -> None:
        raise NotImplementedError("removing tensors from a ckptzip checkpoint in place is not supported")


register_default_strategy(StrategyAction.SAVE_SHARDED, BACKEND, VERSION, CkptzipSaveShardedStrategy())
register_default_strategy(StrategyAction.LOAD_SHARDED, BACKEND, VERSION, CkptzipLoadShardedStrategy())
