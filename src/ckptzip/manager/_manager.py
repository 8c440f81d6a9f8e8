"""CheckpointManager: periodic, asynchronous, atomic checkpoints with retention.

``save`` copies the state into a snapshot (on the GPU for CUDA tensors, :mod:`._snapshot`) and
returns; compression, device-to-host copies and writes run on one background thread, in step
order. A checkpoint is visible only once committed (atomic rename locally, commit marker on
object stores), so a crash at any moment leaves the previous checkpoints loadable.
docs/MANAGER.md describes the layout and the memory bound.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import operator
import os
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch

from .. import api
from ..errors import CheckpointNotFoundError, CorruptCheckpointError, MissingBaseError
from ..engine import DeltaBase, Policy, SaveOptions, wait_for_reads, warm_up, write_state
from ..format import BaseRef, content_hash
from ..memory import gpu
from ..series import STEP_LIKE, STEP_PATTERN, Files, Series, name_of, report_ignored, step_of
from ..storage import WriterLock, open_storage
from ..tier import MemoryTier, TieredStorage
from ..tier.store import Tier
from ..tree import flatten
from ._snapshot import Snapshot, SnapshotMode, SnapshotPool, TakenMode, Write, Written

# Longest chain ``incremental=`` allows: restoring its last step reads (and decodes) every file of it.
MAX_INCREMENTAL = 1000


class CheckpointSkippedWarning(UserWarning):
    """``restore()`` skipped a damaged checkpoint and fell back to an older one."""


@dataclass(frozen=True)
class _Below:
    """A checkpoint below one being restored: its bases, its content hash, and the first
    (checkpoint step, reference) that led to it."""

    refs: list[BaseRef]
    content_hash: str
    via: tuple[int, BaseRef]


@dataclass
class _Kept:
    """The last committed state of an incremental manager: the base of its next save."""

    ref: BaseRef
    tensors: dict[str, torch.Tensor]  # copies, by name
    chain: int  # checkpoints in its chain, the whole one included


def _copy_into(old: torch.Tensor | None, t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t``, into ``old`` (a base no longer needed) where it fits: no fresh memory to fault in."""
    if old is not None and old.dtype == t.dtype and old.shape == t.shape and old.device == t.device:
        return old.copy_(t)
    return t.clone()


class CheckpointManager:
    """Periodic checkpoints of a training run in a directory or an fsspec URL (``s3://bucket/run``).

    Args:
        directory: local path, ``file://`` URL or any fsspec URL.
        keep_last: how many committed checkpoints to keep (``None``: all). Older ones are deleted
            only after a newer one is committed.
        async_save: save in the background (``save`` returns after the snapshot); ``False`` saves
            in the caller.
        codec: codec preset or id for :func:`ckptzip.save`.
        max_pending: most saves in flight; ``save`` waits for the oldest beyond that. Snapshots
            hold ``max_pending`` x (state size) of memory, on the GPU for CUDA tensors.
        snapshot: ``"device"`` copies CUDA tensors within GPU memory (shortest stall; holds the
            state's size on the GPU until the checkpoint is written); ``"host"`` compresses them on
            the GPU in small batches and keeps only the compressed bytes, in pinned host memory;
            ``"auto"`` (default) picks ``"device"`` where the copy and its coding fit in what the
            training leaves unused at its peak (torch's peak of reserved memory, less a margin:
            never what torch caches between two steps, which is the training's working set), once
            an optimizer step has shown that peak; else ``"host"``, logging a warning the first time
            (``last_snapshot``, ``last_snapshot_reason`` say what it chose and why). In any mode, a
            snapshot that would take more host memory than the host can give is not taken: that
            checkpoint is written before ``save`` returns (``last_snapshot`` ``"direct"``).
            docs/MANAGER.md, "GPU memory" and "Host memory".
        overlap: a host snapshot reads the tensors that torch optimizers own (parameters, their
            state) while the next forward and backward run: ``save`` returns at once and the
            optimizer's next ``step`` waits until the read is over (a process-wide step pre-hook).
            Every other tensor is copied before ``save`` returns. Writers of optimizer-owned
            tensors other than ``step`` (``p.data`` updates, say) must run inside :meth:`guard`;
            ``overlap=False`` reads everything before ``save`` returns.
        host_coding: where a host snapshot's tensors that are not coded on the GPU are coded:
            ``"process"``, in a process of its own at a lower priority (started by the first such
            save or :meth:`prepare`, fed through shared memory; the training's interpreter lock is
            not taken), and then a read that overlaps training copies every tensor raw instead of
            coding it on the GPU; ``"thread"``: in this process. docs/MANAGER.md.
        storage_options: passed to the fsspec filesystem (credentials, ``endpoint_url``, ...).
        incremental: ``None`` (every checkpoint whole) or K in [1, 1000]: a save may store each tensor as
            an XOR delta against the same tensor of the previous save, where that is estimated to
            be smaller; a chain of deltas holds at most K checkpoints, the first one whole. Costs
            one copy of the state kept as the next base (on its device; in host memory for the
            CUDA tensors of a ``"host"`` snapshot). docs/MANAGER.md.
        gpu_memory: cap, in bytes, on the GPU memory a save's encoding uses beside the state
            (as for :func:`ckptzip.save`; default ``CKPTZIP_GPU_MEMORY_MB``, else what is free).
        memory_tier: a :class:`~ckptzip.tier.MemoryTier`: saves commit to shared memory (kept
            across a crash of this process), every ``persist_every``-th one is copied to the
            directory in the background, ``restore`` reads the fastest valid copy
            (``restored_from`` says which), and with ``replicate`` copies go to a peer rank.
            ``keep_last`` then counts the directory's checkpoints. docs/MANAGER.md, "Memory tier".

    A manager starts compiling ckptzip's GPU kernels on a background thread when it is made
    (:func:`ckptzip.warmup`), so the first save of a fresh node does not wait for them.

    One manager writes to a directory at a time: the first ``save`` takes the directory's writer
    lock (held until ``close``), and a ``save`` of a second manager while it is held raises
    :class:`~ckptzip.errors.CheckpointWriteError` naming the owner. Managers that only read
    (``all_steps``, ``restore``) take no lock, so any number may read. Methods are meant to be
    called from one thread. Errors of a background save are raised by the next ``save``, ``wait``
    or ``close``.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        keep_last: int | None = 3,
        async_save: bool = True,
        codec: str = "auto",
        max_pending: int = 1,
        snapshot: SnapshotMode = "auto",
        storage_options: dict[str, Any] | None = None,
        incremental: int | None = None,
        gpu_memory: int | None = None,
        memory_tier: MemoryTier | None = None,
        overlap: bool = True,
        host_coding: Literal["process", "thread"] = "process",
    ) -> None:
        if incremental is not None and (type(incremental) is not int or not 1 <= incremental <= MAX_INCREMENTAL):
            raise ValueError(f"incremental must be None (every checkpoint whole) or an int in [1, {MAX_INCREMENTAL}] "
                             f"(restoring a step reads up to that many files), got {incremental!r}")
        if keep_last is not None and keep_last < 1:
            raise ValueError(f"keep_last must be None (keep all) or >= 1, got {keep_last}")
        if max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {max_pending}")
        if snapshot not in ("auto", "device", "host"):
            raise ValueError(f"snapshot must be 'auto', 'device' or 'host', got {snapshot!r}")
        if type(overlap) is not bool:
            raise ValueError(f"overlap must be True or False, got {overlap!r}")
        if host_coding not in ("process", "thread"):
            raise ValueError(f"host_coding must be 'process' or 'thread', got {host_coding!r}")
        self._policy = Policy.parse(codec)
        self._gpu_memory = gpu_memory
        gpu.cap(gpu_memory)  # a bad value fails here, not at the first save
        self._storage = open_storage(directory, storage_options)
        self._tier = None if memory_tier is None else TieredStorage(memory_tier, self._storage, keep_last)
        self._agreed: int | None = None  # the step the replicated group last agreed on
        if self._tier is not None:
            self._storage = self._tier
        self._series = Series(self._storage)
        self._keep_last = keep_last
        self._incremental = incremental
        self._kept: _Kept | None = None  # the worker's (or, saving synchronously, the caller's)
        self._max_pending = max_pending
        self._lock: WriterLock | None = None  # taken by the first save
        self._leftovers: list[str] = []  # found when the lock was taken; discarded after the first commit
        self._newest_committed = max(map(step_of, self._committed_steps()), default=None)
        self._pending: collections.deque[tuple[int, concurrent.futures.Future[None]]] = collections.deque()
        self._snapshots = SnapshotPool(snapshot, self._policy, gpu_memory, overlap and async_save,
                                       host_coding == "process" and async_save)
        warm_up(policy=self._policy)  # compile the GPU kernels before the first save needs them
        self._executor = (
            concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckptzip-save")
            if async_save
            else None
        )
        self._closed = False
        self._restored = False

    @property
    def last_snapshot(self) -> TakenMode | None:
        """The kind of snapshot the latest asynchronous ``save`` took (what ``"auto"`` chose), or
        ``"direct"``: none, the host's memory being short, and the checkpoint written before it returned."""
        return self._snapshots.last_mode

    @property
    def last_snapshot_reason(self) -> str | None:
        """Why the latest asynchronous ``save`` took the snapshot it took (the memory numbers when
        ``"auto"`` chose a host snapshot; a warning is logged on ``ckptzip`` when it starts to)."""
        return self._snapshots.last_reason

    @property
    def last_snapshot_overlapped(self) -> bool:
        """Whether the latest asynchronous ``save`` left its read of the state to run while
        training goes on (the optimizer's next step waited for it)."""
        return self._snapshots.last_overlapped

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        """Wrap code that changes the checkpointed state other than a torch optimizer's ``step``
        (which waits by itself): it runs once every read of a state in flight is over.

            with manager.guard():
                ema.update(model)  # writes tensors a save may still be reading
        """
        wait_for_reads()
        yield

    @property
    def restored_from(self) -> Tier | None:
        """Where the latest ``restore`` read its checkpoint: ``"memory"`` (this rank's memory
        tier), ``"peer"`` (a copy fetched from the peer's tier), ``"directory"``; ``None`` before."""
        return self._tier.last_tier if self._tier is not None else ("directory" if self._restored else None)

    @property
    def directory(self) -> str:
        """Where the checkpoints live, as given."""
        return self._storage.location

    def __repr__(self) -> str:
        return f"CheckpointManager({self.directory!r}, keep_last={self._keep_last}, pending={len(self._pending)})"

    # ------------------------------------------------------------------------------ saving

    def _newest_step(self) -> int | None:
        steps = [step for step, _ in self._pending]
        if self._newest_committed is not None:
            steps.append(self._newest_committed)
        return max(steps, default=None)

    def prepare(self, state: Any) -> None:
        """Get ready to save ``state`` (or states of its shapes) without a first-save stall: where
        snapshots are host snapshots (``snapshot="host"``, or ``"auto"`` when the GPU has no room
        for a device copy now), the pinned host memory they are staged into is reserved on a
        background thread now, rather than in the first ``save``; the GPU kernels are already
        being compiled since the manager was made. Call it once the model and optimizer exist."""
        self._snapshots.reserve_host([item.tensor for item in flatten(state).tensors])

    def should_save(self, step: int, *, every: int) -> bool:
        """Whether ``step`` is a multiple of ``every`` and newer than every saved or pending step."""
        if every < 1:
            raise ValueError(f"every must be >= 1, got {every}")
        newest = self._newest_step()
        return step % every == 0 and (newest is None or step > newest)

    def save(self, step: int, state: Any) -> concurrent.futures.Future[None]:
        """Checkpoint ``state`` as ``step``; returns once the caller may change ``state`` again.

        ``state`` is what :func:`ckptzip.save` accepts (add :func:`capture_rng_state` to resume
        random streams). The returned future is done when the checkpoint is committed and old
        ones are retired. Raises first any error of an earlier background save.
        """
        if self._closed:
            raise ValueError(f"{self!r} is closed; create a new CheckpointManager to save")
        self._reap()
        step = operator.index(step)
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        if self._lock is None:
            self._take_lock()
        self._drop_orphans(step)
        newest = self._newest_step()
        if newest is not None and step <= newest:
            raise ValueError(
                f"cannot save step {step} to {self.directory}: steps must increase, and step {newest} is "
                "already saved or being saved there. Save a larger step, or use a new directory for a "
                "separate run"
            )
        if self._executor is None:
            return self._write_now(step, state, keep_base=True)
        while len(self._pending) >= self._max_pending:
            concurrent.futures.wait([self._pending[0][1]])
            self._reap()
        # a host snapshot is encoded now, against the base of the latest save (none while one is pending)
        snapshot = self._snapshots.take(state, None if self._pending else self._delta_base(),
                                        self._incremental is not None)
        if snapshot is None:  # the host's memory is short for one: written now, after the saves in flight
            self.wait()
            return self._write_now(step, state, keep_base=False)
        future = self._executor.submit(self._save_snapshot, step, snapshot)
        self._pending.append((step, future))
        return future

    def _write_now(self, step: int, state: Any, *, keep_base: bool) -> concurrent.futures.Future[None]:
        """Write ``state`` as ``step`` in the caller's thread (no save in flight), in the bounded
        memory of a synchronous save; a done future. ``keep_base``: an incremental manager keeps a
        copy of the state as the next save's base (else the next save is whole: a copy takes the
        memory that was short)."""
        flat = flatten(state)
        names, tensors = [item.name for item in flat.tensors], [item.tensor for item in flat.tensors]
        self._write(step, lambda f, base: Written(write_state(f, names, tensors, flat.tree,
                                                              SaveOptions(self._policy, base, self._gpu_memory)),
                                                  dict(zip(names, tensors)) if keep_base else None))
        self._after_commit(step)
        future: concurrent.futures.Future[None] = concurrent.futures.Future()
        future.set_result(None)
        return future

    def _drop_orphans(self, step: int) -> None:
        """With a replicated memory tier: once the group agreed on a step (``latest_step`` or
        ``restore``), this rank's newer checkpoints are complete on this rank alone, so no restore
        of the group can use them; the first save after the agreed step replaces them."""
        agreed, self._agreed = self._agreed, None
        if agreed is None or self._pending or step <= agreed:
            return
        for old in sorted((s for s in self.all_steps() if s > agreed), reverse=True):  # a delta before its base
            self._series.delete(old)
        self._newest_committed = max((s for s in self.all_steps() if s <= agreed), default=None)

    def _take_lock(self) -> None:
        """Become the directory's writer; then look again at what earlier writers left."""
        self._lock = self._storage.lock()
        listing = self._storage.list(STEP_PATTERN)
        self._leftovers = listing.partial
        self._newest_committed = max(map(step_of, listing.committed), default=None)

    def _save_snapshot(self, step: int, snapshot: Snapshot) -> None:
        with self._snapshots.use(snapshot) as write:
            self._write(step, write)
        self._after_commit(step)

    def _write(self, step: int, write: Write) -> None:
        assert self._lock is not None
        self._lock.heartbeat()  # raises if the lock was lost, before anything is written
        kept = self._kept
        base = self._delta_base()
        written: list[Written] = []
        self._series.write(step, lambda f: written.append(write(f, base)))
        entries, tensors = written[0].entries, written[0].tensors
        delta = kept is not None and base is not None and any(e.source_kind == "xor" for e in entries)
        self._series.record(step, kept.ref.step if delta and kept is not None else None)
        if self._incremental is not None:
            old = kept.tensors if kept is not None else {}
            self._kept = None if tensors is None else _Kept(
                BaseRef(step, name_of(step), content_hash(entries)), {k: _copy_into(old.get(k), t) for k, t in tensors.items()},
                kept.chain + 1 if delta and kept is not None else 1)

    def _delta_base(self) -> DeltaBase | None:
        """What the next save may store deltas against: the last save, unless its chain is full."""
        kept = self._kept
        if kept is None or self._incremental is None or kept.chain >= self._incremental:
            return None
        return DeltaBase(kept.ref, kept.tensors)

    def _after_commit(self, step: int) -> None:
        """Record the commit, retire old checkpoints, discard leftovers found at start."""
        self._newest_committed = step
        if self._keep_last is not None and self._tier is None:  # a tier retires its own copies
            self._series.retire(self._keep_last)
        for name in self._leftovers:
            self._storage.discard_partial(name)
        self._leftovers = []

    def _reap(self) -> None:
        """Forget finished saves, oldest first; raise the first failure (later ones stay queued)."""
        while self._pending and self._pending[0][1].done():
            _, future = self._pending.popleft()
            error = future.exception()
            if error is not None:
                raise error

    def wait(self, *, persisted: bool = False) -> None:
        """Block until every pending save is committed; raise the first unreported failure. With
        ``persisted`` (and a memory tier), also until the background copies to the directory end."""
        concurrent.futures.wait([future for _, future in self._pending])
        self._reap()
        if persisted and self._tier is not None:
            self._tier.wait_persisted()

    def close(self) -> None:
        """Finish pending saves and free snapshot buffers; raise the first unreported failure.

        If several saves failed, each further ``close()`` raises the next one.
        """
        if self._executor is not None:
            self._executor.shutdown(wait=True)
        self._snapshots.clear()
        self._closed = True
        try:
            if self._tier is not None and self._lock is not None:
                self._tier.close()  # the newest memory checkpoint to the directory
        finally:
            if self._lock is not None:
                self._lock.release()
        self._reap()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ----------------------------------------------------------------------------- reading

    def all_steps(self) -> list[int]:
        """Steps of the committed checkpoints, ascending (pending saves are not included)."""
        return self._series.steps()

    def _committed_steps(self) -> list[str]:
        """Committed checkpoint names, at construction: files named like checkpoints in another
        form are reported here, once."""
        committed = self._storage.list(STEP_LIKE).committed
        ignored = [n for n in committed if not STEP_PATTERN.fullmatch(n)]
        if ignored:
            report_ignored(ignored, self.directory)
        return [n for n in committed if STEP_PATTERN.fullmatch(n)]

    def latest_step(self) -> int | None:
        """The newest committed step, or ``None`` if there is none. With a replicated memory
        tier, a collective: the newest step every rank of the group can restore."""
        if self._tier is not None and self._tier.peers is not None:
            self._agreed = self._tier.peers.latest()
            return self._agreed
        steps = self.all_steps()
        return steps[-1] if steps else None

    def _load(self, step: int, map_location: api.MapLocation) -> Any:
        if self._tier is not None:  # from the fastest tier, again from the directory if that copy is damaged
            return self._tier.read(name_of(step), lambda files: self._decode(files, step, map_location))
        state = self._decode(self._storage, step, map_location)
        self._restored = True
        return state

    def _decode(self, files: Files, step: int, map_location: api.MapLocation) -> Any:
        with files.open(name_of(step)) as f, api.open(f, map_location=map_location) as reader:
            return reader.load(base_tensors=self._base_tensors(files, step, reader.bases, map_location))

    def _base_tensors(self, files: Files, step: int, bases: list[BaseRef], map_location: api.MapLocation
                      ) -> list[dict[str, torch.Tensor]] | None:
        """The tensors of each base of checkpoint ``step``, the chains below rebuilt bottom up, one
        file open at a time: iteratively, so a chain of any length restores, holding the tensors
        of only the checkpoints that one still to be rebuilt needs."""
        if not bases:
            return None
        below = self._walk(files, step, bases, map_location)
        users = collections.Counter(ref.step for refs in [bases, *(b.refs for b in below.values())] for ref in refs)
        done: dict[int | None, dict[str, torch.Tensor]] = {}
        for base in sorted(below):  # every base has an earlier step: built after its own bases
            child, ref = below[base].via
            with self._base_reader(files, child, ref, map_location) as reader:
                if reader.bases != below[base].refs:
                    raise MissingBaseError(f"{self._what(child, ref)}, which was replaced while it was read")
                done[base] = reader.named_tensors(base_tensors=[done[r.step] for r in reader.bases] or None)
            for r in below[base].refs:
                users[r.step] -= 1
                if not users[r.step]:
                    del done[r.step]  # no checkpoint still to be rebuilt needs it
        return [done[ref.step] for ref in bases]

    def _walk(self, files: Files, step: int, bases: list[BaseRef], map_location: api.MapLocation
              ) -> dict[int, _Below]:
        """Every checkpoint the bases of ``step`` lead to, by step: its own bases, and the first
        reference to it that was followed (whose step names it in errors). Reads indexes only."""
        below: dict[int, _Below] = {}
        todo = [(step, ref) for ref in bases]
        while todo:
            child, ref = todo.pop()
            if ref.step is None or ref.step >= child or ref.name != name_of(ref.step):
                raise MissingBaseError(f"{self._what(child, ref)}, which is not an earlier checkpoint of this directory")
            if ref.step in below and below[ref.step].content_hash == ref.content_hash:
                continue
            with self._base_reader(files, child, ref, map_location) as reader:
                below[ref.step] = _Below(reader.bases, reader.content_hash, (child, ref))
            todo.extend((ref.step, r) for r in reader.bases)
        return below

    def _what(self, step: int, ref: BaseRef) -> str:
        return f"checkpoint step {step} in {self.directory} is stored as XOR deltas against {ref.describe()}"

    @contextlib.contextmanager
    def _base_reader(self, files: Files, step: int, ref: BaseRef, map_location: api.MapLocation
                     ) -> Iterator[api.CheckpointReader]:
        """A reader of base ``ref`` of checkpoint ``step``, checked against the content hash the
        reference records; a missing or damaged base, here or while the body reads it, is a
        :class:`~ckptzip.errors.MissingBaseError` naming both."""
        what = self._what(step, ref)
        try:
            with files.open(ref.name) as f, api.open(f, map_location=map_location) as reader:
                if reader.content_hash != ref.content_hash:
                    raise MissingBaseError(
                        f"{what}, but {ref.name} holds other tensors now (content hash {reader.content_hash}); "
                        "the base was replaced"
                    )
                yield reader
        except FileNotFoundError as exc:
            raise MissingBaseError(f"{what}, which is missing") from exc
        except CorruptCheckpointError as exc:
            raise MissingBaseError(f"{what}, which is damaged: {exc}") from exc

    def restore(self, step: int | None = None, *, map_location: api.MapLocation = None) -> Any:
        """Load checkpoint ``step``, or the newest valid one when ``step`` is ``None``.

        With ``step=None``, damaged checkpoints are skipped with a :class:`CheckpointSkippedWarning`
        each. Raises :class:`~ckptzip.errors.CheckpointNotFoundError` if no (valid) checkpoint exists.
        Pending saves are not waited for; call :meth:`wait` first to restore them. With a
        replicated memory tier, a collective: every rank restores the same step, the newest (or
        ``step``) that every rank can, fetching its files from its peer where it lacks them.
        """
        if self._tier is not None and self._tier.peers is not None:
            restored: list[int] = []

            def load(s: int) -> Any:
                restored.append(s)
                return self._load(s, map_location)

            state = self._tier.peers.restore(None if step is None else operator.index(step), load)
            self._agreed = restored[-1] if restored else self._agreed
            return state
        if step is not None:
            try:
                return self._load(operator.index(step), map_location)
            except FileNotFoundError as exc:
                raise CheckpointNotFoundError(
                    f"no committed checkpoint of step {step} in {self.directory}; committed steps: "
                    f"{self.all_steps()}"
                ) from exc
        skipped: list[int] = []
        while candidates := [s for s in self.all_steps() if s not in skipped]:
            newest = candidates[-1]
            try:
                return self._load(newest, map_location)
            except (CorruptCheckpointError, FileNotFoundError, MissingBaseError) as exc:
                if newest not in self.all_steps():
                    continue  # retired by the writer (it or, before it, its base) after we listed it
                warnings.warn(
                    f"skipping damaged checkpoint of step {newest} in {self.directory}: {exc}",
                    CheckpointSkippedWarning,
                    stacklevel=2,
                )
                skipped.append(newest)
        if skipped:
            raise CheckpointNotFoundError(
                f"no valid checkpoint in {self.directory}: all committed ones (steps {sorted(skipped)}) are "
                "damaged, see the warnings"
            )
        raise CheckpointNotFoundError(f"no committed checkpoint in {self.directory}; nothing to restore")
