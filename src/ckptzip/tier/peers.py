"""A memory tier's peer copies: each commit sent to the successor's tier, and the collective
restore that agrees, across the group, on the newest step every rank can restore.

A peer is not trusted with more than its own copies: what it announces (steps, sizes, outcomes)
is checked before it is used, a step this tier would not name is a :class:`ReplicationError`,
its copies go to the peer shelf, and a fetch from it brings only the step asked for and the
bases this rank lacks, so a peer's copy never replaces this rank's own (but the copy asked for
because this rank's own failed its checksums)."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, BinaryIO, TypeVar

from ..errors import CheckpointNotFoundError, CorruptCheckpointError, MissingBaseError
from .retention import removable
from .ring import ReplicationError, Ring

if TYPE_CHECKING:
    from .store import TieredStorage

T = TypeVar("T")
# Outcomes of one rank's attempt to restore a step, as gathered by every rank.
_OK, _DAMAGED, _FAILED = 0, 1, 2
DAMAGE = (CorruptCheckpointError, MissingBaseError, FileNotFoundError)


class Peers:
    """The ring exchanges of one rank's :class:`~ckptzip.tier.store.TieredStorage`."""

    def __init__(self, ring: Ring, store: TieredStorage) -> None:
        self.ring = ring
        self.store = store
        self.fetched: set[str] = set()  # memory copies that came from the successor

    def replicate(self, name: str | None) -> None:
        """Send this rank's new checkpoint (``None``: none this time) to the successor, keep what
        the predecessor sends, and retire the predecessor's older copies."""
        store = self.store
        with contextlib.ExitStack() as opened:
            files: list[tuple[int, BinaryIO]] = []
            if name is not None:
                source = store.memory.storage if store.memory.has(name) else store.durable
                files.append((store.naming.step_of(name), opened.enter_context(source.open(name))))
            self.ring.stream(files, forward=True, send=True, expect=True, accept=store.hold)
        for step in removable(store.peer.steps(), store.tier.keep, store.peer.base_of):
            store.peer.remove(step)

    def _tables(self) -> tuple[list[set[int]], list[set[int]], set[int]]:
        """Every rank's own steps and held (predecessor's) steps, and the steps every rank can restore."""
        ring, store = self.ring, self.store
        owns = self._steps(ring.gather(store.own_steps()))
        helds = self._steps(ring.gather(store.peer.steps()))
        available = [owns[r] | helds[ring.successor(r)] for r in range(ring.size)]
        return owns, helds, set.intersection(*available)

    def _steps(self, rows: list[list[int]]) -> list[set[int]]:
        """Gathered steps, each one this tier names (every rank sees the same rows: all raise alike)."""
        for rank, row in enumerate(rows):
            for step in row:
                self.store.check_step(step, f"rank {rank}")
        return [set(row) for row in rows]

    def _outcomes(self, code: int) -> list[int]:
        """Every rank's outcome of an attempt, each one of the three there are."""
        codes = [row[0] if len(row) == 1 else -1 for row in self.ring.gather([code])]
        bad = [r for r, c in enumerate(codes) if c not in (_OK, _DAMAGED, _FAILED)]
        if bad:
            raise ReplicationError(f"rank {bad[0]} reported an outcome that is not one ({codes[bad[0]]}) while the group "
                                   "restored")
        return codes

    def latest(self) -> int | None:
        """(Collective) the newest step every rank of the group can restore."""
        return max(self._tables()[2], default=None)

    def restore(self, step: int | None, load: Callable[[int], T]) -> T:
        """(Collective) ``load`` the newest step (or ``step``) that every rank restores, each from
        its fastest valid copy or, where it has none or a damaged one, its successor's."""
        ring = self.ring
        owns, helds, common = self._tables()
        candidates = sorted(common if step is None else common & {step})
        while candidates:
            chosen = candidates.pop()
            fetch = [chosen not in owns[r] for r in range(ring.size)]
            self._fetch(chosen, fetch, replace=False)
            outcome = _attempt(load, chosen)
            codes = self._outcomes(outcome[0])
            retry = [codes[r] == _DAMAGED and not fetch[r] and chosen in helds[ring.successor(r)]
                     for r in range(ring.size)]
            if any(retry):
                self._fetch(chosen, retry, replace=True)
                if retry[ring.rank]:
                    outcome = _attempt(load, chosen)
                codes = self._outcomes(outcome[0])
            if _FAILED in codes:
                if outcome[0] == _FAILED and outcome[1] is not None:
                    raise outcome[1]
                raise ReplicationError(f"rank {codes.index(_FAILED)} failed to restore step {chosen}; see its error")
            if all(code == _OK for code in codes):
                return outcome[2]  # type: ignore[return-value]
        raise CheckpointNotFoundError(
            f"no step {'' if step is None else f'{step} '}is restorable on every rank of the group: rank "
            f"{ring.rank} ({self.store.location}) has steps {sorted(owns[ring.rank])}, its successor holds "
            f"{sorted(helds[ring.successor(ring.rank)])} of them")

    def _fetch(self, step: int, need: list[bool], *, replace: bool) -> None:
        """Every rank ``r`` with ``need[r]`` receives from its successor the copy of ``step`` (and
        its bases) that the successor holds, into its own memory tier: of the bases only those it
        lacks, and ``step`` itself in place of its own copy only where ``replace`` (its own
        failed its checksums)."""
        ring, store, naming = self.ring, self.store, self.store.naming
        serve = need[ring.predecessor(ring.rank)]
        own = set(store.own_steps()) if need[ring.rank] else set()
        peer = f"rank {ring.successor(ring.rank)}"

        def accept(s: int, size: int) -> contextlib.AbstractContextManager[BinaryIO] | None:
            name = store.check_step(s, peer)
            if s > step:
                raise ReplicationError(f"{peer} sent step {s} for a fetch of step {step} and its bases; none of its "
                                       "files was kept")
            if s in own and not (replace and s == step):
                return None  # a peer's copy never replaces this rank's own
            if size > store.capacity():
                warnings.warn(f"the memory tier of {store.location} cannot hold {name} from {peer} ({size} bytes)",
                              stacklevel=2)
                return None
            return store.memory.writer(name)

        with contextlib.ExitStack() as opened:
            files = None
            if serve:
                held = store.peer.chain(step) if store.peer.has(naming.name_of(step)) else []
                files = [(s, opened.enter_context(store.peer.storage.open(naming.name_of(s)))) for s in held]
            got = ring.stream(files, forward=False, send=serve, expect=need[ring.rank], accept=accept)
        self.fetched.update(map(naming.name_of, got))


def _attempt(load: Callable[[int], T], step: int) -> tuple[int, Exception | None, T | None]:
    try:
        return _OK, None, load(step)
    except DAMAGE as exc:
        return _DAMAGED, exc, None
    except Exception as exc:  # reported to every rank, then raised by this one
        return _FAILED, exc, None
