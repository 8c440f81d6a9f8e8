"""Ring placement of memory-tier copies over a torch.distributed process group.

Rank ``r`` sends each of its checkpoints to rank ``r + 1`` (mod the group's size) and holds the
copies of rank ``r - 1``: one peer copy per host, whatever the number of ranks, and the loss of
one rank's host leaves its checkpoints on its successor.

Files travel as *streams*, and the peer is not trusted. A stream, one way (an exchange runs one
each way at once), is four steps, each message on a tag of its own:

1. the sender's *table*: a count and a (step, size) pair per file, always :data:`TABLE_WORDS`
   int64 words (:data:`MAX_FILES` files at most);
2. the receiver's *verdict*, always :data:`VERDICT_WORDS` words: whether it takes the stream
   (a table that does not describe files, sizes past :data:`MAX_FILE_BYTES`, a step announced
   twice or one the receiver would not name are refused) and which files it keeps (one it has
   no room for, or must not replace, is left out and never sent);
3. the kept files' bytes, in pieces of :data:`PIECE_BYTES`, each read from its file and written
   to its destination while the next one is on the wire; each piece comes after a word giving its
   size, and the receiver posts a receive of that size only once the word said it and it is at
   most :data:`PIECE_BYTES`. The first piece whose size is not the one the table announced is the
   stream's last (received if of 1 to :data:`PIECE_BYTES` bytes, to stay in step, never written);
4. the final words: the sender's, that every read succeeded, and the receiver's, that every piece
   came as announced.

Every message but a piece has a fixed size and a piece's size is said before it is sent, so no
receive is ever smaller than the message it takes (gloo ends a process whose receive is) and
nothing is allocated from an unvalidated number. The receiver commits the files only after the
final words, all or none, so at most four pieces of an exchange are in host memory, whatever the
files' sizes; a malformed stream is a :class:`ReplicationError` on both sides, and the ranks are
in step for the next exchange. Every wait is bounded by the process group's timeout; a message
that does not come within it (gloo then closes the pair) or any other failure of the transport
breaks the ring: that exchange and every later one raise :class:`ReplicationError`.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Callable, Sequence
from typing import BinaryIO

import torch
import torch.distributed as dist

from ..errors import CkptzipError

PIECE_BYTES = 64 << 20  # a stream's unit of transfer (two buffers each way)
MAX_FILES = 1024  # files of one stream: a restore's delta chain (at most 1000 files) fits
MAX_FILE_BYTES = 1 << 48  # 256 TiB: larger than any checkpoint a host holds; a larger size is malformed
TABLE_WORDS = 1 + 2 * MAX_FILES
VERDICT_WORDS = 1 + MAX_FILES // 64  # a status, then a bit per file kept
MAX_GATHERED = 1 << 20  # values one rank contributes to a gather
MAX_GATHER_WORDS = 1 << 27  # the whole of a gather (1 GiB of int64)
_OK, _REFUSED = 0, 1  # verdicts and final words
# One tag per kind of message, so that no message can be taken for another.
_TABLE, _VERDICT, _SIZE, _PIECE, _SENT, _TAKEN = range(1, 7)

Accept = Callable[[int, int], "contextlib.AbstractContextManager[BinaryIO] | None"]
_Message = tuple[torch.Tensor, int, int]  # a tensor, the peer's rank, the tag


class ReplicationError(CkptzipError, RuntimeError):
    """The ranks of a memory tier's process group disagree, a peer's stream is malformed or lost
    a file on the way, or the exchange with a peer failed."""


class Ring:
    """Point-to-point exchanges between neighbours of a gloo (CPU) process group, used only by
    one thread of each rank (so every rank issues them in the same order)."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.broken: str | None = None  # why the exchanges stopped, once they did

    def successor(self, rank: int) -> int:
        return (rank + 1) % self.size

    def predecessor(self, rank: int) -> int:
        return (rank - 1) % self.size

    def stream(self, files: Sequence[tuple[int, BinaryIO]] | None, *, forward: bool, send: bool, expect: bool,
               accept: Accept) -> list[int]:
        """Send ``files`` (``(step, file)`` pairs, each read to its end; ``None``: nothing this
        time) to the successor (``forward``) or the predecessor if ``send``, and receive what the
        opposite neighbour sends if ``expect``; both neighbours decide ``send``/``expect`` from
        state every rank shares. The receiver asks ``accept(step, size)`` for each announced file
        before any byte comes: an atomic writer to write it to, or ``None`` to leave it out (it is
        not sent); raising :class:`ReplicationError` refuses the stream. Returns the steps
        committed (all once the stream ended well, else none); a failed read or write is raised
        after the stream ended, on its rank."""
        if self.broken is not None:
            raise ReplicationError(f"no exchange with the peers: {self.broken}")
        to = self.successor(self.rank) if forward else self.predecessor(self.rank)
        frm = self.predecessor(self.rank) if forward else self.successor(self.rank)
        outgoing = _Outgoing(files or []) if send else None
        with contextlib.ExitStack() as commits:
            incoming = _Incoming(frm, accept, commits) if expect else None
            table = torch.zeros(TABLE_WORDS, dtype=torch.int64)
            self._exchange([(outgoing.table, to, _TABLE)] if outgoing else [],
                           [(table, frm, _TABLE)] if incoming else [])
            verdict = torch.zeros(VERDICT_WORDS, dtype=torch.int64)
            self._exchange([(incoming.judge(table), frm, _VERDICT)] if incoming else [],
                           [(verdict, to, _VERDICT)] if outgoing else [])
            if outgoing is not None:
                outgoing.heed(verdict, to)
            self._pieces(outgoing, to, incoming, frm)
            sent, taken = _word(_REFUSED), _word(_REFUSED)  # the peers' final words
            finals: tuple[list[_Message], list[_Message]] = ([], [])
            if outgoing is not None:
                finals[0].append((_word(outgoing.word()), to, _SENT))
                finals[1].append((taken, to, _TAKEN))
            if incoming is not None:
                finals[0].append((_word(incoming.word()), frm, _TAKEN))
                finals[1].append((sent, frm, _SENT))
            self._exchange(*finals)
            if incoming is not None:
                incoming.close(int(sent[0]))  # raises, before anything is committed, where it must
        if outgoing is not None:
            outgoing.close(int(taken[0]))
        return [] if incoming is None else incoming.steps

    def _pieces(self, outgoing: _Outgoing | None, to: int, incoming: _Incoming | None, frm: int) -> None:
        """Move the streams' bytes: piece ``k`` on the wire while piece ``k + 1`` is read and
        piece ``k - 1`` written."""
        sends = _Pieces(outgoing.nbytes if outgoing else 0)
        recvs = _Pieces(incoming.nbytes if incoming else 0)
        out_bufs = [torch.empty(sends.size(0), dtype=torch.uint8) for _ in range(min(2, len(sends)))]
        in_bufs = [torch.zeros(recvs.size(0), dtype=torch.uint8) for _ in range(min(2, len(recvs)))]  # zeroed: a
        # piece shorter than its message said leaves earlier bytes of this stream in them, never this process's
        if len(sends):
            outgoing.fill(out_bufs[0][: sends.size(0)])  # type: ignore[union-attr]
        landed: torch.Tensor | None = None
        for k in range(max(len(sends), len(recvs))):
            piece = out_bufs[k % 2][: sends.size(k)] if k < len(sends) else None
            said = torch.zeros(1, dtype=torch.int64)
            expected = recvs.size(k) if k < len(recvs) and incoming is not None and incoming.problem is None else None
            posted = self._post([(_word(piece.numel()), to, _SIZE), (piece, to, _PIECE)] if piece is not None else [],
                                [])
            recv = None
            if expected is not None:
                self._exchange([], [(said, frm, _SIZE)])  # each work is waited for once (gloo counts completions)
                recv = incoming.piece(k, int(said[0]), expected, in_bufs[k % 2])  # type: ignore[union-attr]
                if recv is not None:
                    posted += self._post([], [(recv, frm, _PIECE)])
            if k + 1 < len(sends):
                outgoing.fill(out_bufs[(k + 1) % 2][: sends.size(k + 1)])  # type: ignore[union-attr]
            if landed is not None:
                incoming.feed(landed)  # type: ignore[union-attr]
            self._wait(posted)
            landed = recv if incoming is not None and incoming.problem is None else None
        if incoming is not None:
            if landed is not None:
                incoming.feed(landed)
            incoming.finish()

    def _exchange(self, sends: list[_Message], recvs: list[_Message]) -> None:
        self._wait(self._post(sends, recvs))

    def _post(self, sends: list[_Message], recvs: list[_Message]) -> list[dist.Work]:
        works = []
        try:
            for tensor, peer, tag in sends:
                works.append(dist.isend(tensor, group=self.group, group_dst=peer, tag=tag))
            for tensor, peer, tag in recvs:
                works.append(dist.irecv(tensor, group=self.group, group_src=peer, tag=tag))
        except RuntimeError as exc:
            raise self._break(exc) from exc
        return [work for work in works if work is not None]

    def _wait(self, works: list[dist.Work]) -> None:
        """Wait for ``works``, each within the group's timeout."""
        try:
            for work in works:
                work.wait()
        except RuntimeError as exc:
            raise self._break(exc) from exc

    def _break(self, exc: RuntimeError) -> ReplicationError:
        """The ring stops exchanging after a failure of the transport (a timeout closes gloo's pair)."""
        lines = str(exc).strip().splitlines()
        self.broken = (f"the exchanges of rank {self.rank} with ranks {self.predecessor(self.rank)} and "
                       f"{self.successor(self.rank)} failed ({lines[0] if lines else exc!r})")
        return ReplicationError(f"{self.broken}; the memory tier no longer replicates in this process")

    def gather(self, values: Sequence[int]) -> list[list[int]]:
        """Every rank's ``values`` (int64), indexed by rank; the counts are checked before
        anything is allocated for them (every rank sees the same counts, so all raise alike)."""
        if self.broken is not None:
            raise ReplicationError(f"no exchange with the peers: {self.broken}")
        mine = torch.tensor(list(values), dtype=torch.int64)
        counts = [torch.empty(1, dtype=torch.int64) for _ in range(self.size)]
        try:
            dist.all_gather(counts, torch.tensor([mine.numel()], dtype=torch.int64), group=self.group)
            sizes = [int(c[0]) for c in counts]
            bad = [r for r, n in enumerate(sizes) if not 0 <= n <= MAX_GATHERED]
            if bad or max(sizes) * self.size > MAX_GATHER_WORDS:
                raise ReplicationError(
                    f"rank {bad[0] if bad else sizes.index(max(sizes))} announced {sizes[bad[0]] if bad else max(sizes)} "
                    f"values for a gather of the group, more than it carries ({MAX_GATHERED} a rank, "
                    f"{MAX_GATHER_WORDS} in all)")
            padded = torch.zeros(max(sizes), dtype=torch.int64)
            padded[: mine.numel()] = mine
            rows = [torch.empty(max(sizes), dtype=torch.int64) for _ in range(self.size)]
            dist.all_gather(rows, padded, group=self.group)
        except RuntimeError as exc:
            if isinstance(exc, ReplicationError):
                raise
            raise self._break(exc) from exc
        return [row[:n].tolist() for row, n in zip(rows, sizes)]


class _Pieces:
    """The pieces of a stream of ``nbytes`` bytes: their count and sizes, computed (never listed:
    a table may announce petabytes before it is refused)."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes

    def __len__(self) -> int:
        return -(-self.nbytes // PIECE_BYTES)

    def size(self, k: int) -> int:
        return max(0, min(PIECE_BYTES, self.nbytes - k * PIECE_BYTES))


class _Outgoing:
    """The sending side of a stream: its table, and the kept files' bytes read piece by piece.
    A failed read is kept (the rest is sent as zeros, and the receiver told to drop it all)."""

    def __init__(self, files: Sequence[tuple[int, BinaryIO]]) -> None:
        self.error: Exception | None = None
        self.refused = False
        self.sized: list[tuple[int, BinaryIO, int]] = []
        try:
            if len(files) > MAX_FILES:
                raise ReplicationError(f"a stream carries at most {MAX_FILES} files, not {len(files)}")
            self.sized = [(step, f, f.seek(0, 2) - f.seek(0)) for step, f in files]
        except Exception as exc:  # sent as an empty stream, so the peer does not wait for it forever
            self.error, self.sized = exc, []
        self.table = torch.zeros(TABLE_WORDS, dtype=torch.int64)
        self.table[0] = len(self.sized)
        if self.sized:
            self.table[1 : 1 + 2 * len(self.sized)] = torch.tensor([[s, n] for s, _, n in self.sized]).view(-1)
        self.files: collections.deque[tuple[BinaryIO, int]] = collections.deque()
        self.nbytes = 0

    def heed(self, verdict: torch.Tensor, to: int) -> None:
        """Keep the files the receiver's verdict takes (none where it refused the stream or the
        verdict is not one)."""
        status, kept = int(verdict[0]), _bits(verdict[1:], len(self.sized))
        if status != _OK or kept is None:
            self.refused = True
            self.error = self.error or ReplicationError(
                f"rank {to} refused the stream this rank sent it ({len(self.sized)} files: "
                f"{[(s, n) for s, _, n in self.sized][:8]}); see its error")
            kept = [False] * len(self.sized)
        self.files.extend((f, n) for (_, f, n), keep in zip(self.sized, kept) if keep)
        self.nbytes = sum(n for _, n in self.files)

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

    def word(self) -> int:
        """The sender's final word: whether every read succeeded (and the stream was taken)."""
        return _OK if self.error is None else _REFUSED

    def close(self, taken: int) -> None:
        """After the final words: this side's error, else the receiver's complaint."""
        if self.error is not None:
            raise self.error
        if taken != _OK:
            raise ReplicationError("the peer this rank sent files to says they did not come as announced; none was kept")


def _word(value: int) -> torch.Tensor:
    return torch.tensor([value], dtype=torch.int64)


def _words(bits: list[bool]) -> list[int]:
    """``bits`` packed into the :data:`VERDICT_WORDS` - 1 words of a verdict (int64, least
    significant bit first)."""
    words = [0] * (VERDICT_WORDS - 1)
    for i, bit in enumerate(bits):
        words[i // 64] |= int(bit) << (i % 64)
    return [w - (1 << 64) if w >= 1 << 63 else w for w in words]


def _bits(words: torch.Tensor, count: int) -> list[bool] | None:
    """The first ``count`` bits of ``words`` (int64, least significant first), or ``None`` where
    a bit beyond them is set (not a verdict on ``count`` files)."""
    raw = words.tolist()
    bits = [bool(raw[i // 64] >> (i % 64) & 1) for i in range(len(raw) * 64)]
    return None if any(bits[count:]) else bits[:count]


class _Incoming:
    """The receiving side of a stream: its table judged, then pieces split into the kept files,
    each written to the writer ``accept`` gave for it (entered in ``commits``, which commits them
    all or none). ``problem`` says what was wrong with the peer's stream; ``error`` is this side's
    own failure (a write, an accept)."""

    def __init__(self, frm: int, accept: Accept, commits: contextlib.ExitStack) -> None:
        self.frm = frm
        self.files: collections.deque[tuple[int, int, contextlib.AbstractContextManager[BinaryIO] | None]] = (
            collections.deque())
        self.nbytes = 0
        self.steps: list[int] = []
        self.problem: str | None = None
        self.error: Exception | None = None
        self._accept = accept
        self._commits = commits
        self._sink: BinaryIO | None = None
        self._left = 0

    def judge(self, table: torch.Tensor) -> torch.Tensor:
        """The verdict on the peer's table: refused where it does not describe files this side
        would keep, else the files ``accept`` takes."""
        verdict = torch.zeros(VERDICT_WORDS, dtype=torch.int64)
        try:
            files = self._files(table.tolist())
            kept = [self._writer(step, size) for step, size in files]
        except ReplicationError as exc:
            self.problem = str(exc)
            verdict[0] = _REFUSED
            return verdict
        for (step, size), writer in zip(files, kept):
            if writer is not None:
                self.files.append((step, size, writer))
                self.nbytes += size
        verdict[1:] = torch.tensor(_words([writer is not None for writer in kept]), dtype=torch.int64)
        return verdict

    def _files(self, raw: list[int]) -> list[tuple[int, int]]:
        count = raw[0]
        if not 0 <= count <= MAX_FILES or any(raw[1 + 2 * count :]):
            raise ReplicationError(f"rank {self.frm} sent a stream table of {count} files, which does not describe "
                                   f"0 to {MAX_FILES} files")
        files = list(zip(raw[1 : 1 + 2 * count : 2], raw[2 : 2 + 2 * count : 2]))
        for step, size in files:
            if step < 0 or not 0 <= size <= MAX_FILE_BYTES:
                raise ReplicationError(f"rank {self.frm} announced step {step} of {size} bytes; steps are at least 0 and "
                                       f"files at most {MAX_FILE_BYTES} bytes")
        if len({step for step, _ in files}) < len(files):
            raise ReplicationError(f"rank {self.frm} announced a step twice: {sorted(s for s, _ in files)[:16]}")
        return files

    def _writer(self, step: int, size: int) -> contextlib.AbstractContextManager[BinaryIO] | None:
        if self.error is not None:
            return None
        try:
            return self._accept(step, size)
        except ReplicationError:
            raise
        except Exception as exc:  # this side's failure: nothing is kept, and it is raised after the stream
            self.error = exc
            return None

    def piece(self, k: int, said: int, expected: int, buffer: torch.Tensor) -> torch.Tensor | None:
        """Where piece ``k`` lands, its size ``said`` by the sender: a view of ``buffer``; a piece
        of another size than the table's is the stream's last (received within the bound, so the
        ranks stay in step, but never written)."""
        if said == expected:
            return buffer[:said]
        self.problem = (f"rank {self.frm} sent piece {k} of its stream as {said} bytes where its table announced "
                        f"{expected}; none of its files was kept")
        return torch.empty(said, dtype=torch.uint8) if 0 < said <= PIECE_BYTES else None

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
        if self.problem is None:
            self._open_next()

    def _open_next(self) -> None:
        """Move to the next file when the current one is complete (files of no bytes at once)."""
        while not self._left and self.files:
            step, self._left, writer = self.files.popleft()
            self._sink = None
            if self.error is None and writer is not None:
                try:
                    self._sink = self._commits.enter_context(writer)
                    self.steps.append(step)
                except Exception as exc:
                    self._fail(exc)

    def _fail(self, exc: Exception) -> None:
        self.error = self.error or exc
        self._sink = None

    def word(self) -> int:
        """The receiver's final word: whether every piece came as announced."""
        return _OK if self.problem is None else _REFUSED

    def close(self, sent: int) -> None:
        """After the final words: raise (inside the commits' block, so nothing is committed) this
        side's error, what was wrong with the peer's stream, or the sender's failed read."""
        if self.error is not None:
            raise self.error
        if self.problem is not None:
            raise ReplicationError(self.problem)
        if sent != _OK:
            raise ReplicationError(f"rank {self.frm} could not read the files it sent; none was kept")
