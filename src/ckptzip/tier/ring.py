"""Ring placement of memory-tier copies over a torch.distributed process group.

Rank ``r`` sends each of its checkpoints to rank ``r + 1`` (mod the group's size) and holds the
copies of rank ``r - 1``: one peer copy per host, whatever the number of ranks, and the loss of
one rank's host leaves its checkpoints on its successor. Files travel as *streams*: a table of
(step, size) pairs, then the files' bytes in pieces of ``PIECE_BYTES``, each piece read from its
file and written to its destination while the next one is on the wire, then the sender's word
that every read succeeded; the receiver commits the files only then, so at most four pieces of
an exchange are in host memory, whatever the files' sizes.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Callable, Sequence
from typing import BinaryIO

import torch
import torch.distributed as dist

from ..errors import CkptzipError

# An exchange's sizes are sent first (one int64 per direction), then the tensors themselves.
_NOTHING = -1  # the size sent where no tensor follows
PIECE_BYTES = 64 << 20  # a stream's unit of transfer (two buffers each way)

Accept = Callable[[int, int], "contextlib.AbstractContextManager[BinaryIO] | None"]


class ReplicationError(CkptzipError, RuntimeError):
    """The ranks of a memory tier's process group disagree, or a peer's stream is malformed or
    lost a file on the way."""


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

    def stream(self, files: Sequence[tuple[int, BinaryIO]] | None, *, forward: bool, send: bool, expect: bool,
               accept: Accept) -> list[int]:
        """Send ``files`` (``(step, file)`` pairs, each read to its end; ``None``: nothing this
        time) to the successor (``forward``) or the predecessor if ``send``, and receive what the
        opposite neighbour sends if ``expect``, as :meth:`shift` decides. A received file of
        ``step`` and ``size`` bytes is written to ``accept(step, size)`` (an atomic writer; ``None``
        drops it); all are committed once the stream ended well, else none. Returns the steps
        committed; a failed read or write is raised after the stream ended, on its rank."""
        to = self.successor(self.rank) if forward else self.predecessor(self.rank)
        frm = self.predecessor(self.rank) if forward else self.successor(self.rank)
        outgoing = _Outgoing(files) if send and files is not None else None
        got = self.shift(outgoing.table.view(torch.uint8) if outgoing else None, forward=forward, send=send,
                         expect=expect)
        with contextlib.ExitStack() as commits:
            incoming = None if got is None else _Incoming(_files_of(got), accept, commits)
            self._pieces(outgoing, to, incoming, frm)
            ok = torch.tensor([outgoing is not None and outgoing.error is None], dtype=torch.int64)
            sent_ok = torch.zeros(1, dtype=torch.int64)
            self._both(ok if outgoing else None, to, sent_ok if incoming else None, frm)
            if incoming is not None:
                if incoming.error is not None:
                    raise incoming.error  # the temporaries are removed, nothing is committed
                if not sent_ok[0]:
                    raise ReplicationError(f"rank {frm} could not read the files it sent; none was kept")
        if outgoing is not None and outgoing.error is not None:
            raise outgoing.error
        return [] if incoming is None else incoming.steps

    def _pieces(self, outgoing: _Outgoing | None, to: int, incoming: _Incoming | None, frm: int) -> None:
        """Move the streams' bytes: piece ``k`` on the wire while piece ``k + 1`` is read and
        piece ``k - 1`` written."""
        sends = _piece_sizes(outgoing.nbytes if outgoing else 0)
        recvs = _piece_sizes(incoming.nbytes if incoming else 0)
        out_bufs = [torch.empty(sends[0], dtype=torch.uint8) for _ in sends[:2]]  # the first piece is the largest
        in_bufs = [torch.empty(recvs[0], dtype=torch.uint8) for _ in recvs[:2]]
        if sends:
            outgoing.fill(out_bufs[0][: sends[0]])  # type: ignore[union-attr]
        landed: torch.Tensor | None = None
        for k in range(max(len(sends), len(recvs))):
            send = out_bufs[k % 2][: sends[k]] if k < len(sends) else None
            recv = in_bufs[k % 2][: recvs[k]] if k < len(recvs) else None
            works = self._post(send, to, recv, frm)
            if k + 1 < len(sends):
                outgoing.fill(out_bufs[(k + 1) % 2][: sends[k + 1]])  # type: ignore[union-attr]
            if landed is not None:
                incoming.feed(landed)  # type: ignore[union-attr]
            for work in works:
                work.wait()
            landed = recv
        if incoming is not None:
            if landed is not None:
                incoming.feed(landed)
            incoming.finish()

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
        for work in self._post(send, to, recv, frm):
            work.wait()

    def _post(self, send: torch.Tensor | None, to: int, recv: torch.Tensor | None, frm: int) -> list[dist.Work]:
        works = []
        if send is not None:
            works.append(dist.isend(send, group=self.group, group_dst=to))
        if recv is not None:
            works.append(dist.irecv(recv, group=self.group, group_src=frm))
        return [work for work in works if work is not None]

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


def _piece_sizes(nbytes: int) -> list[int]:
    return [min(PIECE_BYTES, nbytes - at) for at in range(0, nbytes, PIECE_BYTES)]


def _files_of(table: torch.Tensor) -> list[tuple[int, int]]:
    """The (step, size) pairs of a stream's table (int64 as bytes): its count, then a pair per file."""
    raw = table.view(torch.int64).tolist() if table.numel() % 8 == 0 else []
    count = raw[0] if raw else -1
    if count < 0 or len(raw) != 1 + 2 * count or any(size < 0 for size in raw[2::2]):
        raise ReplicationError(f"a peer sent a stream table of {len(raw)} numbers that does not describe files")
    return list(zip(raw[1::2], raw[2::2]))


class _Outgoing:
    """The sending side of a stream: its table, and its files' bytes read piece by piece. A
    failed read is kept (the rest is sent as zeros, and the receiver told to drop it all)."""

    def __init__(self, files: Sequence[tuple[int, BinaryIO]]) -> None:
        self.files: collections.deque[tuple[BinaryIO, int]] = collections.deque()
        sizes = []
        for step, f in files:
            size = f.seek(0, 2) - f.seek(0)
            sizes += [step, size]
            self.files.append((f, size))
        self.table = torch.tensor([len(files), *sizes], dtype=torch.int64)
        self.nbytes = sum(sizes[1::2])
        self.error: Exception | None = None

    def fill(self, piece: torch.Tensor) -> None:
        view, at = piece.numpy().data, 0
        while at < len(view) and self.error is None:
            f, left = self.files[0]
            if not left:  # a file of no bytes
                self.files.popleft()
                continue
            try:
                n = f.readinto(view[at : at + min(left, len(view) - at)])  # type: ignore[attr-defined]
                if not n:
                    raise ReplicationError(f"a file sent to a peer ended {left} bytes before its size")
            except Exception as exc:  # the stream goes on, so the peer does not wait for it forever
                self.error = exc
                break
            at += n
            self.files[0] = (f, left - n)
        if self.error is not None:
            view[at:] = bytes(len(view) - at)


class _Incoming:
    """The receiving side of a stream: pieces split into its files, each written to the writer
    ``accept`` gives for it (entered in ``commits``, which commits them all or none)."""

    def __init__(self, files: list[tuple[int, int]], accept: Accept, commits: contextlib.ExitStack) -> None:
        self.files = collections.deque(files)
        self.nbytes = sum(size for _, size in files)
        self.steps: list[int] = []
        self.error: Exception | None = None
        self._accept = accept
        self._commits = commits
        self._sink: BinaryIO | None = None
        self._left = 0

    def feed(self, piece: torch.Tensor) -> None:
        view, at = piece.numpy().data, 0
        while at < len(view):
            self._open_next()
            n = min(self._left, len(view) - at)
            if self._sink is not None:
                try:
                    self._sink.write(view[at : at + n])
                except Exception as exc:
                    self._fail(exc)
            at += n
            self._left -= n

    def finish(self) -> None:
        """After the last piece: the files of no bytes at the end."""
        self._open_next()

    def _open_next(self) -> None:
        """Move to the next file when the current one is complete (files of no bytes at once)."""
        while not self._left and self.files:
            step, self._left = self.files.popleft()
            self._sink = None
            if self.error is None:
                try:
                    writer = self._accept(step, self._left)
                    if writer is not None:
                        self._sink = self._commits.enter_context(writer)
                        self.steps.append(step)
                except Exception as exc:
                    self._fail(exc)

    def _fail(self, exc: Exception) -> None:
        self.error = self.error or exc
        self._sink = None
