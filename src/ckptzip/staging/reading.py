"""A host snapshot's read of the state on a thread of its own, while training goes on.

The read's GPU work runs on streams of its own, each of which first waits for the work the
caller had queued when the save was taken (so it reads the state as it was then); it holds at
most the GPU memory it was given (:func:`~ckptzip.memory.gpu.capped`). Writers of the state
wait for it (:mod:`ckptzip.engine.guard`) until every kernel and copy that reads the state has
run, not merely been queued.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

import torch

from ..engine import OverlappingRead
from ..errors import SnapshotAbandonedError
from ..memory import gpu

T = TypeVar("T")


class Reading(Generic[T]):
    """``read()`` on a thread of its own with ``streams`` current (one per GPU it reads); its
    result once it is over (:meth:`result`)."""

    def __init__(self, read: Callable[[], T], streams: dict[torch.device, torch.cuda.Stream],
                 caps: dict[torch.device, int]) -> None:
        for device, stream in streams.items():
            stream.wait_stream(torch.cuda.current_stream(device))  # the state as the caller left it
        self._guard = OverlappingRead().start()
        self._result: T | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(read, streams, caps), name="ckptzip-read",
                                        daemon=True)
        self._thread.start()

    def _run(self, read: Callable[[], T], streams: dict[torch.device, torch.cuda.Stream],
             caps: dict[torch.device, int]) -> None:
        try:
            with contextlib.ExitStack() as stack:
                for stream in streams.values():
                    stack.enter_context(torch.cuda.stream(stream))
                stack.enter_context(gpu.capped(caps))
                self._result = read()
                for stream in streams.values():
                    stream.synchronize()  # every kernel that reads the state has run
        except BaseException as exc:  # handed over by result()
            self._error = exc
        finally:
            self._guard.finish()

    def wait(self) -> None:
        """Until the read is over (what a writer of the state does)."""
        self._guard.wait()

    def result(self) -> T:
        """The read's result; its error, if it failed; :class:`SnapshotAbandonedError` if a writer
        stopped waiting for it (its bytes may be torn)."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        if self._guard.gave_up_after is not None:
            raise SnapshotAbandonedError(
                f"the state's read did not end within {self._guard.gave_up_after:.0f} s, and the optimizer step (or the "
                "code in CheckpointManager.guard()) that waited for it went on; this checkpoint was not written, "
                "the previous ones are intact")
        assert self._result is not None
        return self._result
