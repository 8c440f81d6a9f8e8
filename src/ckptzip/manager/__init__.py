"""The checkpoint manager (:mod:`._manager`): when and how many checkpoints; its snapshots
(:mod:`._snapshot`) and RNG states (:mod:`._rng`). Its checkpoints' names, bases and retention
are the series' (:mod:`ckptzip.series`)."""

from ..series import IgnoredFileWarning
from ..tier import MemoryTier
from ._manager import MAX_INCREMENTAL, CheckpointManager, CheckpointSkippedWarning
from ._rng import capture_rng_state, restore_rng_state

__all__ = ["MAX_INCREMENTAL", "CheckpointManager", "CheckpointSkippedWarning", "IgnoredFileWarning", "MemoryTier", "capture_rng_state",
           "restore_rng_state"]
