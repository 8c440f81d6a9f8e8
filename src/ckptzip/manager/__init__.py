"""The checkpoint manager (:mod:`._manager`): when and how many checkpoints; its snapshots
(:mod:`._snapshot`), step names (:mod:`._steps`) and RNG states (:mod:`._rng`)."""

from ..tier import MemoryTier
from ._manager import MAX_INCREMENTAL, CheckpointManager, CheckpointSkippedWarning
from ._rng import capture_rng_state, restore_rng_state
from ._steps import IgnoredFileWarning

__all__ = ["MAX_INCREMENTAL", "CheckpointManager", "CheckpointSkippedWarning", "IgnoredFileWarning", "MemoryTier", "capture_rng_state",
           "restore_rng_state"]
