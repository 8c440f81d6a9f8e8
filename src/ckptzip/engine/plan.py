"""How the engine divides its work: which device codes a tensor (:func:`work_device`), the bytes
of a batch there (:func:`batch_bytes`), and the one greedy packer (:func:`packed`) that cuts
items, in order, into groups within byte limits: a save's and a load's batches, a load's rounds,
the DCP reader's groups."""

from __future__ import annotations

import collections
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch

K = TypeVar("K", bound=Hashable)


def work_device(backend: str, device: torch.device) -> torch.device:
    """Where ``backend`` codes a tensor on (or bound for) ``device``: the CPU, or a GPU: that
    one, else the current one."""
    if backend == "cpu":
        return torch.device("cpu")
    return device if device.type == "cuda" else torch.device("cuda", torch.cuda.current_device())


def batch_bytes(device: torch.device, defaults: Mapping[str, int], gpu: Mapping[torch.device, int] | None) -> int:
    """The bytes of a batch coded on ``device``: on a GPU, ``gpu``'s for it (its budget's) where
    given; else ``defaults``' for the device type."""
    return (gpu or {}).get(device, defaults["cuda"]) if device.type == "cuda" else defaults["cpu"]


@dataclass(frozen=True)
class Limit:
    """Where a group is cut, by the bytes of one key in it: before an item that would take them
    over ``within``, after an item that takes them to ``fill`` or more (0: every item alone).
    None: never."""

    within: int | None = None
    fill: int | None = None


def packed(order: Iterable[int], nbytes: Sequence[int], keys: Sequence[K], limits: Mapping[K, Limit], *,
           shared: bool = False, open_groups: int = 1) -> list[list[int]]:
    """Positions ``order`` greedily in groups, in that order within each: a group per key, or
    (``shared``) groups of every key, each key's bytes counted apart; each cut where its key's
    limit says. Groups come in the order they are cut, then those left open in the order their
    keys opened them. With ``open_groups`` above one, up to that many groups of a key stay open
    where its limit has ``within``: an item goes to the first of them it fits (first fit), and a
    new one beyond them closes the oldest, so items of different sizes fill groups closer to
    ``within`` (and leave their order, by at most that many groups)."""
    if shared and open_groups != 1:
        raise ValueError("shared groups are packed one open group at a time")
    groups: list[list[int]] = []
    open_: dict[K | None, list[tuple[list[int], collections.Counter[K]]]] = {}
    for i in order:
        key, limit = keys[i], limits[keys[i]]
        candidates = open_.setdefault(None if shared else key, [])
        target = next((g for g in candidates if limit.within is None or _used_with(g, key, nbytes[i]) <= limit.within),
                      None)
        if target is None:
            target = ([], collections.Counter())
            candidates.append(target)
            if len(candidates) > open_groups:
                groups.append(candidates.pop(0)[0])
        members, used = target
        members.append(i)
        used[key] += nbytes[i]
        if limit.fill is not None and used[key] >= limit.fill:
            groups.append(members)
            candidates.remove(target)
            if not candidates:
                del open_[None if shared else key]  # its next group opens at the end
    groups.extend(members for candidates in open_.values() for members, _ in candidates)
    return groups


def _used_with(group: tuple[list[int], collections.Counter[K]], key: K, nbytes: int) -> int:
    """The bytes of ``key`` in ``group`` with ``nbytes`` more; an empty group takes any item."""
    members, used = group
    return used[key] + nbytes if members else 0


def halving(nbytes: Sequence[int]) -> int:
    """Where to cut items of these sizes (at least two) into two runs, in order, of the most even
    bytes: the larger run is as small as it can be (a count's half put a 64 MiB tensor with an
    8-byte one, so the half that failed was retried at nearly its size)."""
    total, before = sum(nbytes), 0
    best, cut = total, 1
    for k in range(1, len(nbytes)):
        before += nbytes[k - 1]
        if max(before, total - before) < best:
            best, cut = max(before, total - before), k
    return cut
