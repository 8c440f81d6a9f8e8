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
from typing import BinaryIO, Protocol, TypeVar

from ..errors import CheckpointNotFoundError, CorruptCheckpointError, MissingBaseError
from ..series import is_step, name_of
from .ring import ReplicationError, Ring

T = TypeVar("T")
Writer = contextlib.AbstractContextManager[BinaryIO]
# Outcomes of one rank's attempt to restore a step, as gathered by every rank.
_OK, _DAMAGED, _FAILED = 0, 1, 2
DAMAGE = (CorruptCheckpointError, MissingBaseError, FileNotFoundError)


class RankCopies(Protocol):
    """What the exchanges use of one rank's tier (:class:`~ckptzip.tier.store.TieredStorage`):
    its own copies, the copies it holds for its predecessor, and room for what it receives."""

    location: str

    def own_steps(self) -> list[int]:
        """This rank's steps, in memory or in the directory."""

    def open_own(self, step: int) -> BinaryIO:
        """This rank's fastest copy of ``step``."""

    def receive(self, step: int) -> Writer:
        """Where a copy of ``step`` fetched from the successor goes: this rank's memory."""

    def capacity(self) -> int:
        """The most bytes the tier could ever hold."""

    def held_steps(self) -> list[int]:
        """The predecessor's steps held here."""

    def held_chain(self, step: int) -> list[int]:
        """Held ``step`` and its held bases, bottom up; ``[]`` where ``step`` is not held."""

    def open_held(self, step: int) -> BinaryIO: ...

    def hold(self, step: int, size: int) -> Writer | None:
        """Where to keep the predecessor's copy of ``step`` (``size`` bytes); ``None`` if there is no room."""

    def retire_held(self) -> None:
        """Remove the held copies that retention no longer keeps."""


def check_step(step: int, peer: str) -> str:
    """The name of ``step``, announced by ``peer``; :class:`ReplicationError` where it is not a
    step the series names (the tier would never list it, so never retire it)."""
    if not is_step(step):
        raise ReplicationError(f"{peer} sent step {step}, which is not a step this tier names (steps are ints "
                               "from 0); none of its files was kept")
    return name_of(step)


class Peers:
    """The ring exchanges of one rank's tier."""

    def __init__(self, ring: Ring, copies: RankCopies) -> None:
        self.ring = ring
        self.copies = copies
        self.fetched: set[str] = set()  # memory copies that came from the successor

    def replicate(self, step: int | None) -> None:
        """Send this rank's new checkpoint ``step`` (``None``: none this time) to the successor,
        keep what the predecessor sends, and retire the predecessor's older copies."""
        copies = self.copies
        with contextlib.ExitStack() as opened:
            files: list[tuple[int, BinaryIO]] = []
            if step is not None:
                files.append((step, opened.enter_context(copies.open_own(step))))
            self.ring.stream(files, forward=True, send=True, expect=True, accept=copies.hold)
        copies.retire_held()

    def _tables(self) -> tuple[list[set[int]], list[set[int]], set[int]]:
        """Every rank's own steps and held (predecessor's) steps, and the steps every rank can restore."""
        ring, copies = self.ring, self.copies
        owns = self._steps(ring.gather(copies.own_steps()))
        helds = self._steps(ring.gather(copies.held_steps()))
        available = [owns[r] | helds[ring.successor(r)] for r in range(ring.size)]
        return owns, helds, set.intersection(*available)

    def _steps(self, rows: list[list[int]]) -> list[set[int]]:
        """Gathered steps, each one this tier names (every rank sees the same rows: all raise alike)."""
        for rank, row in enumerate(rows):
            for step in row:
                check_step(step, f"rank {rank}")
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
            f"{ring.rank} ({self.copies.location}) has steps {sorted(owns[ring.rank])}, its successor holds "
            f"{sorted(helds[ring.successor(ring.rank)])} of them")

    def _fetch(self, step: int, need: list[bool], *, replace: bool) -> None:
        """Every rank ``r`` with ``need[r]`` receives from its successor the copy of ``step`` (and
        its bases) that the successor holds, into its own memory tier: of the bases only those it
        lacks, and ``step`` itself in place of its own copy only where ``replace`` (its own
        failed its checksums)."""
        ring, copies = self.ring, self.copies
        serve = need[ring.predecessor(ring.rank)]
        own = set(copies.own_steps()) if need[ring.rank] else set()
        peer = f"rank {ring.successor(ring.rank)}"

        def accept(s: int, size: int) -> contextlib.AbstractContextManager[BinaryIO] | None:
            name = check_step(s, peer)
            if s > step:
                raise ReplicationError(f"{peer} sent step {s} for a fetch of step {step} and its bases; none of its "
                                       "files was kept")
            if s in own and not (replace and s == step):
                return None  # a peer's copy never replaces this rank's own
            if size > copies.capacity():
                warnings.warn(f"the memory tier of {copies.location} cannot hold {name} from {peer} ({size} bytes)",
                              stacklevel=2)
                return None
            return copies.receive(s)

        with contextlib.ExitStack() as opened:
            files = None
            if serve:
                files = [(s, opened.enter_context(copies.open_held(s))) for s in copies.held_chain(step)]
            got = ring.stream(files, forward=False, send=serve, expect=need[ring.rank], accept=accept)
        self.fetched.update(map(name_of, got))


def _attempt(load: Callable[[int], T], step: int) -> tuple[int, Exception | None, T | None]:
    try:
        return _OK, None, load(step)
    except DAMAGE as exc:
        return _DAMAGED, exc, None
    except Exception as exc:  # reported to every rank, then raised by this one
        return _FAILED, exc, None
