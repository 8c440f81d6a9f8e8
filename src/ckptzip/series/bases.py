"""The checkpoints of one storage as a series of steps, and the one cached answer to "which step
is N's base".

A checkpoint stored as XOR deltas names its base in its index; retention (every base a kept step
needs stays) and persistence (bases first) ask for it of every step, again and again, so each
step's answer is read once and cached. The cache is right only while the file is the one read:
a :class:`Series` forgets a step when it deletes or writes it, and everything that deletes or
replaces a checkpoint does so through its series.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any, BinaryIO, Protocol

from ..errors import CorruptCheckpointError, MissingBaseError
from ..format import ContainerReader
from ..storage import Storage
from .naming import STEP_PATTERN, name_of, step_of
from .retention import removable

class Files(Protocol):
    """Where a restore opens checkpoints by name (a storage, or a tier's choice of copies)."""

    def open(self, name: str) -> BinaryIO: ...


def read_base(files: Files, step: int) -> int | None:
    """The step checkpoint ``step`` is stored relative to (its first base); ``None`` if it is
    whole or damaged, or if its base is not an earlier step of the series: nothing can restore
    such a delta (the manager's restore says so, MissingBaseError), so no base is kept for it.
    ``FileNotFoundError`` if it is gone."""
    try:
        with files.open(name_of(step)) as f:
            reader = ContainerReader(f)
            try:
                bases = reader.index.bases
            finally:
                reader.ranges.close()  # before the file closes: a buffer's view would pin it
    except (CorruptCheckpointError, MissingBaseError):
        return None
    ref = bases[0] if bases else None
    if ref is None or ref.step is None or not 0 <= ref.step < step or ref.name != name_of(ref.step):
        return None
    return ref.step


class Series:
    """The committed checkpoints of ``storage``, by step, with each one's base.

    Safe to use from several threads: an answer read while the series deleted or wrote any
    step is not kept (it may be the old file's)."""

    def __init__(self, storage: Storage) -> None:
        self.storage = storage
        self._bases: dict[int, int | None] = {}
        self._lock = threading.Lock()
        self._changes = 0  # deletes and writes so far: an answer read across one is not cached

    def steps(self) -> list[int]:
        """The committed steps, ascending."""
        return sorted(map(step_of, self.storage.list(STEP_PATTERN).committed))

    def has(self, step: int) -> bool:
        return step in self.steps()

    def open(self, step: int) -> BinaryIO:
        return self.storage.open(name_of(step))

    def base_of(self, step: int) -> int | None:
        """The step ``step`` is stored relative to (:func:`read_base`), read once; ``None`` also
        when it is gone (not cached: a later write may bring it)."""
        with self._lock:
            if step in self._bases:
                return self._bases[step]
            changes = self._changes
        try:
            base = read_base(self.storage, step)
        except FileNotFoundError:  # gone: the base of nothing, until a write brings it
            return None
        with self._lock:
            if self._changes == changes:
                self._bases[step] = base
        return base

    def record(self, step: int, base: int | None) -> None:
        """Remember the base of ``step``, just written by the caller, who knows it."""
        with self._lock:
            self._bases[step] = base

    def forget(self, step: int) -> None:
        """``step`` was (or is being) replaced or deleted: its base is read again when asked."""
        with self._lock:
            self._bases.pop(step, None)
            self._changes += 1

    def write(self, step: int, write: Callable[[BinaryIO], Any]) -> None:
        """Commit checkpoint ``step`` (:meth:`Storage.write`)."""
        try:
            self.storage.write(name_of(step), write)
        finally:
            self.forget(step)

    @contextlib.contextmanager
    def forgetting(self, step: int) -> Iterator[None]:
        """Around a write of ``step`` by other means: its base is forgotten once the write is over."""
        try:
            yield
        finally:
            self.forget(step)

    def delete(self, step: int) -> None:
        try:
            self.storage.delete(name_of(step))
        finally:
            self.forget(step)

    def chain(self, step: int) -> list[int]:
        """``step`` and the bases below it that the series has, bottom up."""
        out = [step]
        while (base := self.base_of(out[-1])) is not None and self.has(base):
            out.append(base)
        return out[::-1]

    def retire(self, keep: int | None, also: Iterable[int] = ()) -> None:
        """Delete every step but the newest ``keep`` (all with ``None``), ``also`` and the bases
        their chains need, a delta before its base (:func:`~.retention.removable`)."""
        for step in removable(self.steps(), keep, self.base_of, also):
            self.delete(step)
