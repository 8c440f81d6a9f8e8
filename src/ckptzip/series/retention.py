"""Which checkpoints a series keeps: the newest few and every base their delta chains need."""

from __future__ import annotations

from collections.abc import Callable, Iterable


def retained(steps: Iterable[int], keep: int | None, base_of: Callable[[int], int | None],
             also: Iterable[int] = ()) -> set[int]:
    """The newest ``keep`` of ``steps`` (all of them with ``None``) and ``also``, and, down each
    one's chain, every base (``base_of(step)``: the step it is stored relative to, or ``None``)."""
    ordered = sorted(steps)
    needed = set(ordered if keep is None else ordered[max(0, len(ordered) - keep) :]) | set(also)
    frontier = list(needed)
    while frontier:
        base = base_of(frontier.pop())
        if base is not None and base not in needed:
            needed.add(base)
            frontier.append(base)
    return needed


def removable(steps: Iterable[int], keep: int | None, base_of: Callable[[int], int | None],
              also: Iterable[int] = ()) -> list[int]:
    """The steps outside :func:`retained`, newest first: a delta goes before its base, so a crash
    while removing them never leaves a delta without its base."""
    ordered = sorted(steps)
    needed = retained(ordered, keep, base_of, also)
    return [step for step in reversed(ordered) if step not in needed]
