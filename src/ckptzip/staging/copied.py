"""Device staging: a state's tensors copied into buffers of their own device before ``save``
returns (:func:`copy_state`), and coded when the copy is written (:class:`CopiedState`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, BinaryIO

import torch

from ..engine import DeltaBase, SaveOptions, write_state
from ..format import TensorEntry
from .buffers import BufferKey, SnapshotBuffers


@dataclass
class CopiedState:
    """Copies of a state's tensors (a :class:`~ckptzip.staging.Staged`), valid once the events
    ``ready`` have completed; written with ``options`` and the base given then. The buffers they
    lie in are their taker's."""

    names: list[str]
    tensors: list[torch.Tensor]
    ready: list[torch.cuda.Event]
    options: SaveOptions

    def wait(self) -> None:
        for event in self.ready:
            event.synchronize()

    def write(self, f: BinaryIO, tree: Any, base: DeltaBase | None = None) -> list[TensorEntry]:
        self.wait()
        return write_state(f, self.names, self.tensors, tree, dataclasses.replace(self.options, base=base))

    def release(self) -> None:
        self.wait()  # its buffers go back to their pool with the snapshot: nothing may still copy into them


def copy_state(buffers: SnapshotBuffers, names: list[str], sources: list[torch.Tensor], options: SaveOptions
               ) -> tuple[CopiedState, list[tuple[BufferKey, torch.Tensor]]]:
    """Copy every tensor of ``sources`` into a pooled buffer of its device (CUDA tensors on a side
    stream, which the caller's streams wait for); the copies, and the buffers they lie in."""
    copies, taken = buffers.views(sources, {i: (t.device, False) for i, t in enumerate(sources)})
    ready = buffers.copied_now(sources, copies, list(range(len(sources))))
    return CopiedState(names, copies, ready, options), taken
