"""The engine: one batched encoder and decoder for every path (save/load/open, the manager, DCP,
convert, the bench), with a GPU backend (Triton kernels + nvCOMP) and a CPU backend (NumPy +
zstandard on a thread pool).

- :mod:`.policy` — the ``codec=`` argument parsed once into a :class:`~.policy.Policy`.
- :mod:`.encode` / :mod:`.decode` — a batch of tensors ⇄ stored chunks, mirror images.
- :mod:`.writer` / :mod:`.reader` — whole states ⇄ a container, batches overlapped with copies
  and file I/O.
- :mod:`.staging` — pinned host buffers and copy streams; :mod:`.ahead` — ordered work-ahead.
- :mod:`.plan` — which device codes a tensor, and the one greedy packer of batches;
  :mod:`.threads` — how many threads code CPU batches.
"""

from .policy import Policy
from .reader import read_tensors
from .writer import write_state

__all__ = ["Policy", "read_tensors", "write_state"]
