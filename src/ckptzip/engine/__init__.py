"""The engine: one batched encoder and decoder for every path (save/load/open, the manager, DCP,
convert, the bench), with a GPU backend (Triton kernels + nvCOMP) and a CPU backend (NumPy +
zstandard on a thread pool).

- :mod:`.policy` — the ``codec=`` argument parsed once into a :class:`~.policy.Policy`.
- :mod:`.encode` / :mod:`.decode` — a batch of tensors ⇄ stored chunks, mirror images; a
  batch's chunks travel as one table (:mod:`.chunks`).
- :mod:`.writer` / :mod:`.reader` — whole states ⇄ a container, batches overlapped with copies
  and file I/O (a save's :mod:`.pipeline` and :mod:`.stager`, a load's :mod:`.upload`);
  :mod:`.staged` — a staged state's two halves (``stage_table``, ``write_staged``), which
  :mod:`ckptzip.staging` sequences.
- :mod:`.ahead` — ordered work-ahead; :mod:`.guard` — reads of a state that overlap training, and
  the optimizer steps that wait for them.
- :mod:`.plan` — which device codes or decodes a tensor, a save's and a load's batches (one
  greedy packer); :mod:`.threads` — how many threads code CPU batches.

The memory it works in (a call's GPU budget, pinned and shared host buffers, GPU blocks) is not
the engine's: :mod:`ckptzip.memory`, a floor below, which the manager, DCP and the integrations use too.

The names below are the engine's public seam, and the only way in for everything outside it
(the API, the manager, the tier, DCP, the integrations, the command line and the benchmark
harness, bench/ckptzip_bench; tests/test_layers.py checks it); every module is the engine's own.
"""

# The codec policy.
from .policy import PRESETS, SMALL_TENSOR_BYTES, Policy
from .warmup import compile_kernels, warm_up

# Whole states: a save, a staged state's two halves, a load.
from .writer import SaveOptions, write_state
from .staged import StagedState, stage_table, staged_table, write_staged
from .reader import LoadOptions, read_tensors
from .sources import DeltaBase, LoadPlan, Table
from .plan import GpuLimits, gpu_coded

# Reads of a state that overlap training (engine/guard.py).
from .guard import Read as OverlappingRead
from .guard import owned as optimizer_owned
from .guard import owned_storages as optimizer_storages
from .guard import stepped as optimizer_stepped
from .guard import wait_for_reads
from .guard import watch as watch_optimizer_steps

# Batches, one at a time (the DCP reader's groups, the harness's engine measurements).
from .ahead import Task, read_ahead, run_ahead
from .decode import Runs, decode_batch
from .encode import EncodedBatch, encode_batch
from .estimate import entropy_of_counts
from .plan import Limit, packed
from .plan import load_batches as plan_read_batches
from .plan import save_batches as plan_write_batches

__all__ = [
    "PRESETS", "SMALL_TENSOR_BYTES", "DeltaBase", "EncodedBatch", "GpuLimits", "Limit", "LoadOptions", "LoadPlan",
    "OverlappingRead", "Policy", "Runs", "SaveOptions", "StagedState", "Table", "Task", "compile_kernels",
    "decode_batch", "encode_batch", "entropy_of_counts", "gpu_coded", "optimizer_owned", "optimizer_stepped",
    "optimizer_storages", "packed", "plan_read_batches", "plan_write_batches", "read_ahead", "read_tensors",
    "run_ahead", "stage_table", "staged_table", "wait_for_reads", "warm_up", "watch_optimizer_steps", "write_staged",
    "write_state",
]
