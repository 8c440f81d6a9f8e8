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
           shared: bool = False) -> list[list[int]]:
    """Positions ``order`` greedily in groups, in that order within each: a group per key, or
    (``shared``) groups of every key, each key's bytes counted apart; each cut where its key's
    limit says. Groups come in the order they are cut, then those left open in the order they
    opened."""
    groups: list[list[int]] = []
    open_groups: dict[K | None, tuple[list[int], collections.Counter[K]]] = {}
    for i in order:
        key, limit = keys[i], limits[keys[i]]
        group = None if shared else key
        members, used = open_groups.get(group, ([], collections.Counter()))
        if members and limit.within is not None and used[key] + nbytes[i] > limit.within:
            groups.append(members)
            members, used = [], collections.Counter()
        members.append(i)
        used[key] += nbytes[i]
        if limit.fill is not None and used[key] >= limit.fill:
            groups.append(members)
            open_groups.pop(group, None)
        else:
            open_groups[group] = (members, used)
    groups.extend(members for members, _ in open_groups.values())
    return groups
