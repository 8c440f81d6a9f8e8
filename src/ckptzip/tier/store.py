"""The manager's storage with a memory tier in front (docs/MANAGER.md, "Memory tier").

Checkpoints are committed first to a directory in shared memory (``/dev/shm``, a tmpfs: the files
outlive the process that wrote them, so a killed trainer restores from RAM), by the same atomic
rename as on disk; every ``persist_every``-th one is then copied to the durable directory by a
background thread, its delta bases first. Other users may write in ``/dev/shm``: the tier's
directories are private (:mod:`ckptzip.storage.private`: this user's, 0700, reached through
their descriptors, never through a link), and only this user's regular files in them count. With a process group, each commit is also sent to the
next rank's tier (:mod:`.ring`), and ``restore`` becomes a collective that agrees on the newest
step every rank can restore, fetching a lost rank's files from its successor.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import functools
import hashlib
import os
import re
import shutil
import tempfile
import threading
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Literal, TypeVar

import torch.distributed as dist

from ..errors import CorruptCheckpointError, MissingBaseError, UsageError
from ..series import Files, Series, name_of, retained, step_of
from ..storage import Listing, Storage, WriterLock
from ..storage.commits import LocalStorage
from ..storage.private import PrivateDirectory
from .peers import Peers, Writer, check_step
from .ring import Ring

T = TypeVar("T")
Tier = Literal["memory", "peer", "directory"]
_SHM = "/dev/shm"  # POSIX shared memory on Linux: a tmpfs
_COPY_BYTES = 16 << 20


class DamagedCopyWarning(UserWarning):
    """A tier's copy of a checkpoint failed its checksums; another tier's copy was used."""


@dataclass(frozen=True)
class MemoryTier:
    """Settings of a :class:`~ckptzip.manager.CheckpointManager`'s memory tier.

    Args:
        keep: newest checkpoints kept in memory (and the delta bases they need).
        persist_every: every this-many-th save (of this manager) is also written to the directory,
            in the background; ``close()`` persists the newest one too.
        budget: bytes of shared memory the tier may hold (its own and its peer's copies); ``None``:
            only ``keep`` and the free space of the file system bound it.
        path: the tier's directory (default: under ``/dev/shm``, named after the manager's
            directory, so a restarted trainer finds it); private to the job's user, or refused
            (:class:`~ckptzip.errors.UnsafeLocationError`; docs/MANAGER.md, "Memory tier").
        replicate: ``None``, ``"world"`` (a new gloo group over the default process group, made
            collectively with the manager) or a gloo process group given to the tier alone: each
            commit is also sent to the next rank's tier, and ``restore``/``latest_step`` are
            collectives of the group.
    """

    keep: int = 2
    persist_every: int = 1
    budget: int | None = None
    path: str | os.PathLike[str] | None = None
    replicate: Any = None

    def __post_init__(self) -> None:
        for name in ("keep", "persist_every"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise UsageError(f"MemoryTier({name}=...) must be an int >= 1, got {value!r}")
        if self.budget is not None and (type(self.budget) is not int or self.budget < 1):
            raise UsageError(f"MemoryTier(budget=...) must be None or a number of bytes >= 1, got {self.budget!r}")
        if not (self.replicate is None or self.replicate == "world" or isinstance(self.replicate, dist.ProcessGroup)):
            raise UsageError(f"MemoryTier(replicate=...) must be None, 'world' or a gloo ProcessGroup, got "
                             f"{self.replicate!r}")

    def root(self, location: str) -> Path:
        """The tier's directory for a manager of ``location`` (made private when it is opened:
        :class:`~ckptzip.storage.private.PrivateDirectory`)."""
        if self.path is not None:
            return Path(self.path)
        base = _SHM if os.path.isdir(_SHM) else tempfile.gettempdir()
        key = hashlib.sha256(os.path.abspath(location).encode()).hexdigest()[:16]
        return Path(base) / f"ckptzip-{os.getuid()}" / key


class _Shelf(Series):
    """One private directory of checkpoint files in shared memory: this rank's copies, or its peer's."""

    def __init__(self, directory: PrivateDirectory) -> None:
        super().__init__(LocalStorage(directory))
        self.directory = directory

    def makedirs(self) -> None:
        self.directory.makedirs()

    def has(self, step: int) -> bool:
        return self.directory.exists(name_of(step))

    def nbytes(self) -> int:
        """Bytes of every file here, temporaries included."""
        return self.directory.nbytes()

    @contextlib.contextmanager
    def writer(self, step: int) -> Iterator[BinaryIO]:
        """An atomic writer of checkpoint ``step`` here (committed when its block ends well)."""
        with self.forgetting(step), self.directory.atomic_write(name_of(step)) as f:
            yield f


class TieredStorage(Storage):
    """A :class:`~ckptzip.storage.Storage` whose commits go to a memory tier first and to
    ``durable`` every ``persist_every``-th time; reads take the fastest tier that has a valid copy.

    Retention is its own (the manager leaves it alone): memory keeps ``tier.keep`` checkpoints,
    the directory ``keep_last``, each with the bases their chains need. Methods other than the
    persisting thread's are called from the manager's one saving thread or its caller, not both
    at once. Names given to its :class:`~ckptzip.storage.Storage` methods are step names
    (:mod:`ckptzip.series`).
    """

    def __init__(self, tier: MemoryTier, durable: Storage, keep_last: int | None) -> None:
        self.tier = tier
        self.durable = Series(durable)
        self.location = durable.location
        self.keep_last = keep_last
        root = PrivateDirectory(tier.root(durable.location))
        self.memory = _Shelf(PrivateDirectory(root.root / "own", parent=root))
        self.peer = _Shelf(PrivateDirectory(root.root / "peer", parent=root))
        self.memory.makedirs()  # an unsafe root is refused here, when the manager is made
        self.last_tier: Tier | None = None  # where the newest restore read its checkpoint
        ring = _ring(tier.replicate)
        self.peers = None if ring is None else Peers(ring, self)
        self._partials: dict[str, Storage] = {}
        self._cond = threading.Condition()
        self._pinned: collections.Counter[str] = collections.Counter()  # awaiting persistence
        self._persists: list[concurrent.futures.Future[None]] = []
        self._persister = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckptzip-persist")
        self._saves = 0
        self._last_size = 0

    def own_steps(self) -> list[int]:
        """This rank's steps in memory or in the directory."""
        return sorted(set(self.memory.steps()) | set(self.durable.steps()))

    # ------------------------------------------------------------------------------ for the peers
    # (peers.RankCopies; above list(), which annotations below it would take for the builtin)

    def open_own(self, step: int) -> BinaryIO:
        return self.open(name_of(step))

    def receive(self, step: int) -> Writer:
        return self.memory.writer(step)

    def held_steps(self) -> list[int]:
        return self.peer.steps()

    def held_chain(self, step: int) -> list[int]:
        return self.peer.chain(step) if self.peer.has(step) else []

    def open_held(self, step: int) -> BinaryIO:
        return self.peer.open(step)

    def hold(self, step: int, size: int) -> Writer | None:
        """Where to keep a peer's copy of ``step`` (``size`` bytes), ``None`` if it does not fit
        (one larger than the tier could ever hold evicts nothing)."""
        name = check_step(step, "a peer")
        if size > self.capacity() or not self._make_room(size, wait=True):
            warnings.warn(f"the memory tier of {self.location} has no room for the peer's {name} "
                          f"({size} bytes) within its budget; that step is not replicated", stacklevel=5)
            return None
        return self.peer.writer(step)

    def retire_held(self) -> None:
        self.peer.retire(self.tier.keep)

    # ------------------------------------------------------------------------------ Storage

    def list(self, pattern: re.Pattern[str]) -> Listing:
        memory, durable = self.memory.storage.list(pattern), self.durable.storage.list(pattern)
        self._partials = {**{n: self.durable.storage for n in durable.partial},
                          **{n: self.memory.storage for n in memory.partial}}
        return Listing(sorted(set(memory.committed) | set(durable.committed)), sorted(self._partials))

    def write(self, name: str, write: Callable[[BinaryIO], Any]) -> None:
        """Commit to memory (or, if it cannot make room there, to the directory), persist if due,
        retire, and replicate; the exchange with the peers runs even when the write failed."""
        step = step_of(name)
        self._saves += 1
        replicated = False
        try:
            if self._make_room(self._last_size, wait=True):
                self.memory.write(step, write)
                if self.peers is not None:
                    self.peers.fetched.discard(name)
                self._last_size = self.memory.directory.stat(name).st_size
                if self._saves % self.tier.persist_every == 0:
                    self._persist(name)
                self._retire()
            else:
                warnings.warn(f"the memory tier of {self.location} has no room for a checkpoint of about "
                              f"{self._last_size} bytes within its budget; writing {name} to the directory", stacklevel=2)
                self.durable.write(step, write)
            replicated = True
            if self.peers is not None:
                self.peers.replicate(step)
        finally:
            if not replicated and self.peers is not None:
                self.peers.replicate(None)
        self._raise_persist_errors()

    def open(self, name: str) -> BinaryIO:
        """This rank's fastest copy of ``name``: in memory, else in the directory."""
        with contextlib.suppress(FileNotFoundError):
            return self.memory.storage.open(name)
        with contextlib.suppress(FileNotFoundError):
            return self.durable.storage.open(name)
        raise FileNotFoundError(f"{name} is in no tier of {self.location}")

    def delete(self, name: str) -> None:
        self.memory.delete(step_of(name))
        self.durable.delete(step_of(name))

    def discard_partial(self, name: str) -> None:
        where = self._partials.pop(name, None)
        if where is not None:
            where.discard_partial(name)

    def lock(self) -> WriterLock:
        return self.durable.storage.lock()

    # ------------------------------------------------------------------------------ reading

    def read(self, name: str, load: Callable[[Files], T]) -> T:
        """``load(files)`` with ``files`` this storage (every file opened from memory where it is
        there, else the directory); if that copy is damaged, ``load`` again with the directory's
        copies alone."""
        errors: list[Exception] = []
        step = step_of(name)
        for files in (self, self.durable.storage):
            if files is not self and not self.durable.has(step):
                break
            try:
                result = load(files)
            except (CorruptCheckpointError, MissingBaseError) as exc:
                errors.append(exc)
                continue
            if errors:
                warnings.warn(f"the memory copy of {name} in {self.location}'s tier is damaged ({errors[0]}); "
                              "restored it from the directory", DamagedCopyWarning, stacklevel=3)
            self.last_tier = "directory" if files is not self or not self.memory.has(step) else (
                "peer" if self.peers is not None and name in self.peers.fetched else "memory")
            return result
        if not errors:
            raise FileNotFoundError(f"{name} is in no tier of {self.location}")
        raise errors[-1]

    # ------------------------------------------------------------------------------ memory

    def _room(self) -> int:
        """Bytes a new file may take: the budget's rest and the file system's free space."""
        stat = self.memory.directory.statvfs()
        free = stat.f_bavail * stat.f_frsize
        if self.tier.budget is None:
            return free
        return min(free, self.tier.budget - self.memory.nbytes() - self.peer.nbytes())

    def _make_room(self, need: int, *, wait: bool) -> bool:
        """Evict until ``need`` bytes fit; with ``wait``, wait for persisting copies (which are
        pinned) to finish while that is not enough (back-pressure). Whether they fit."""
        with self._cond:
            while True:
                self._evict(need)
                if self._room() >= need:
                    return True
                if not wait or not self._pinned:
                    return False
                self._cond.wait()

    def _retire(self) -> None:
        """Memory retention: the newest ``keep`` own and peer copies (with their bases), then the
        budget; a newest checkpoint that alone exceeds it moves to the directory."""
        for shelf in (self.memory, self.peer):
            shelf.retire(self.tier.keep, also=self._pinned_steps(shelf))
        if self._make_room(0, wait=True):
            return
        steps = self.memory.steps()
        if steps:
            newest = name_of(steps[-1])
            self._persist(newest).result()
            for step in reversed(self.memory.chain(steps[-1])):
                self.memory.delete(step)
            warnings.warn(f"{newest} does not fit in the memory tier's budget of {self.tier.budget} bytes; it was "
                          f"moved to {self.location}", stacklevel=3)

    def _evict(self, need: int) -> None:
        """Remove the oldest copies that nothing protects until ``need`` bytes fit: not the newest
        step of a shelf or a base it needs, not a pinned one, not a base of another copy kept."""
        while self._room() < need:
            candidates = []
            for shelf in (self.memory, self.peer):
                steps = shelf.steps()
                keep = retained(steps, 1, shelf.base_of, also=self._pinned_steps(shelf))
                bases = {shelf.base_of(s) for s in steps}
                candidates += [(s, id(shelf), shelf) for s in steps if s not in keep and s not in bases]
            if not candidates:
                return
            step, _, shelf = min(candidates, key=lambda c: c[:2])
            shelf.delete(step)

    def _pinned_steps(self, shelf: _Shelf) -> set[int]:
        return {step_of(n) for n in tuple(self._pinned)} if shelf is self.memory else set()

    def capacity(self) -> int:
        """The most bytes the tier could ever hold: its budget, or the size of its file system."""
        stat = self.memory.directory.statvfs()
        total = stat.f_blocks * stat.f_frsize
        return total if self.tier.budget is None else min(total, self.tier.budget)

    # ------------------------------------------------------------------------------ persisting

    def _persist(self, name: str) -> concurrent.futures.Future[None]:
        """Copy ``name`` (and its bases that the directory lacks) to the directory in the
        background; the memory copies stay pinned until then."""
        with self._cond:
            self._pinned[name] += 1
        future = self._persister.submit(self._persist_now, name)
        self._persists.append(future)
        return future

    def _persist_now(self, name: str) -> None:
        try:
            committed = set(self.durable.steps())
            for step in self.memory.chain(step_of(name)):
                if step not in committed:
                    with self.memory.open(step) as src:
                        self.durable.write(step, functools.partial(shutil.copyfileobj, src, length=_COPY_BYTES))
            self.durable.retire(self.keep_last)
        finally:
            with self._cond:
                self._pinned[name] -= 1
                if not self._pinned[name]:
                    del self._pinned[name]
                self._cond.notify_all()

    def _raise_persist_errors(self) -> None:
        """Raise the first error of a finished background copy (each once)."""
        for future in [f for f in self._persists if f.done()]:
            self._persists.remove(future)
            if future.exception() is not None:
                raise future.exception()  # type: ignore[misc]

    def wait_persisted(self) -> None:
        """Block until every background copy to the directory has ended; raise the first error."""
        concurrent.futures.wait(list(self._persists))
        self._raise_persist_errors()

    def close(self) -> None:
        """Persist the newest memory checkpoint if the directory lacks it; wait for every copy."""
        steps = self.memory.steps()
        if steps and not self.durable.has(steps[-1]):
            self._persist(name_of(steps[-1]))
        self._persister.shutdown(wait=True)
        self._raise_persist_errors()

def _ring(replicate: Any) -> Ring | None:
    if replicate is None:
        return None
    if not dist.is_initialized():
        raise UsageError("MemoryTier(replicate=...) needs torch.distributed initialized (init_process_group) first")
    group = dist.new_group(backend="gloo") if replicate == "world" else replicate
    ring = Ring(group)
    return ring if ring.size > 1 else None
