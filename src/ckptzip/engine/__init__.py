"""The engine: one batched encoder and decoder for every path (save/load/open, the manager, DCP,
convert, the bench), with a GPU backend (Triton kernels + nvCOMP) and a CPU backend (NumPy +
zstandard on a thread pool).

- :mod:`.policy` — the ``codec=`` argument parsed once into a :class:`~.policy.Policy`.
- :mod:`.encode` / :mod:`.decode` — a batch of tensors ⇄ stored chunks, mirror images.
- :mod:`.writer` / :mod:`.reader` — whole states ⇄ a container, batches overlapped with copies
  and file I/O.
- :mod:`.staging` — pinned host buffers and copy streams; :mod:`.ahead` — ordered work-ahead.
- :mod:`.memory` — the GPU memory a call may use (``available_gpu_memory``);
- :mod:`.plan` — which device codes or decodes a tensor, a save's and a load's batches (one
  greedy packer);
  :mod:`.threads` — how many threads code CPU batches.

The names below are the engine's public seam: what the API, the manager, DCP and the benchmark
harness (bench/ckptzip_bench) may use; everything else is the engine's own.
"""

from .decode import Runs, decode_batch
from .encode import EncodedBatch, encode_batch
from .estimate import entropy_of_counts
from .memory import available as available_gpu_memory
from .plan import load_batches as plan_read_batches
from .plan import save_batches as plan_write_batches
from .policy import SMALL_TENSOR_BYTES, Policy
from .reader import read_tensors
from .sources import LoadPlan
from .writer import write_state

__all__ = ["SMALL_TENSOR_BYTES", "EncodedBatch", "LoadPlan", "Policy", "Runs", "available_gpu_memory", "decode_batch",
           "encode_batch", "entropy_of_counts", "plan_read_batches", "plan_write_batches", "read_tensors", "write_state"]
