"""The copies a save queues to the host stay few (:class:`ckptzip.engine.staging.CopiesAhead`):
a small read back waits for every copy to the host queued before it."""

from __future__ import annotations

import io

import pytest
import torch

import ckptzip
from ckptzip.engine import staging
from ckptzip.engine.staging import CopiesAhead


class _Done:
    """A stand-in for a CUDA event: says when it was waited for."""

    def __init__(self, log: list[str], name: str) -> None:
        self.log, self.name = log, name

    def synchronize(self) -> None:
        self.log.append(self.name)


def test_copies_are_waited_for_oldest_first_once_the_bytes_ahead_would_pass_the_limit() -> None:
    log: list[str] = []
    ahead = CopiesAhead(limit=100, refill_at=1.0)
    for name, n in (("a", 40), ("b", 40)):
        ahead.wait_for_room(n)
        ahead.queued(_Done(log, name), n)  # type: ignore[arg-type]
    assert log == []
    ahead.wait_for_room(40)  # 120 > 100: the oldest first
    assert log == ["a"]
    ahead.queued(_Done(log, "c"), 40)  # type: ignore[arg-type]
    ahead.wait_for_room(100)  # only what is needed: b and c, not more
    assert log == ["a", "b", "c"]


def test_once_full_the_queue_drains_to_its_refill_mark_so_the_thread_wakes_once_for_several_copies() -> None:
    log: list[str] = []
    ahead = CopiesAhead(limit=100, refill_at=0.5)
    for name in "abcd":
        ahead.wait_for_room(25)
        ahead.queued(_Done(log, name), 25)  # type: ignore[arg-type]
    assert log == []
    ahead.wait_for_room(25)
    assert log == ["a", "b"]  # down to 50, not just to 75


def test_a_copy_larger_than_the_limit_still_goes_once_nothing_else_is_queued() -> None:
    log: list[str] = []
    ahead = CopiesAhead(limit=10)
    ahead.wait_for_room(1000)
    ahead.queued(_Done(log, "big"), 1000)  # type: ignore[arg-type]
    ahead.wait_for_room(1000)
    assert log == ["big"]


@pytest.mark.gpu
def test_a_gpu_save_never_queues_more_than_the_limit_ahead_and_stays_bit_exact(
        monkeypatch: pytest.MonkeyPatch) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    most = [0]
    queued = CopiesAhead.queued

    def watched(self: CopiesAhead, done: torch.cuda.Event, nbytes: int) -> None:
        queued(self, done, nbytes)
        most[0] = max(most[0], self._bytes)

    monkeypatch.setattr(CopiesAhead, "queued", watched)
    state = {f"w{i}": torch.randn(1 << 22, device="cuda") * 0.02 for i in range(24)}  # 400 MB
    blob = io.BytesIO()
    ckptzip.save(state, blob)
    back = ckptzip.load(blob.getvalue(), map_location="cuda")
    assert all(torch.equal(back[k].view(torch.uint8), v.view(torch.uint8)) for k, v in state.items())
    assert 0 < most[0] <= staging.COPY_AHEAD_BYTES
