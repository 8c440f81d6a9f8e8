"""A compressed memory tier for :class:`~ckptzip.manager.CheckpointManager` (docs/MANAGER.md,
"Memory tier"): the newest checkpoints kept as their ``.ckz`` bytes in shared memory that outlives
the training process, persisted to the directory every few saves in the background, and, across
ranks of a process group, copied to a peer's tier.

- :mod:`.store`: :class:`TieredStorage`, the manager's storage with the tier in front.
- :mod:`.peers`: the exchanges of one rank's copies with its neighbours, through the narrow
  :class:`~.peers.RankCopies` the store offers them.
- :mod:`.ring`: ring placement of peer copies and the exchanges over torch.distributed.

Which checkpoints each copy keeps, and their names, are the series' (:mod:`ckptzip.series`).
"""

from .ring import ReplicationError
from .store import DamagedCopyWarning, MemoryTier, TieredStorage

__all__ = ["DamagedCopyWarning", "MemoryTier", "ReplicationError", "TieredStorage"]
