"""How a snapshot is staged: a state turned, before ``save`` returns, into a value the caller's later
changes to the state cannot reach, written to a file later, on another thread or in another
process. DCP's ``AsyncStager`` is the model: stage a state, then wait for it, write it, hand it
to another process, release it (:class:`Staged`).

The strategies, and who takes them:

- **device copy** (:mod:`.copied`): every tensor copied into a reused buffer of its device, coded
  when written. The manager's device snapshots; a manager's snapshot of a state with no CUDA tensor.
- **host, coded on the GPU** (:mod:`.host`): the CUDA tensors coded on their GPUs now, their stored
  bytes staged in pinned host memory; the host tensors coded when written.

  - the manager's host snapshot (:class:`.host.HostSnapshots`): a share of the CUDA tensors
    (:data:`.plan.HOST_RAW_SHARE`, or :data:`.plan.OVERLAP_RAW_SHARE`) copied raw over the link
    (:class:`.copies.Trickle`) while the GPU codes the rest, and coded on the host when written
    (in the manager's coding process where it has one);
  - the same, deferred: its read of the state on a thread of its own while training goes on
    (:mod:`.reading`), the optimizer's next step waiting for it;
  - a stager's (:func:`.host.stage_coded`: DCP's ``async_save``, torch_checkpointing's items):
    every tensor the GPUs do not code copied to the host before it returns.

A snapshot's plan (:mod:`.plan`: the GPU limits its coding works within, which tensors the GPUs
code, the raw share, which tensors go into which buffers) is made once, when the save is taken,
and handed to its staging; the buffers are pooled from save to save (:mod:`.buffers`). Which
strategy a manager's save takes is the manager's choice (``ckptzip.manager._snapshot``); the
memory tier stores the files a staging writes and stages nothing itself.
"""

from __future__ import annotations

from typing import Any, BinaryIO, Protocol

from ..engine import DeltaBase
from ..format import TensorEntry
from .buffers import SnapshotBuffers
from .copied import CopiedState, copy_state
from .host import HostSnapshots, HostStaged, Taken, stage_coded
from .plan import HOST_RAW_SHARE, OVERLAP_RAW_SHARE, HostPlan, Overlap, raw_share
from .reading import Reading


class Staged(Protocol):
    """A staged state."""

    def wait(self) -> None:
        """Until every copy of the state it makes has run and its bytes are where its write reads
        them: nothing reads the state after this."""

    def write(self, f: BinaryIO, tree: Any, base: DeltaBase | None = None) -> list[TensorEntry]:
        """Write it to ``f`` as a container whose tree is ``tree``; the tensor table. ``base``:
        what tensors not coded yet may be stored as XOR deltas against (a staging coded on the
        GPU rewrote its table against its base when it was staged). Waits for each byte it
        writes, as it writes it."""

    def release(self) -> None:
        """Give back the buffers it holds of a pool (a write gives back what it wrote)."""


__all__ = [
    "HOST_RAW_SHARE", "OVERLAP_RAW_SHARE", "CopiedState", "HostPlan", "HostSnapshots", "HostStaged", "Overlap",
    "Reading", "SnapshotBuffers", "Staged", "Taken", "copy_state", "raw_share", "stage_coded",
]
