"""The memory ckptzip works in, device and host: how much a call may take, and where its buffers
come from. Every path (a save, a load, a host snapshot, DCP's staging, the manager's coding
process) sizes and allocates through these modules; docs/ARCHITECTURE.md's glossary gives the
words (budget, cap, block, buffer, slab, ring).

GPU memory:

- :mod:`.gpu` — a call's *budget*: what it may use on a GPU beside the state (borrowed from
  torch's cache, or beside training only what the training leaves unused at its peak), capped by
  ``gpu_memory=`` or ``CKPTZIP_GPU_MEMORY_MB``; :class:`~.gpu.Budget`, ``GpuMemoryError``, what
  an allocation failure is. How a budget is divided into a save's batches is
  :class:`ckptzip.engine.GpuLimits` (a batch is a sixth of it, a twelfth where blocks are used;
  engine/plan.py), a load's the engine's reader (a sixth).
- :mod:`.blocks` — a save's large GPU buffers as views of *blocks* of one size, so that torch's
  cache is never split.
- :mod:`.tables` — small host tables (addresses, chunk lists) to a GPU through one pinned ring.

Host memory:

- :mod:`.pinned` — pinned host *buffers*: :class:`~.pinned.PinnedPool` (grown and trimmed by
  registered *slabs*, :class:`~.pinned.Slab`), the process-wide pool of copies between GPUs and
  the host (``CKPTZIP_PINNED_MB``), copy streams, GPU tensors brought to the host through it.
- :mod:`.shared` — shared memory (``/dev/shm``), handed to another process without a copy,
  allocated only where there is room.
- :mod:`.scratch` — per-thread host buffers a CPU load reuses from batch to batch.
- :mod:`.pages` — a CPU load's new outputs faulted in ahead of the writes.
- :mod:`.declared` — the tensor bytes a file declares, checked before a load allocates them
  (``max_bytes``, or what the targets have available).

This package sits on the floor of the codecs (nvCOMP allocates through :mod:`.blocks` and
:mod:`.tables`) and imports nothing above the settings and the errors. Its modules are imported
by name (``from ckptzip.memory import gpu``); the package itself imports none of them.
"""
