"""Streams from a peer that does not follow the protocol (two gloo ranks on loopback; rank 0 is a
hand-written peer speaking the protocol's messages with any content, rank 1 runs the Ring):
tables that do not describe files, sizes past any bound, pieces shorter or longer than announced,
verdicts and final words that are not, and a peer that goes silent. Each is a ReplicationError
on the honest side (and, where the protocol lets it tell, on the peer's) with nothing committed,
nothing allocated from an unvalidated size, no rank killed and the ranks in step afterwards; a
fuzz test sends random ones."""

from __future__ import annotations

import contextlib
import datetime
import io
import os
import random
from pathlib import Path
from typing import BinaryIO

import pytest
import torch
import torch.distributed as dist
from ckptzip_bench.launch import launch

from ckptzip.storage.files import atomic_file
from ckptzip.tier import ring as ring_module
from ckptzip.tier.ring import MAX_FILE_BYTES, MAX_FILES, TABLE_WORDS, VERDICT_WORDS, ReplicationError, Ring

PIECE = 64  # small pieces: streams of several
TABLE, VERDICT, SIZE, PIECE_TAG, SENT, TAKEN = range(1, 7)  # the protocol's tags (ring.py)


def _content(step: int, size: int) -> bytes:
    return bytes((step * 7 + i) % 251 for i in range(size))


class Peer:
    """Rank 0: the protocol's messages, each with what the test chooses."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group

    def send(self, words: list[int], tag: int, length: int | None = None) -> None:
        tensor = torch.zeros(length or len(words), dtype=torch.int64)
        tensor[: len(words)] = torch.tensor(words, dtype=torch.int64)
        dist.isend(tensor, group=self.group, group_dst=1, tag=tag).wait()

    def send_bytes(self, data: bytes) -> None:
        dist.isend(torch.frombuffer(bytearray(data), dtype=torch.uint8), group=self.group, group_dst=1,
                   tag=PIECE_TAG).wait()

    def recv(self, n: int, tag: int) -> list[int]:
        tensor = torch.zeros(n, dtype=torch.int64)
        dist.irecv(tensor, group=self.group, group_src=1, tag=tag).wait()
        return tensor.tolist()

    def table(self, files: list[tuple[int, int]], count: int | None = None, extra: list[int] = ()) -> list[bool]:
        """Send a table (``count`` in place of the files' own), then the verdict: which of the
        files it announces are kept (none where it was refused)."""
        count = len(files) if count is None else count
        self.send([count, *(w for pair in files for w in pair), *extra], TABLE, TABLE_WORDS)
        verdict = self.recv(VERDICT_WORDS, VERDICT)
        return [bool(verdict[1 + i // 64] >> (i % 64) & 1) for i in range(count)] if verdict[0] == 0 else []

    def pieces(self, data: bytes, sizes: dict[int, int] | None = None) -> None:
        """``data`` in pieces, piece ``k`` announced (and sent) as ``sizes[k]`` bytes where given;
        the first such piece is the last."""
        for k, at in enumerate(range(0, len(data), PIECE)):
            piece = data[at : at + PIECE]
            said = (sizes or {}).get(k, len(piece))
            self.send([said], SIZE)
            if 0 < said <= PIECE:
                self.send_bytes((piece + bytes(PIECE))[:said] if said else b"")
            if said != len(piece):
                return

    def finals(self, sent: int = 0) -> int:
        """The sender's final word out, the receiver's in."""
        self.send([sent], SENT)
        return self.recv(1, TAKEN)[0]


def _accept(root: Path, skip: int | None = None, refuse: int | None = None):  # noqa: ANN202
    def accept(step: int, size: int) -> contextlib.AbstractContextManager[BinaryIO] | None:
        if step == refuse:
            raise ReplicationError(f"step {step} is not one this rank keeps")
        return None if step == skip else atomic_file(root / f"got-{step}")
    return accept


def _received(root: Path) -> list[str]:
    return sorted(n for n in os.listdir(root) if n.startswith("got-"))


# Each case: what rank 0 does (with a Peer), and the error rank 1's stream raises (None: none).
def _short_piece(peer: Peer) -> int:
    assert peer.table([(20, 100)]) == [True]
    peer.pieces(_content(20, 100), {1: 20})  # 64 then 20 of the 36 announced
    return peer.finals()


def _long_piece(peer: Peer) -> int:
    assert peer.table([(20, 100)]) == [True]
    peer.pieces(_content(20, 100), {1: 50})
    return peer.finals()


def _negative_size(peer: Peer) -> int:
    assert peer.table([(20, 100)]) == [True]
    peer.pieces(_content(20, 100), {0: -5})
    return peer.finals()


def _huge_size(peer: Peer) -> int:
    assert peer.table([(20, 100)]) == [True]
    peer.pieces(_content(20, 100), {0: 1 << 40})
    return peer.finals()


def _table_of(files: list[tuple[int, int]], **kw: object) -> object:
    def run(peer: Peer) -> int:
        assert peer.table(files, **kw) == []  # type: ignore[arg-type]
        return peer.finals()
    return run


CASES = {
    "a piece shorter than announced": (_short_piece, "sent piece 1 of its stream as 20 bytes where its table announced 36"),
    "a piece longer than announced": (_long_piece, "sent piece 1 of its stream as 50 bytes where its table announced 36"),
    "a negative size word": (_negative_size, "sent piece 0 of its stream as -5 bytes where its table announced 64"),
    "a size word of 1 TiB": (_huge_size, f"sent piece 0 of its stream as {1 << 40} bytes where its table announced 64"),
    "a negative count": (_table_of([], count=-1), "sent a stream table of -1 files, which does not describe"),
    "a count past the table": (_table_of([], count=MAX_FILES + 1), f"sent a stream table of {MAX_FILES + 1} files"),
    "words past the count": (_table_of([(20, 5)], extra=[7]), "sent a stream table of 1 files, which does not describe"),
    "2^50 bytes": (_table_of([(20, 1 << 50)]), f"announced step 20 of {1 << 50} bytes; steps are at least 0 and files "
                                               f"at most {MAX_FILE_BYTES} bytes"),
    "a negative size": (_table_of([(20, -1)]), "announced step 20 of -1 bytes"),
    "a negative step": (_table_of([(-7, 10)]), "announced step -7 of 10 bytes"),
    "a step twice": (_table_of([(20, 10), (20, 10)]), "announced a step twice: [20, 20]"),
    "a step the receiver does not keep": (_table_of([(20, 10), (66, 10)]), "step 66 is not one this rank keeps"),
}


def _announced(files: list[tuple[int, int]], count: int, refuse: int) -> list[tuple[int, int]] | None:
    """The files a table of ``count`` and the pairs ``files`` announces, or None where the
    receiver refuses it (what ring.py's receiver checks, for the fuzz test's expectations)."""
    if not 0 <= count <= MAX_FILES or any(w for pair in files[count:] for w in pair):
        return None
    announced = (files + [(0, 0)] * count)[:count]
    if any(step < 0 or not 0 <= size <= MAX_FILE_BYTES or step == refuse for step, size in announced):
        return None
    return announced if len({step for step, _ in announced}) == len(announced) else None


def _worker(rank: int, world: int, tmp: str) -> None:
    ring_module.PIECE_BYTES = PIECE
    root = Path(tmp) / f"rank{rank}"
    root.mkdir()
    group = dist.new_group(backend="gloo")
    if rank == 0:
        peer = Peer(group)
        for run, _ in CASES.values():
            assert run(peer) == 1  # the receiver's final word: the stream did not come as announced
            ring = Ring(group)  # in step: an honest exchange both ways
            assert ring.stream([(5, io.BytesIO(b"abc"))], forward=True, send=True, expect=True,
                               accept=_accept(root)) == [5]
        return
    ring = Ring(group)
    for name, (_, message) in CASES.items():
        with pytest.raises(ReplicationError, match=message.replace("[", r"\[").replace("]", r"\]").replace("^", r"\^")):
            ring.stream(None, forward=True, send=False, expect=True, accept=_accept(root, refuse=66))
        assert _received(root) == [], name  # nothing committed, not even the files before the fault
        assert ring.stream([(5, io.BytesIO(b"xyz"))], forward=True, send=True, expect=True,
                           accept=_accept(root)) == [5], name
        assert (root / "got-5").read_bytes() == b"abc"
        (root / "got-5").unlink()


def test_a_stream_that_is_not_as_announced_is_refused_on_both_sides_and_the_ranks_stay_in_step(tmp_path: Path) -> None:
    launch(_worker, 2, str(tmp_path))


def _honest_sender(rank: int, world: int, tmp: str) -> None:
    """Rank 1 sends; rank 0 answers with verdicts and final words that are not."""
    ring_module.PIECE_BYTES = PIECE
    group = dist.new_group(backend="gloo")
    files = [(3, _content(3, 150)), (4, _content(4, 10))]
    if rank == 0:
        peer = Peer(group)

        def receive(verdict: list[int], taken: int, pieces: list[bytes]) -> None:
            table = peer.recv(TABLE_WORDS, TABLE)
            assert table[:5] == [2, 3, 150, 4, 10] and not any(table[5:])
            peer.send(verdict, VERDICT, VERDICT_WORDS)
            for want in pieces:
                assert peer.recv(1, SIZE) == [len(want)]
                piece = torch.zeros(len(want), dtype=torch.uint8)
                dist.irecv(piece, group=group, group_src=1, tag=PIECE_TAG).wait()
                assert piece.numpy().tobytes() == want
            assert peer.recv(1, SENT) == [0 if pieces else 1]  # the sender's word: refused, or its reads fine
            peer.send([taken], TAKEN)

        first = files[0][1]
        receive([1], 0, [])  # refused
        receive([7], 0, [])  # not a verdict
        receive([0, 0b100], 0, [])  # a bit past the files
        receive([0, 0b01], 1, [first[:64], first[64:128], first[128:]])  # then says it did not come as announced
        receive([0, 0b10], 0, [files[1][1]])  # keeps the second: fine
        return
    ring = Ring(group)

    def send() -> list[int]:
        return ring.stream([(s, io.BytesIO(d)) for s, d in files], forward=True, send=True, expect=False,
                           accept=_accept(Path(tmp)))

    for _ in range(3):
        with pytest.raises(ReplicationError, match=r"rank 0 refused the stream this rank sent it \(2 files: "
                                                   r"\[\(3, 150\), \(4, 10\)\]\); see its error"):
            send()
    with pytest.raises(ReplicationError, match="the peer this rank sent files to says they did not come as announced"):
        send()
    assert send() == []


def test_verdicts_and_final_words_that_are_not_are_refused_by_the_sender(tmp_path: Path) -> None:
    launch(_honest_sender, 2, str(tmp_path))


def _silent(rank: int, world: int, tmp: str) -> None:
    ring_module.PIECE_BYTES = PIECE
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=3))
    if rank == 0:
        assert Peer(group).table([(20, 100)]) == [True]
        dist.barrier()  # (the default group) until rank 1 gave up: then it is gone
        return
    ring = Ring(group)
    with pytest.raises(ReplicationError, match=r"the exchanges of rank 1 with ranks 0 and 0 failed \(.*[Tt]imed out"):
        ring.stream(None, forward=True, send=False, expect=True, accept=_accept(Path(tmp)))
    with pytest.raises(ReplicationError, match="no exchange with the peers: the exchanges of rank 1"):
        ring.stream(None, forward=True, send=False, expect=True, accept=_accept(Path(tmp)))  # at once: broken
    assert os.listdir(tmp) == []
    dist.barrier()


def test_a_peer_that_goes_silent_is_a_replication_error_within_the_groups_timeout(tmp_path: Path) -> None:
    launch(_silent, 2, str(tmp_path))


ROUNDS = 200


def _fuzz(rank: int, world: int, tmp: str, seed: int) -> None:
    """Rank 0 sends random streams (tables, sizes, pieces and final words, mostly nearly valid);
    rank 1 receives each with the Ring, which either commits exactly what was announced or raises
    ReplicationError having committed nothing; every tenth round an honest exchange checks the
    ranks are in step."""
    ring_module.PIECE_BYTES = PIECE
    root = Path(tmp) / f"rank{rank}"
    root.mkdir()
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=60))
    chance = random.Random(seed)
    for round_ in range(ROUNDS):
        files = [(chance.choice([chance.randrange(100), -chance.randrange(1, 5)]) if chance.random() < 0.05
                  else chance.randrange(100), chance.choice([0, 1, PIECE - 1, PIECE, chance.randrange(400)]))
                 for _ in range(chance.choice([0, 1, 1, 2, 3, 6]))]
        count = len(files)
        if chance.random() < 0.05:
            count = chance.choice([-1, MAX_FILES + 1, count + 1, max(0, count - 1), -(1 << 62)])
        if chance.random() < 0.05 and files:
            i = chance.randrange(len(files))
            files[i] = (files[i][0], chance.choice([-1, 1 << 50, MAX_FILE_BYTES + 1, -(1 << 63)]))
        skip, refuse = chance.randrange(100), chance.randrange(200)
        bad_sizes = {}
        if chance.random() < 0.25:
            bad_sizes[chance.randrange(8)] = chance.choice([-1, 0, 1, PIECE - 1, PIECE + 1, 1 << 40, -(1 << 63)])
        sent = 0 if chance.random() < 0.9 else chance.choice([1, 2, -1])
        announced = _announced(files, count, refuse)
        if rank == 0:
            peer = Peer(group)
            kept = peer.table(files, count=count)
            assert len(kept) == (0 if announced is None else len(announced))
            data = b"".join(_content(step, size) for (step, size), keep in zip(announced or [], kept) if keep)
            peer.pieces(data, bad_sizes)
            taken = peer.finals(sent)
            assert taken in (0, 1)
        else:
            ring = Ring(group)
            try:
                got = ring.stream(None, forward=True, send=False, expect=True, accept=_accept(root, skip, refuse))
            except ReplicationError:
                assert _received(root) == [], round_
            else:
                total = sum(n for s, n in announced if s != skip) if announced is not None else 0
                deviate = any(k * PIECE < total and said != min(PIECE, total - k * PIECE) for k, said in bad_sizes.items())
                assert announced is not None and sent == 0 and not deviate, round_
                valid = [(s, n) for s, n in announced if s != skip]
                assert got == [s for s, _ in valid], round_
                for step, size in valid:
                    assert (root / f"got-{step}").read_bytes() == _content(step, size), round_
                for name in _received(root):
                    (root / name).unlink()
        if round_ % 10 == 9:
            ring = Ring(group)
            assert ring.stream([(1, io.BytesIO(b"in step"))], forward=True, send=True, expect=True,
                               accept=_accept(root)) == [1]
            assert (root / "got-1").read_bytes() == b"in step"
            (root / "got-1").unlink()


def test_fuzz_random_streams_from_a_peer_rank(tmp_path: Path) -> None:
    launch(_fuzz, 2, str(tmp_path), 2026)
