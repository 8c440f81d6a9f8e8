"""Ring placement of memory-tier copies over a torch.distributed process group.

Rank ``r`` sends each of its checkpoints to rank ``r + 1`` (mod the group's size) and holds the
copies of rank ``r - 1``: one peer copy per host, whatever the number of ranks, and the loss of
one rank's host leaves its checkpoints on its successor. Files travel as *bundles*: one uint8
tensor holding a table of (step, size) pairs and the files' bytes, sent point to point.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.distributed as dist

from ..errors import CkptzipError

# An exchange's sizes are sent first (one int64 per direction), then the bundles themselves.
_NOTHING = -1  # the size sent where no bundle follows


class ReplicationError(CkptzipError, RuntimeError):
    """The ranks of a memory tier's process group disagree, or a peer's bundle is malformed."""


def pack(files: Sequence[tuple[int, bytes | np.ndarray]]) -> torch.Tensor:
    """A bundle of ``(step, data)`` files: count, then a (step, size) pair per file, then the data."""
    table = np.array([len(files), *(v for step, data in files for v in (step, len(data)))], dtype=np.int64)
    out = np.empty(table.nbytes + sum(len(data) for _, data in files), dtype=np.uint8)
    out[: table.nbytes] = table.view(np.uint8)
    at = table.nbytes
    for _, data in files:
        out[at : at + len(data)] = np.frombuffer(data, dtype=np.uint8)
        at += len(data)
    return torch.from_numpy(out)


def unpack(bundle: torch.Tensor) -> list[tuple[int, memoryview]]:
    """The files of a bundle from :func:`pack`, as views into it."""
    raw = bundle.numpy()
    if raw.nbytes < 8:
        raise ReplicationError(f"a peer sent a bundle of {raw.nbytes} bytes, shorter than its file count")
    count = int(raw[:8].view(np.int64)[0])
    head = 8 * (1 + 2 * count)
    if count < 0 or head > raw.nbytes:
        raise ReplicationError(f"a peer sent a bundle of {raw.nbytes} bytes whose table claims {count} files")
    table = raw[8:head].view(np.int64).reshape(count, 2)
    if (table[:, 1] < 0).any() or head + int(table[:, 1].sum()) != raw.nbytes:
        raise ReplicationError(f"a peer sent a bundle of {raw.nbytes} bytes whose table does not tile it")
    files, at = [], head
    view = raw.data
    for step, size in table.tolist():
        files.append((int(step), view[at : at + size]))
        at += size
    return files


class Ring:
    """Point-to-point exchanges between neighbours of a gloo (CPU) process group, used only by
    one thread of each rank (so every rank issues them in the same order)."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)

    def successor(self, rank: int) -> int:
        return (rank + 1) % self.size

    def predecessor(self, rank: int) -> int:
        return (rank - 1) % self.size

    def shift(self, bundle: torch.Tensor | None, *, forward: bool, send: bool, expect: bool) -> torch.Tensor | None:
        """Send ``bundle`` (``None``: nothing this time) to the successor (``forward``) or the
        predecessor if ``send``, and receive what the opposite neighbour sends if ``expect``. Both
        neighbours decide ``send``/``expect`` from state every rank shares. Returns what came."""
        to = self.successor(self.rank) if forward else self.predecessor(self.rank)
        frm = self.predecessor(self.rank) if forward else self.successor(self.rank)
        size = torch.tensor([_NOTHING if bundle is None else bundle.numel()], dtype=torch.int64)
        got = torch.tensor([_NOTHING], dtype=torch.int64)
        self._both(size if send else None, to, got if expect else None, frm)
        received = None if int(got[0]) == _NOTHING else torch.empty(int(got[0]), dtype=torch.uint8)
        self._both(bundle if send else None, to, received, frm)
        return received

    def _both(self, send: torch.Tensor | None, to: int, recv: torch.Tensor | None, frm: int) -> None:
        works = []
        if send is not None:
            works.append(dist.isend(send, group=self.group, group_dst=to))
        if recv is not None:
            works.append(dist.irecv(recv, group=self.group, group_src=frm))
        for work in works:
            if work is not None:
                work.wait()

    def gather(self, values: Sequence[int]) -> list[list[int]]:
        """Every rank's ``values`` (int64), indexed by rank."""
        mine = torch.tensor(list(values), dtype=torch.int64)
        counts = [torch.empty(1, dtype=torch.int64) for _ in range(self.size)]
        dist.all_gather(counts, torch.tensor([mine.numel()], dtype=torch.int64), group=self.group)
        longest = max(int(c[0]) for c in counts)
        padded = torch.zeros(longest, dtype=torch.int64)
        padded[: mine.numel()] = mine
        rows = [torch.empty(longest, dtype=torch.int64) for _ in range(self.size)]
        dist.all_gather(rows, padded, group=self.group)
        return [row[: int(c[0])].tolist() for row, c in zip(rows, counts)]
