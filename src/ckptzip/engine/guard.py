"""Reads of a state that overlap training, and the writers that wait for them.

A save that reads the state after it returns (while the next forward and backward run) is only
correct if nothing writes the state before the read ends. Torch optimizers' ``step`` is the one
writer of a training state that ckptzip can see: a process-wide step pre-hook (:func:`watch`,
installed by the first caller) records each optimizer that steps and, before it steps, waits
for every read still in flight. So a save may leave to a background read only the tensors that
optimizers it has seen step own (their parameters and their state: :func:`owned_storages`); it
reads every other tensor before it returns (buffers that a forward updates in place, gradients
that backward accumulates into, an EMA copy). ``CheckpointManager.guard()`` waits the same way,
for writers the hook cannot see (:func:`wait_for_reads`).

A writer waits at most :data:`WAIT_SECONDS` for a read: one that takes longer is abandoned (its
checkpoint is not written, the save reports why) and training goes on, so a stuck read never
stops the job around it.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

WAIT_SECONDS = 600.0

_LOCK = threading.Lock()
_READS: set[Read] = set()
_SEEN: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
_STEPPED = threading.Event()  # an optimizer has stepped since the hook was installed
_HOOK: list[Any] = []  # the hook's handle, once installed


class Read:
    """One save's read of a state, in flight from :meth:`start` until :meth:`finish`; writers
    wait for it (:func:`wait_for_reads`)."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self.abandoned = False  # a writer stopped waiting: the read's bytes may be torn

    def start(self) -> Read:
        with _LOCK:
            _READS.add(self)
        return self

    def finish(self) -> None:
        """The read is over (done or failed): writers may go on."""
        with _LOCK:
            _READS.discard(self)
        self._done.set()

    def wait(self) -> None:
        """Until the read is over, or :data:`WAIT_SECONDS`; then it is abandoned."""
        if not self._done.wait(WAIT_SECONDS):
            self.abandoned = True
            self.finish()

    @property
    def done(self) -> bool:
        return self._done.is_set()


def wait_for_reads() -> None:
    """Until every read in flight is over (a writer of a state calls this before it writes)."""
    with _LOCK:
        reads = list(_READS)
    for read in reads:
        read.wait()


def _before_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    _SEEN.add(optimizer)
    _STEPPED.set()
    wait_for_reads()


def watch() -> None:
    """Install the process-wide optimizer step pre-hook (once)."""
    with _LOCK:
        if not _HOOK:
            _HOOK.append(register_optimizer_step_pre_hook(_before_step))


def stepped() -> bool:
    """Whether an optimizer has stepped since :func:`watch` (a training step ran)."""
    return _STEPPED.is_set()


def _storage(tensor: torch.Tensor) -> int:
    local = getattr(tensor, "_local_tensor", None)  # a DTensor: its shard
    t = local if isinstance(local, torch.Tensor) else tensor
    return t.untyped_storage().data_ptr()


def owned_storages() -> set[int]:
    """The storages of every tensor the optimizers seen stepping own: their parameters and the
    tensors of their state (moments, step counters)."""
    owned: set[int] = set()
    for optimizer in list(_SEEN):
        for group in optimizer.param_groups:
            owned.update(_storage(p) for p in group["params"] if isinstance(p, torch.Tensor))
        for state in optimizer.state.values():
            owned.update(_storage(v) for v in state.values() if isinstance(v, torch.Tensor))
    return owned


def owned(tensor: torch.Tensor, storages: set[int]) -> bool:
    """Whether ``tensor`` lies in one of ``storages`` (:func:`owned_storages`)."""
    return _storage(tensor) in storages
